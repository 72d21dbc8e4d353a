"""The ``gradcomp`` command: Lightning's CLI with the gradcomp strategies registered, plus ``compare``.

* ``gradcomp fit --config recipes/X.yaml`` (and ``validate``, ``test``, ``predict``) is a
  :class:`~lightning.pytorch.cli.LightningCLI`: every key of the recipe can be overridden on the
  command line (``--trainer.devices=4``, ``--trainer.strategy.init_args.density=0.01``), and
  every run ends with a :class:`~lightning_gradcomp.examples.summary.RunSummary` table (accuracy,
  loss, bytes per step, compression ratio, fit time).
* ``gradcomp compare --config recipes/X.yaml --strategies ddp,ddp_topk,...`` runs the recipe once
  per strategy, each as its own ``gradcomp fit`` process (Lightning's DDP launcher re-runs the
  command line in every rank, so one run per command is the robust shape), then tabulates the
  runs and writes ``results.csv``, ``results.json`` and ``accuracy.png``.
* ``gradcomp demo``: a short Top-k run on the built-in teacher task, without a recipe.

Importing this module imports :mod:`lightning_gradcomp`, which registers the named strategies, so
``--trainer.strategy=ddp_topk`` resolves in the launching process and in every DDP rank.
"""

from __future__ import annotations

import argparse
import csv
import difflib
import importlib
import inspect
import json
import os
import re
import signal
import subprocess
import sys
import time
import traceback
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

from jsonargparse import DefaultHelpFormatter, Namespace
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.strategies import StrategyRegistry
from lightning.pytorch.utilities.exceptions import MisconfigurationException

import lightning_gradcomp  # noqa: F401  (registers the named strategies with Lightning)
from lightning_gradcomp.comm import AGGREGATORS
from lightning_gradcomp.compressors import COMPRESSORS
from lightning_gradcomp.examples.datafiles import CorruptDataError, MissingDataError
from lightning_gradcomp.examples.summary import BYTES_FROM_PARAMETERS, RunSummary
from lightning_gradcomp.memory import MEMORIES
from lightning_gradcomp.strategy import GradCompStrategy
from lightning_gradcomp.validation import check_density

PROG = "gradcomp"
#: ``gradcomp compare --strategies`` entry that keeps the recipe's own strategy.
RECIPE_STRATEGY = "recipe"
#: DDP arguments that GradCompStrategy sets itself; jsonargparse fills them with ``None`` defaults.
_COLORS = (
    "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf",
)  # fmt: skip
_LINESTYLES = ("-", "--", "-.", ":")  # identical runs (ddp and ddp_gradcomp_dense) stay visible on top of each other


class _HelpFormatter(DefaultHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """jsonargparse's help, with descriptions and epilogs printed as written (the registry tables)."""


def _first_line(obj: object) -> str:
    return ((obj.__doc__ or "").strip().splitlines() or [""])[0].rstrip(".").replace("``", "")


def gradcomp_strategies() -> dict[str, str]:
    """Names and descriptions of the registered strategies built on :class:`GradCompStrategy`."""
    out = {}
    for name in sorted(StrategyRegistry.available_strategies()):
        entry = StrategyRegistry[name]
        if isinstance(entry["strategy"], type) and issubclass(entry["strategy"], GradCompStrategy):
            out[name] = entry.get("description", "")
    return out


def registry_help() -> str:
    """What is registered: strategies, compressors, memories and aggregators, for ``gradcomp --help``."""
    strategies = {"ddp": "Lightning's DDP, uncompressed: the dense baseline", **gradcomp_strategies()}
    width = max(map(len, [*strategies, *COMPRESSORS])) + 2
    lines = ["registered strategies (--trainer.strategy=NAME):"]
    lines += [f"  {name:<{width}}{desc}" for name, desc in strategies.items()]
    lines += ["", "compressors (--trainer.strategy.init_args.compressor=NAME):"]
    lines += [f"  {name:<{width}}{_first_line(cls)}" for name, cls in sorted(COMPRESSORS.items())]
    lines += [
        "",
        f"memories (init_args.memory): {', '.join(sorted(MEMORIES))}",
        f"aggregators (init_args.aggregator): {', '.join([*sorted(AGGREGATORS), 'auto'])}",
        "",
        "more commands:",
        f"  {PROG} compare --config RECIPE --strategies ddp,ddp_topk,...",
        "        run a recipe once per strategy; table, CSV, JSON and a PNG of the accuracy curves",
        f"  {PROG} demo   a short Top-k run on 2 CPU processes, no recipe needed",
        "",
        "examples:",
        f"  {PROG} fit --config recipes/quickstart.yaml",
        f"  {PROG} fit --config recipes/resnet20_cifar10_topk.yaml --data.init_args.data_dir=DIR --trainer.devices=4",
        f"  {PROG} fit --config recipes/quickstart.yaml --trainer.strategy.init_args.density=0.001",
        f"  {PROG} fit --config recipes/quickstart.yaml --trainer.strategy=ddp_terngrad",
        f"  {PROG} compare --config recipes/quickstart.yaml --strategies ddp,ddp_topk",
    ]
    return "\n".join(lines)


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
        names = [a.dest for a in parser._actions if isinstance(a.dest, str)]
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
                "usage": f"{PROG} [-h] [-c CONFIG] {{fit,validate,test,predict,compare,demo}} ...",
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


def _demo_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=f"{PROG} demo", description="Train a small MLP on CPU processes and show the bytes saved."
    )
    parser.add_argument("--devices", type=int, default=2, help="CPU processes (default: 2)")
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps (default: 300)")
    sparsifiers = sorted(name for name, cls in COMPRESSORS.items() if "density" in _parameters(cls))
    parser.add_argument("--compressor", choices=["none", *sparsifiers], default="topk")
    parser.add_argument("--density", type=float, default=0.01, help="Top-k density in (0, 1] (default: 0.01)")
    return parser


