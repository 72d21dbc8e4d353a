"""What the package registers, described from the tables the registries read: every front end's named strategies
(``gradcomp strategies``: each name, its front end, its one-line description and what it sends), the compressors,
memories and aggregators (``gradcomp --help``)."""

from __future__ import annotations

import argparse
import inspect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from lightning.fabric.strategies import STRATEGY_REGISTRY as FABRIC_REGISTRY
from lightning.pytorch.strategies import StrategyRegistry
from rich.console import Console
from rich.table import Table

from lightning_gradcomp.compressed_adam import COMPRESSED_ADAM_PRESETS, GradCompAdamStrategy
from lightning_gradcomp.core.comm import AGGREGATORS
from lightning_gradcomp.core.compressors import COMPRESSORS
from lightning_gradcomp.core.memory import MEMORIES
from lightning_gradcomp.core.pipeline_arguments import build_pipeline
from lightning_gradcomp.core.presets import PresetTable
from lightning_gradcomp.ddp.presets import DDP_VARIANTS, NAMED_STRATEGIES
from lightning_gradcomp.ddp.strategy import GradCompStrategy
from lightning_gradcomp.diloco import DILOCO_PRESETS, GradCompDiLoCoStrategy
from lightning_gradcomp.hsdp import HSDP_PRESETS, GradCompHSDPStrategy

#: The command's name.
PROG = "gradcomp"
#: The tensor what a strategy sends is measured on: a 1024 x 1024 float32 matrix of standard normals (seed 0).
REFERENCE_SHAPE = (1024, 1024)
#: The pipeline's arguments, as a front end's strategy takes them.
_PIPELINE = ("compressor", "compressor_kwargs", "density", "wire_precision", "memory", "memory_kwargs", "aggregator")


@dataclass(frozen=True)
class FrontEnd:
    """A front end as its registry sees it: its name, the Trainer strategy its names build, its preset table and the
    name configured by arguments alone (``None``: every name is a preset)."""

    name: str
    strategy: type
    presets: PresetTable
    configurable: str | None


FRONT_ENDS = (
    FrontEnd("DDP hook", GradCompStrategy, NAMED_STRATEGIES, GradCompStrategy.strategy_name),
    FrontEnd("DiLoCo", GradCompDiLoCoStrategy, DILOCO_PRESETS, None),
    FrontEnd("HSDP", GradCompHSDPStrategy, HSDP_PRESETS, GradCompHSDPStrategy.strategy_name),
    FrontEnd("compressed Adam", GradCompAdamStrategy, COMPRESSED_ADAM_PRESETS, GradCompAdamStrategy.strategy_name),
)


@dataclass(frozen=True)
class CatalogEntry:
    """One registered name: its front end, description, and the bits per element it sends of :data:`REFERENCE_SHAPE`
    each time it exchanges (every step, or every ``every`` steps)."""

    name: str
    front_end: str
    description: str
    bits_per_element: float
    every: int | None


def _defaults(strategy: type) -> dict[str, Any]:
    return {p.name: p.default for p in inspect.signature(strategy).parameters.values() if p.default is not p.empty}


def sent_bits_per_element(strategy: type, arguments: Mapping[str, Any]) -> float:
    """Bits per element ``strategy`` built with ``arguments`` puts on the wire for one exchange of the reference tensor:
    the byte count of its compressor's payload (the compressor an argument-free strategy falls back to: dense)."""
    given = {"memory": "none", "aggregator": "auto", **_defaults(strategy), **arguments}
    if given.get("compressor") is None:
        given["compressor"] = "none"
    codec, _ = build_pipeline(*(given.get(key) for key in _PIPELINE))
    x = torch.randn(REFERENCE_SHAPE, generator=torch.Generator().manual_seed(0))
    nbytes = codec.payload_nbytes(x.shape, x.dtype)
    if nbytes is None:  # the size depends on the data (ATOMO) or on a warm start (PowerSGD): compress it
        draws = torch.Generator().manual_seed(0)
        warm = codec.initial_state((x.shape,), x.dtype, x.device, draws) if codec.warm_started else None
        options = {"warm_start": warm} if warm is not None else {}
        nbytes = codec.compress(x, torch.Generator().manual_seed(0), **options).nbytes
    return 8 * nbytes / x.numel()


