"""The ``gradcomp`` command: Lightning's CLI with the gradcomp strategies registered; ``compare`` and ``demo``.

* ``gradcomp fit --config recipes/X.yaml`` (and ``validate``, ``test``, ``predict``) is a
  :class:`~lightning.pytorch.cli.LightningCLI`: every key of the recipe can be overridden on the
  command line (``--trainer.devices=4``, ``--trainer.strategy.init_args.density=0.01``), and
  every run ends with a :class:`~lightning_gradcomp.examples.summary.RunSummary` table (accuracy,
  loss, bytes per step, compression ratio, fit time).
* ``gradcomp compare --config recipes/X.yaml --strategies ddp,ddp_topk,...`` runs the recipe once
  per strategy, each as its own ``gradcomp fit`` process (Lightning's DDP launcher re-runs the
  command line in every rank, so one run per command is the robust shape), then tabulates the
  runs and writes ``results.csv``, ``results.json`` and ``accuracy.png`` (:mod:`lightning_gradcomp.cli.compare`).
* ``gradcomp demo``: a short Top-k run on the built-in teacher task, without a recipe
  (:mod:`lightning_gradcomp.cli.demo`).
* ``gradcomp strategies``: every registered strategy of every front end, its description and what it sends
  (:mod:`lightning_gradcomp.cli.catalog`).

This module holds the LightningCLI subclass, its error messages and the dispatch of the commands.

Importing this module imports :mod:`lightning_gradcomp`, which registers the named strategies, so
``--trainer.strategy=ddp_topk`` resolves in the launching process and in every DDP rank.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import inspect
import re
import sys
import traceback
import warnings
from collections.abc import Sequence
from typing import Any, NoReturn

from jsonargparse import DefaultHelpFormatter, Namespace
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.utilities.exceptions import MisconfigurationException

import lightning_gradcomp  # noqa: F401  (registers the named strategies with Lightning)
from lightning_gradcomp.cli.catalog import PROG, registry_help, strategies_main
from lightning_gradcomp.cli.compare import compare_main
from lightning_gradcomp.cli.demo import demo_main
from lightning_gradcomp.examples.datafiles import CorruptDataError, MissingDataError
from lightning_gradcomp.examples.summary import RunSummary


class _HelpFormatter(DefaultHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """jsonargparse's help, with descriptions and epilogs printed as written (the registry tables)."""


def _union_reasons(text: str) -> list[str]:
    """What each alternative of a jsonargparse ``Union`` error said, minus the "not a string" of ``str | Class``."""
    if "Errors:" not in text:
        return []
    block = text.split("Errors:", 1)[1].split("Given value type:", 1)[0]
    items = (" ".join(item.split()) for item in re.split(r"\n\s*- ", "\n" + block))
    return [item for item in items if item and not item.startswith("Expected a <class")]


def _suggestion(message: str, parser: LightningArgumentParser) -> str:
    """``did you mean ...?`` for an option jsonargparse did not accept, from the names it would accept."""
    typo = re.search(r"does not accept option '([\w.]+)'", message)
    if typo:
        names = list(parser.get_defaults(skip_validation=True).keys())  # every option's dotted key
    else:
        typo = re.search(r"Option '(\w+)' is not accepted", message)
        cls = _class_of(next(iter(re.findall(r"class_path '([\w.]+)'", message)), None))
        names = list(inspect.signature(cls).parameters) if typo and cls is not None else []
    close = difflib.get_close_matches(typo.group(1), names, n=3) if typo else []
    return f" (did you mean {' or '.join(map(repr, close))}?)" if close else ""


class _Parser(LightningArgumentParser):
    """Lightning's parser, whose errors are short: the key, what is wrong, where to look; no 50 lines of usage."""

    def error(self, message: str, ex: Exception | None = None) -> NoReturn:
        if not self.exit_on_error:
            super().error(message, ex)
        parser = getattr(ex, "subcommand_parser", None) or self
        prog = parser.prog.replace(" [options]", "")
        reasons = _union_reasons(message)
        if reasons:
            message = f"{message.splitlines()[0].rstrip(':')}: {'; '.join(reasons)}"
        message = " ".join(message.split())
        message += _suggestion(message, parser)
        sys.stderr.write(f"{prog}: error: {message}\ntip: for the accepted options run: {prog} --help\n")
        raise SystemExit(2)


def _class_of(class_path: Any) -> type | None:
    if not isinstance(class_path, str) or "." not in class_path:
        return None
    module, _, name = class_path.rpartition(".")
    try:
        found = getattr(importlib.import_module(module), name, None)
    except ImportError:
        return None
    return found if isinstance(found, type) else None


def _class_keys(config: Any, prefix: str = "") -> dict[str, str]:
    """``{key: class_path}`` of every class given by ``class_path`` in a (nested) config."""
    found: dict[str, str] = {}
    if isinstance(config, Namespace):
        config = config.as_dict()
    if isinstance(config, dict):
        if isinstance(config.get("class_path"), str):
            found[prefix or "(root)"] = config["class_path"]
        for key, value in config.items():
            found.update(_class_keys(value, f"{prefix}.{key}" if prefix else str(key)))
    elif isinstance(config, list):
        for i, value in enumerate(config):
            found.update(_class_keys(value, f"{prefix}[{i}]"))
    return found