def demo_main(argv: Sequence[str]) -> int:
    """``gradcomp demo``: :func:`lightning_gradcomp.examples.demo.run_demo` with checked arguments."""
    parser = _demo_parser()
    args = parser.parse_args(list(argv))
    if args.devices < 1 or args.steps < 1:
        parser.error(f"--devices and --steps must be >= 1, got {args.devices} and {args.steps}")
    try:
        check_density("density", args.density)
    except ValueError as err:
        parser.error(f"--density: {err}")
    from lightning_gradcomp.examples.demo import run_demo

    run_demo(devices=args.devices, steps=args.steps, compressor=args.compressor, density=args.density)
    return 0


# ----------------------------------------------------------------------------------------------- compare


def parse_strategies(spec: str) -> list[str]:
    """The comma-separated strategy names of ``--strategies``, checked against Lightning's registry."""
    names = [name.strip() for name in spec.split(",") if name.strip()]
    if not names:
        raise ValueError(f"--strategies must name at least one strategy, got {spec!r}")
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise ValueError(f"--strategies names {duplicates} more than once")
    known = set(StrategyRegistry.available_strategies()) | {RECIPE_STRATEGY}
    unknown = [name for name in names if name not in known]
    if unknown:
        allowed = ["ddp", *gradcomp_strategies(), RECIPE_STRATEGY]
        raise ValueError(f"--strategies: unknown strategy {', '.join(map(repr, unknown))}; registered: {allowed}")
    return names


def fit_command(config: Path, strategy: str, run_dir: Path, overrides: Sequence[str]) -> list[str]:
    """The ``gradcomp fit`` command line of one comparison run (as ``python -m lightning_gradcomp.cli``)."""
    command = [sys.executable, "-m", "lightning_gradcomp.cli", "fit", "--config", str(config)]
    if strategy != RECIPE_STRATEGY:
        command.append(f"--trainer.strategy={strategy}")
    command += [
        f"--trainer.default_root_dir={run_dir}",
        f"--summary.path={run_dir / 'summary.json'}",
        *overrides,
    ]
    return command