def strategy_catalog() -> list[CatalogEntry]:
    """Every front end's registered names, from the tables the registries read (the DDP presets' Lightning variants
    are left to a line of their own)."""
    entries = []
    for front_end in FRONT_ENDS:
        named = dict(front_end.presets)
        if front_end.configurable is not None:
            named = {front_end.configurable: ("configured by its arguments (here: their defaults)", {}), **named}
        for name, (description, arguments) in named.items():
            every = {**_defaults(front_end.strategy), **arguments}.get("sync_every")
            bits = sent_bits_per_element(front_end.strategy, arguments)
            entries.append(CatalogEntry(name, front_end.name, description, bits, every))
    return entries


def registered_names() -> dict[str, set[str]]:
    """The names each Lightning registry holds for this package's strategies (Trainer's and Fabric's)."""
    ours = tuple(front_end.strategy for front_end in FRONT_ENDS)
    trainer = {n for n in StrategyRegistry.available_strategies() if _built_by(StrategyRegistry[n], ours)}
    fabric_classes = tuple(entry["strategy"] for entry in FABRIC_REGISTRY.values() if _is_ours(entry["strategy"]))
    fabric = {n for n in FABRIC_REGISTRY.available_strategies() if _built_by(FABRIC_REGISTRY[n], fabric_classes)}
    return {"trainer": trainer, "fabric": fabric}


def _is_ours(strategy: Any) -> bool:
    return isinstance(strategy, type) and strategy.__module__.startswith("lightning_gradcomp.")


def _built_by(entry: Mapping[str, Any], classes: tuple[type, ...]) -> bool:
    return isinstance(entry["strategy"], type) and issubclass(entry["strategy"], classes)


def gradcomp_strategies() -> dict[str, str]:
    """Names and descriptions of the registered strategies built on the package's Trainer strategies (every front
    end's)."""
    out = {}
    for name in sorted(registered_names()["trainer"]):
        out[name] = StrategyRegistry[name].get("description", "")
    return out


def strategies_main(argv: Sequence[str]) -> int:
    """``gradcomp strategies``: every registered name of every front end, its description and what it sends."""
    parser = argparse.ArgumentParser(
        prog=f"{PROG} strategies",
        description="Every strategy name this package registers with the Trainer and Fabric, by front end, with what "
        f"it sends for a {REFERENCE_SHAPE[0]} x {REFERENCE_SHAPE[1]} float32 tensor (fp32 sends 32 bits an element).",
    )
    parser.parse_args(list(argv))
    table = Table(title="lightning_gradcomp strategies", show_lines=False)
    for column in ("strategy=", "front end", "bits / element", "what it is"):
        table.add_column(column, overflow="fold")
    for entry in strategy_catalog():
        sent = f"{entry.bits_per_element:.3g}" + (f" every {entry.every} steps" if entry.every else " every step")
        table.add_row(entry.name, entry.front_end, sent, entry.description)
    for suffix, options in DDP_VARIANTS.items():
        table.add_row(f"<DDP preset>_{suffix}", "DDP hook", "as the preset", f"any DDP preset with {options}")
    Console(width=160).print(table)
    return 0


def _first_line(obj: object) -> str:
    return ((obj.__doc__ or "").strip().splitlines() or [""])[0].rstrip(".").replace("``", "")


def registry_help() -> str:
    """What is registered: strategies, compressors, memories and aggregators, for ``gradcomp --help``."""
    # the presets' DDP variants (``<preset>_find_unused_parameters_true``) as one line each, not one per preset
    named = {n: d for n, d in gradcomp_strategies().items() if not any(n.endswith(f"_{s}") for s in DDP_VARIANTS)}
    variants = {f"<preset>_{suffix}": f"any preset above with {options}" for suffix, options in DDP_VARIANTS.items()}
    strategies = {"ddp": "Lightning's DDP, uncompressed: the dense baseline", **named, **variants}
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
        f"  {PROG} strategies",
        "        every registered strategy of every front end, with what it sends",
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