def describe_instantiation_error(err: BaseException, config: Any) -> str:
    """A one-paragraph account of a class that refused its configuration: which key, which class, why.

    jsonargparse reports a class that failed inside a ``Union`` (``trainer.strategy`` is
    ``str | Strategy``) as a list of what each alternative said; keep the class's own message.
    Otherwise the innermost ``__init__`` of the traceback names the class.
    """
    text = str(err)
    reason = "; ".join(_union_reasons(text)) or " ".join(text.split())
    class_path = next(iter(re.findall(r"class_path='([\w.]+)'", text)), None)
    if class_path is None:
        frames = [f for f, _ in traceback.walk_tb(err.__traceback__) if f.f_code.co_name == "__init__"]
        owners = [type(f.f_locals["self"]) for f in frames if "self" in f.f_locals]
        if owners:
            class_path = f"{owners[-1].__module__}.{owners[-1].__qualname__}"
    keys = _class_keys(config)
    wanted = _class_of(class_path)
    key = next((k for k, v in keys.items() if v == class_path or (wanted and _class_of(v) is wanted)), None)
    # A nested class (the network inside the LightningModule) fails inside its parent's error:
    # the class among them whose arguments include the one the message starts with is the culprit.
    argument = re.match(r"[A-Za-z_]\w*", reason)
    if key is not None and argument:
        nested = {k: v for k, v in keys.items() if k == key or k.startswith(f"{key}.")}
        owners = [k for k, v in nested.items() if argument.group() in _parameters(_class_of(v))]
        if len(owners) == 1:
            key, class_path = owners[0], nested[owners[0]]
    where = f"{key} ({class_path})" if key else (class_path or "configuration")
    return f"{where}: {reason}"


def _parameters(cls: type | None) -> set[str]:
    if cls is None:
        return set()
    try:
        return set(inspect.signature(cls).parameters)
    except (TypeError, ValueError):
        return set()


class GradCompCLI(LightningCLI):
    """:class:`LightningCLI` for recipes: any LightningModule / DataModule by ``class_path``, a run summary.

    Differences from a bare ``LightningCLI()``:

    * the program is called ``gradcomp`` and ``--help`` lists the registered strategies,
      compressors, memories and aggregators;
    * every run has a :class:`RunSummary` callback, configured under ``summary:``;
    * ``config.yaml`` in the log directory is overwritten by a re-run instead of failing;
    * a class that refuses its arguments (``density: 2``, an unknown compressor) and argument
      errors end the command with a short message naming the key (exit status 2), not a traceback.
    """

    def __init__(self, args: Sequence[str] | None = None, run: bool = True) -> None:
        epilog = registry_help()
        sub = {"formatter_class": _HelpFormatter, "epilog": epilog}
        super().__init__(
            model_class=None,
            datamodule_class=None,
            save_config_kwargs={"overwrite": True},
            parser_kwargs={
                "prog": PROG,
                # compare and demo are dispatched before LightningCLI parses: name them in the usage line too
                "usage": f"{PROG} [-h] [-c CONFIG] [--print_config[=flags]] "
                "{fit,validate,test,predict,compare,demo,strategies} ...",
                "description": "Train with compressed gradient exchange: LightningCLI with the gradcomp strategies.",
                "formatter_class": _HelpFormatter,
                "epilog": epilog,
                **{name: dict(sub) for name in self.subcommands()},
            },
            parser_class=_Parser,
            args=None if args is None else list(args),
            run=run,
        )

    def parse_arguments(self, parser: LightningArgumentParser, args: Any) -> None:
        """Parse as Lightning does, without its warning that ``args`` was given while ``sys.argv`` is set.

        :func:`main` passes ``args`` on purpose (from tests, from ``run_cli``); the warning targets
        scripts that mix both by mistake.
        """
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="LightningCLI's args parameter is intended")
            super().parse_arguments(parser, args)

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        """Add the :class:`RunSummary` callback (``summary.path``, ``summary.print_table``, ...)."""
        parser.add_lightning_class_args(RunSummary, "summary")

    def _subcommand_config(self) -> Namespace:
        return self.config[self.subcommand] if self.subcommand else self.config

    def instantiate_classes(self) -> None:
        """Instantiate as Lightning does; a class that refuses its configuration ends the command (exit 2)."""
        try:
            super().instantiate_classes()
        except (ValueError, TypeError, MisconfigurationException, OSError) as err:
            config = self._subcommand_config()
            if hasattr(self, "config_init") and not isinstance(err, (MissingDataError, CorruptDataError)):
                message = f"trainer: {' '.join(str(err).split())}"
            else:
                message = describe_instantiation_error(err, config)
            self._parser(self.subcommand).error(f"invalid configuration: {message}")


def run_cli(args: Sequence[str] | None = None) -> GradCompCLI:
    """Parse ``args`` (default: ``sys.argv[1:]``), build the classes and run the subcommand; returns the CLI.

    Call it from a script or a test that runs in every rank already (torchrun, or the ``LOCAL_RANK``
    environment); on a single process, Lightning's DDP launcher re-runs ``sys.argv`` for the other
    ranks, which is only right when ``args`` came from ``sys.argv``.
    """
    return GradCompCLI(args=args)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``gradcomp`` console script (and of ``python -m lightning_gradcomp.cli``).

    ``argv`` defaults to ``sys.argv[1:]``. Runs that launch DDP processes must come from the
    command line: Lightning's launcher re-runs ``sys.argv`` in each new rank.
    """
    args = list(sys.argv[1:] if argv is None else argv)
    if not args:
        args, argv = ["--help"], ["--help"]
    if args[0] == "compare":
        return compare_main(args[1:])
    if args[0] == "demo":
        return demo_main(args[1:])
    if args[0] == "strategies":
        return strategies_main(args[1:])
    try:
        run_cli(None if argv is None else args)
    except (MissingDataError, CorruptDataError) as err:
        sys.stderr.write(f"{PROG}: error: {err}\n")
        return 1
    return 0