def _run(command: list[str], log: Path, timeout: float | None) -> int:
    """Run ``command`` in its own session, output to ``log``; on timeout, end its whole process group."""
    with log.open("w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            return process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            out.write(f"\n{PROG} compare: killed after {timeout} s\n")
            return -signal.SIGKILL


def run_comparison(
    config: Path, strategies: Sequence[str], out_dir: Path, overrides: Sequence[str] = (), timeout: float | None = None
) -> list[dict[str, Any]]:
    """Fit the recipe ``config`` once per strategy (one process tree each); one record per run.

    A record holds the strategy, exit status, wall time (process start to exit, imports and
    process launch included), the log file, and the run's :class:`RunSummary` (``None`` if the
    run failed before writing it).
    """
    records = []
    for i, strategy in enumerate(strategies, start=1):
        run_dir = out_dir / "runs" / strategy
        run_dir.mkdir(parents=True, exist_ok=True)
        summary_path = run_dir / "summary.json"
        summary_path.unlink(missing_ok=True)
        log = run_dir / "log.txt"
        print(f"[{i}/{len(strategies)}] {strategy}: fitting (log: {log})", flush=True)
        start = time.perf_counter()
        returncode = _run(fit_command(config, strategy, run_dir, overrides), log, timeout)
        wall = time.perf_counter() - start
        summary = json.loads(summary_path.read_text()) if summary_path.is_file() else None
        if returncode != 0 or summary is None:
            tail = "".join(log.read_text(errors="replace").splitlines(keepends=True)[-15:])
            print(f"[{i}/{len(strategies)}] {strategy}: failed (exit status {returncode}); end of its log:\n{tail}")
        records.append(
            {
                "strategy": strategy,
                "returncode": returncode,
                "ok": returncode == 0 and summary is not None,
                "wall_seconds": wall,
                "log": str(log),
                "summary": summary,
            }
        )
    return records


#: Columns of ``results.csv`` (and of the printed table, with the units spelled out there).
CSV_COLUMNS = (
    "strategy",
    "ok",
    "val_acc",
    "val_loss",
    "bytes_sent_per_step",
    "dense_bytes_per_step",
    "compression_ratio",
    "bytes_source",
    "compressed_steps",
    "exchange_steps",
    "global_step",
    "fit_seconds",
    "wall_seconds",
)


def result_rows(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One flat row per run with the :data:`CSV_COLUMNS` (``None`` where a failed run has no value)."""
    rows = []
    for record in records:
        summary = record["summary"] or {}
        row = {column: summary.get(column) for column in CSV_COLUMNS}
        row.update(strategy=record["strategy"], ok=record["ok"], wall_seconds=record["wall_seconds"])
        rows.append(row)
    return rows


#: Strategies ``compare`` treats as the dense baseline, in order of preference.
DENSE_BASELINES = ("ddp", "ddp_gradcomp_dense")


def comparison_table(rows: Sequence[dict[str, Any]], title: str) -> Any:
    """The rich table ``gradcomp compare`` prints.

    When a dense baseline (:data:`DENSE_BASELINES`) ran, every other run also shows what a user
    judges it by: its accuracy against the baseline's (points), the bytes it saved over the run, and
    its fit time as a multiple of the baseline's (on this machine's links, not a slow one).
    """
    from rich.table import Table

    ok = {row["strategy"]: row for row in rows if row["ok"]}
    baseline = next((ok[name] for name in DENSE_BASELINES if name in ok), None)
    table = Table(title=title)
    columns = ["strategy", "val_acc", "val_loss", "sent B/step", "dense B/step", "ratio", "fit s", "wall s"]
    if baseline is not None:
        columns += [f"acc vs {baseline['strategy']}", "MB saved", f"fit s x {baseline['strategy']}"]
    for column in columns:
        table.add_column(column, justify="left" if column == "strategy" else "right")

    def fmt(value: Any, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    for row in rows:
        if not row["ok"]:
            cells = [row["strategy"], "failed", "", "", "", "", "", fmt(row["wall_seconds"], ".1f")]
            table.add_row(*cells, *([""] * (len(columns) - len(cells))))
            continue
        sent = fmt(row["bytes_sent_per_step"], ",.0f")
        if row["bytes_source"] == BYTES_FROM_PARAMETERS:
            sent += " *"
        ratio = row["compression_ratio"]
        cells = [
            row["strategy"],
            fmt(row["val_acc"], ".4f"),
            fmt(row["val_loss"], ".4f"),
            sent,
            fmt(row["dense_bytes_per_step"], ",.0f"),
            "-" if ratio is None else f"{ratio:.1f}x",
            fmt(row["fit_seconds"], ".1f"),
            fmt(row["wall_seconds"], ".1f"),
        ]
        if baseline is not None:
            cells += _against_baseline(row, baseline) if row is not baseline else ["-", "-", "-"]
        table.add_row(*cells)
    if any(row["ok"] and row["bytes_source"] == BYTES_FROM_PARAMETERS for row in rows):
        table.caption = (
            "* plain DDP: bytes of the gradients it allreduces (trainable parameters), not counted by a hook"
        )
    return table


def _against_baseline(row: dict[str, Any], baseline: dict[str, Any]) -> list[str]:
    """Accuracy difference (points), megabytes saved over the run, fit time as a multiple of the baseline's."""
    accuracy = (
        f"{100 * (row['val_acc'] - baseline['val_acc']):+.2f} pt"
        if row["val_acc"] is not None and baseline["val_acc"] is not None
        else "-"
    )
    sent, dense, steps = row["bytes_sent_per_step"], row["dense_bytes_per_step"], row["exchange_steps"]
    saved = f"{(dense - sent) * steps / 1e6:,.1f}" if None not in (sent, dense, steps) else "-"
    fit, base_fit = row["fit_seconds"], baseline["fit_seconds"]
    time = f"{fit / base_fit:.2f}" if fit and base_fit else "-"
    return [accuracy, saved, time]


def plot_curves(records: Sequence[dict[str, Any]], path: Path, title: str, accuracy: str = "val_acc") -> list[dict]:
    """Plot each run's validation accuracy against the optimizer step into the PNG ``path``.

    Uses matplotlib's object API (no pyplot state, no display needed). Returns one entry per
    curve drawn: strategy, line colour and number of points.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(7.0, 4.5), dpi=120)
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    curves = []
    for i, record in enumerate(r for r in records if r["ok"]):
        points = [p for p in record["summary"]["curve"] if p.get(accuracy) is not None]
        if not points:
            continue
        color = _COLORS[i % len(_COLORS)]
        axes.plot(
            [p["step"] for p in points],
            [p[accuracy] for p in points],
            color=color,
            linestyle=_LINESTYLES[i % len(_LINESTYLES)],
            marker="o",
            markersize=3,
            linewidth=2,
            label=record["strategy"],
        )
        curves.append({"strategy": record["strategy"], "color": color, "points": len(points)})
    axes.set_xlabel("optimizer step")
    axes.set_ylabel(accuracy)
    axes.set_title(title)
    axes.grid(alpha=0.3)
    if curves:
        axes.legend()
    figure.tight_layout()
    figure.savefig(path)
    return curves


def compare_main(argv: Sequence[str]) -> int:
    """``gradcomp compare``: see :func:`run_comparison`; exit status 1 if any run failed."""
    parser = argparse.ArgumentParser(
        prog=f"{PROG} compare",
        description="Fit one recipe once per strategy and compare accuracy, loss, bytes per step and time.",
        epilog=(
            "Any other --key=value option is passed on to every `gradcomp fit` (e.g. --trainer.max_steps=100).\n"
            f"'{RECIPE_STRATEGY}' in --strategies keeps the recipe's own strategy; 'ddp' is Lightning's DDP,\n"
            "whose bytes per step are the gradients it allreduces (the trainable parameters' bytes).\n\n"
            + registry_help().split("\n\ncompressors")[0]
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    parser.add_argument("-c", "--config", required=True, type=Path, help="the recipe (YAML)")
    parser.add_argument(
        "--strategies", required=True, help=f"comma-separated strategy names, e.g. ddp,ddp_topk ('{RECIPE_STRATEGY}')"
    )
    parser.add_argument(
        "--out", type=Path, default=None, help="output directory (default: gradcomp_compare/<recipe name>)"
    )
    parser.add_argument("--timeout", type=float, default=None, help="seconds allowed per run (default: no limit)")
    args, overrides = parser.parse_known_args(list(argv))
    try:
        strategies = parse_strategies(args.strategies)
    except ValueError as err:
        parser.error(str(err))
    if not args.config.is_file():
        parser.error(f"--config: no recipe at {args.config}")
    if args.timeout is not None and not args.timeout > 0:
        parser.error(f"--timeout must be > 0 seconds, got {args.timeout}")
    strays = [o for o in overrides if o.startswith("-") and not o.startswith("--")]
    if strays:
        parser.error(f"unrecognized arguments: {' '.join(strays)}")
    out_dir = args.out or Path("gradcomp_compare") / args.config.stem
    out_dir.mkdir(parents=True, exist_ok=True)

    records = run_comparison(args.config.resolve(), strategies, out_dir, overrides, args.timeout)
    rows = result_rows(records)
    title = f"{args.config.name}: {len(strategies)} strategies"
    with (out_dir / "results.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    plot: dict[str, Any] = {"file": None, "curves": []}
    try:
        plot["curves"] = plot_curves(records, out_dir / "accuracy.png", title)
        plot["file"] = str(out_dir / "accuracy.png")
    except ImportError:
        print(f"{PROG} compare: matplotlib is not installed, no plot (pip install 'lightning-gradcomp[plot]')")
    report = {
        "config": str(args.config),
        "strategies": strategies,
        "overrides": list(overrides),
        "rows": rows,
        "runs": records,
        "plot": plot,
    }
    (out_dir / "results.json").write_text(json.dumps(report, indent=2))

    from rich.console import Console

    console = Console()
    if not console.is_terminal:  # a log file or a pipe: do not wrap the table at 80 columns
        console = Console(width=160)
    console.print(comparison_table(rows, title))
    names = ["results.csv", "results.json", *(["accuracy.png"] if plot["file"] else [])]
    print(f"wrote {', '.join(str(out_dir / name) for name in names)}")
    return 0 if all(record["ok"] for record in records) else 1


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
    try:
        run_cli(None if argv is None else args)
    except (MissingDataError, CorruptDataError) as err:
        sys.stderr.write(f"{PROG}: error: {err}\n")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
