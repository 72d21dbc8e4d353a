"""The package's shape: the shared core imports no front end, a front end imports only the core and itself, and the
public names and registered strategies stay what users import and name.

The layers, bottom up: ``lightning_gradcomp.core`` (compressors, comm, memory, units, schedules, randomness,
checkpoint shards, statistics, validation, the flat and two-phase averages); the front ends ``ddp``, ``diloco``,
``hsdp`` and ``compressed_adam``; and on top ``callbacks``, ``cli``, ``examples`` and the package's ``__init__``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from lightning.fabric.strategies import STRATEGY_REGISTRY
from lightning.pytorch.strategies import StrategyRegistry

import lightning_gradcomp
from lightning_gradcomp.cli.catalog import registered_names, strategy_catalog
from lightning_gradcomp.ddp.presets import DDP_VARIANTS

PACKAGE = Path(lightning_gradcomp.__file__).parent
CORE = "core"
FRONT_ENDS = ("ddp", "diloco", "hsdp", "compressed_adam")
TOP = ("callbacks", "cli", "examples")


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Every ``lightning_gradcomp`` module ``path`` imports, at module level or inside a function."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "lightning_gradcomp":
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.split(".")[0] == "lightning_gradcomp"}
    return found


def _layer(module: str) -> str:
    """``core``, a front end's name, or ``top`` (the package itself, callbacks, cli, examples)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in (CORE, *FRONT_ENDS) else "top"


def _upward_or_sideways(importer: str, imported: str) -> bool:
    here, there = _layer(importer), _layer(imported)
    if here == CORE:
        return there != CORE  # the core imports the core only (never the package, which imports every front end)
    if here in FRONT_ENDS:
        return there not in (CORE, here)
    return False


def test_no_import_runs_upward_or_sideways_between_front_ends() -> None:
    modules = {_module_name(path): path for path in PACKAGE.rglob("*.py")}
    assert {_layer(name) for name in modules} == {CORE, *FRONT_ENDS, "top"}
    assert {name.split(".")[1] for name in modules if _layer(name) == "top" and "." in name} == set(TOP)
    wrong = sorted(
        f"{importer} imports {imported}"
        for importer, path in modules.items()
        for imported in _imports(path)
        if _upward_or_sideways(importer, imported)
    )
    assert wrong == []


def test_the_walk_sees_a_wrong_import() -> None:
    """The check above can fail: an import of a front end from the core, or of one front end from another, is seen."""
    assert _upward_or_sideways("lightning_gradcomp.core.memory", "lightning_gradcomp.ddp.hook")
    assert _upward_or_sideways("lightning_gradcomp.core.memory", "lightning_gradcomp")
    assert _upward_or_sideways("lightning_gradcomp.diloco.outer", "lightning_gradcomp.hsdp.replica")
    assert _upward_or_sideways("lightning_gradcomp.hsdp.settings", "lightning_gradcomp.callbacks")
    assert not _upward_or_sideways("lightning_gradcomp.hsdp.settings", "lightning_gradcomp.core.flat_average")
    assert not _upward_or_sideways("lightning_gradcomp.callbacks._common", "lightning_gradcomp.hsdp")
    assert _imports(Path(__file__)) >= {"lightning_gradcomp.cli.catalog", "lightning_gradcomp.ddp.presets"}


#: What users import from the package: unchanged by any reshaping of the modules below it (a feature adds to it).
PUBLIC = [
    "AGGREGATORS", "COMPRESSED_ADAM_PRESETS", "COMPRESSORS", "DILOCO_PRESETS", "HSDP_PRESETS", "MEMORIES",
    "NAMED_STRATEGIES", "AllgatherAggregator", "AllreduceAggregator", "AtomoCompressor", "BlockQuantizer",
    "BoundCheck", "ChoosersAggregator", "ChunkedTopKCompressor", "CompressedAdam", "CompressionMonitor", "Compressor",
    "DGCCompressor", "Diana", "ErrorFeedback", "FP8Compressor", "GTopKAggregator", "GaussianKCompressor",
    "GradCompAdamFabricStrategy", "GradCompAdamStrategy", "GradCompDiLoCoFabricStrategy", "GradCompDiLoCoStrategy",
    "GradCompFabricStrategy", "GradCompHSDPFabricStrategy", "GradCompHSDPStrategy", "GradCompHook",
    "GradCompStrategy", "GradientHistogram", "IdentityCompressor", "Int8Compressor", "Memory", "NoMemory",
    "OuterSync", "PowerSGDCompressor", "QSGDCompressor", "RandomKCompressor", "ReplicaExchange",
    "ScaledSignCompressor", "StepStats", "TernGradCompressor", "TopKCompressor", "TwoBitValues",
    "TwoPhaseAggregator", "WirePrecision", "__version__", "gradcomp_comm_hook", "make_hook",
]  # fmt: skip
#: The names registered with the Trainer and with Fabric (besides each DDP preset's Lightning variants).
TRAINER_NAMES = {
    "ddp_gradcomp", "ddp_gradcomp_dense", "ddp_atomo", "ddp_diana", "ddp_efsign", "ddp_fp16", "ddp_bf16",
    "ddp_gaussiank", "ddp_gtopk", "ddp_powersgd", "ddp_terngrad", "ddp_topk", "ddp_int8", "ddp_fp8", "ddp_diloco",
    "ddp_diloco_topk", "ddp_compressed_adam", "ddp_onebit_adam", "ddp_topk_adam", "ddp_qsgd_adam",
    "ddp_diloco_qsgd", "ddp_diloco_sparseloco", "hsdp_gradcomp", "hsdp_topk", "hsdp_dense",
}  # fmt: skip


def test_the_public_names_and_registered_strategies_are_unchanged() -> None:
    assert sorted(lightning_gradcomp.__all__) == sorted(PUBLIC)
    assert all(getattr(lightning_gradcomp, name) is not None for name in PUBLIC)
    variants = {f"{name}_{suffix}" for name in lightning_gradcomp.NAMED_STRATEGIES for suffix in DDP_VARIANTS}
    registered = registered_names()
    assert registered["trainer"] == TRAINER_NAMES | variants
    assert registered["fabric"] == TRAINER_NAMES | variants
    for name in TRAINER_NAMES:
        assert name in StrategyRegistry and name in STRATEGY_REGISTRY


def test_gradcomp_strategies_lists_every_registered_name_from_the_registries_tables() -> None:
    """Every name the Trainer's registry holds (a DDP preset's Lightning variants as one line), each with its
    registry's description and the bits per element its compressor's payload holds."""
    entries = {entry.name: entry for entry in strategy_catalog()}
    assert set(entries) == TRAINER_NAMES
    for name, entry in entries.items():
        if name not in ("ddp_gradcomp", "hsdp_gradcomp", "ddp_compressed_adam"):
            assert entry.description == StrategyRegistry[name]["description"], name
    assert entries["ddp_gradcomp_dense"].bits_per_element == 32.0
    assert entries["ddp_fp16"].bits_per_element == entries["ddp_bf16"].bits_per_element == 16.0
    assert entries["ddp_efsign"].bits_per_element == pytest.approx(1.0, abs=1e-3)  # a bit and a scale per tensor
    assert entries["ddp_diloco_qsgd"].bits_per_element == 4.5  # 4-bit codes and a float32 norm per 64
    assert entries["ddp_diloco"].every == entries["ddp_diloco_topk"].every == 500
    assert entries["ddp_topk"].every is None
    assert 0 < entries["ddp_topk"].bits_per_element < 0.3  # 1% of the entries: a bf16 value and ~8.6 index bits each
