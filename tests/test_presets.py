"""Presets combined with any argument, DDP's own included: ``from_preset``, ``make_hook(preset=...)`` and the
registered ``*_find_unused_parameters_true`` names, down to a 2-rank run of a model whose auxiliary head sits out
every other step."""

from __future__ import annotations

import pytest
import torch
from lightning.fabric.strategies import STRATEGY_REGISTRY
from lightning.pytorch.strategies import StrategyRegistry
from models import TinyClassifier, fit, teacher_task
from ranks import run_ranks
from torch import nn

from lightning_gradcomp import (
    DILOCO_PRESETS,
    HSDP_PRESETS,
    NAMED_STRATEGIES,
    GradCompDiLoCoFabricStrategy,
    GradCompDiLoCoStrategy,
    GradCompFabricStrategy,
    GradCompHSDPFabricStrategy,
    GradCompHSDPStrategy,
    GradCompStrategy,
)
from lightning_gradcomp.ddp.presets import DDP_VARIANTS, preset_arguments
from lightning_gradcomp.ddp.strategy import UNUSED_PARAMETERS_ADVICE


def test_a_preset_takes_any_argument_ddp_options_included() -> None:
    strategy = GradCompStrategy.from_preset(
        "ddp_topk",
        find_unused_parameters=True,
        static_graph=False,
        gradient_as_bucket_view=True,
        bucket_cap_mb=5,
        density=0.05,
    )
    assert strategy._ddp_kwargs == {
        "find_unused_parameters": True,
        "static_graph": False,
        "gradient_as_bucket_view": True,
        "bucket_cap_mb": 5,
    }
    assert strategy.compressor.density == 0.05  # the override, under the preset's bf16 wire
    assert strategy.compressor.name == "topk" and strategy.memory.name == "ef" and strategy.keep_last_layer_dense
    assert strategy.granularity == "model" and strategy.schedule.critical_density == 4 * 0.05
    fabric = GradCompFabricStrategy.from_preset("ddp_terngrad", static_graph=True)
    assert isinstance(fabric, GradCompFabricStrategy) and fabric._ddp_kwargs == {"static_graph": True}
    assert fabric.compressor.name == "terngrad" and fabric.keep_last_layer_dense


def test_a_kwargs_override_updates_the_presets_unless_its_method_is_replaced() -> None:
    kept = GradCompStrategy.from_preset("ddp_powersgd", compressor_kwargs={"min_compression_rate": 4.0})
    assert (kept.compressor.rank, kept.compressor.min_compression_rate) == (4, 4.0)
    assert preset_arguments("ddp_powersgd", {"compressor": "topk", "compressor_kwargs": {"density": 0.1}})[
        "compressor_kwargs"
    ] == {"density": 0.1}
    replaced = GradCompStrategy.from_preset("ddp_powersgd", compressor="topk")  # rank 4 does not follow it
    assert replaced.compressor.name == "topk"
    restated = GradCompStrategy.from_preset("ddp_powersgd", compressor="powersgd")  # the same method: kept
    assert restated.compressor.rank == 4
    restated = GradCompStrategy.from_preset(
        "ddp_powersgd", compressor="powersgd", compressor_kwargs={"min_compression_rate": 4.0}
    )  # the same method restated beside its arguments: they still update the preset's
    assert (restated.compressor.rank, restated.compressor.min_compression_rate) == (4, 4.0)
    assert NAMED_STRATEGIES["ddp_powersgd"][1]["compressor_kwargs"] == {"rank": 4}  # the table is left alone


def _diloco(strategy: GradCompDiLoCoStrategy | GradCompDiLoCoFabricStrategy) -> tuple:
    return (strategy.sync_every, strategy.outer_lr, strategy.outer_momentum, strategy.nesterov,
            strategy.exchange_arguments)  # fmt: skip


def _hsdp(strategy: GradCompHSDPStrategy | GradCompHSDPFabricStrategy) -> tuple:
    return (strategy.exchange_arguments, strategy.replicate_size, strategy.unit_modules,
            strategy.reshard_after_forward)  # fmt: skip


@pytest.mark.parametrize(
    ("cls", "table", "name", "overrides", "described"),
    [
        (GradCompDiLoCoStrategy, DILOCO_PRESETS, "ddp_diloco_topk", {"sync_every": 4}, _diloco),
        (GradCompDiLoCoFabricStrategy, DILOCO_PRESETS, "ddp_diloco_topk", {"sync_every": 4}, _diloco),
        (GradCompDiLoCoStrategy, DILOCO_PRESETS, "ddp_diloco", {"outer_momentum": 0.5, "timeout": None}, _diloco),
        (GradCompHSDPStrategy, HSDP_PRESETS, "hsdp_topk", {"density": 0.05, "replicate_size": 2}, _hsdp),
        (GradCompHSDPFabricStrategy, HSDP_PRESETS, "hsdp_topk", {"density": 0.05, "replicate_size": 2}, _hsdp),
    ],
)
def test_every_front_ends_from_preset_builds_what_spelling_out_the_preset_builds(
    cls: type, table: dict, name: str, overrides: dict, described: object
) -> None:
    spelt = cls(**{**table[name][1], **overrides})
    built = cls.from_preset(name, **overrides)
    assert type(built) is cls and described(built) == described(spelt)  # type: ignore[operator]
    assert described(built) != described(cls(**table[name][1]))  # type: ignore[operator]  (the override counted)


def test_every_front_end_merges_a_presets_arguments_by_the_same_rules() -> None:
    qsgd = GradCompDiLoCoStrategy.from_preset("ddp_diloco_qsgd", compressor_kwargs={"levels": 3})
    assert qsgd.exchange_arguments["compressor_kwargs"] == {"levels": 3, "block_size": 64}  # updated key by key
    replaced = GradCompDiLoCoStrategy.from_preset("ddp_diloco_qsgd", compressor="topk", density=0.1)
    assert replaced.exchange_arguments["compressor_kwargs"] is None  # QSGD's levels do not follow another method
    decayed = GradCompDiLoCoFabricStrategy.from_preset("ddp_diloco_topk", memory_kwargs={"decay": 0.5})
    assert decayed.exchange_arguments["memory_kwargs"] == {"decay": 0.5}
    assert DILOCO_PRESETS["ddp_diloco_qsgd"][1]["compressor_kwargs"] == {"levels": 7, "block_size": 64}  # untouched
    sign = GradCompHSDPStrategy.from_preset("hsdp_topk", compressor="sign", density=None, wire_precision=None)
    assert sign.exchange_arguments["compressor"] == "sign" and sign.exchange_arguments["density"] is None


@pytest.mark.parametrize(
    ("cls", "name", "overrides", "message"),
    [
        (GradCompDiLoCoStrategy, "ddp_diloco_topk", {"sync_evry": 4},
         r"\['sync_evry'\] \('sync_evry': did you mean 'sync_every'\?\)"),
        (GradCompDiLoCoFabricStrategy, "ddp_diloco", {"outer_lr_": 1.0},
         r"\['outer_lr_'\] \('outer_lr_': did you mean 'outer_lr'\?\)"),
        (GradCompHSDPStrategy, "hsdp_topk", {"densty": 0.1}, r"\['densty'\] \('densty': did you mean 'density'\?\)"),
        (GradCompHSDPFabricStrategy, "hsdp_dense", {"replicate": 2}, r"got unknown arguments \['replicate'\]"),
        (GradCompStrategy, "ddp_topk", {"densty": 0.1}, r"\['densty'\] \('densty': did you mean 'density'\?\)"),
        (GradCompDiLoCoStrategy, "ddp_diloco_qsgd", {"find_unused_parameters": True},
         r"trains without a DistributedDataParallel wrapper .* \['find_unused_parameters'\]"),
        (GradCompHSDPStrategy, "hsdp_top", {}, r"preset must be one of \['hsdp_dense', 'hsdp_topk'\], got 'hsdp_top'"),
    ],
)  # fmt: skip
def test_a_misspelt_override_or_preset_is_refused_by_name_in_every_front_end(
    cls: type, name: str, overrides: dict, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        cls.from_preset(name, **overrides)


def test_a_bad_preset_or_argument_is_refused_by_name() -> None:
    names = sorted(NAMED_STRATEGIES)
    with pytest.raises(ValueError) as refused:
        GradCompStrategy.from_preset("ddp_top")
    assert str(refused.value) == f"preset must be one of {names}, got 'ddp_top'"
    with pytest.raises(ValueError, match=r"^density must be a number in \(0, 1\], got 2$"):
        GradCompStrategy.from_preset("ddp_topk", density=2)
    with pytest.raises(ValueError, match=r"installs its own communication hook; do not pass \['ddp_comm_hook'\]"):
        GradCompStrategy.from_preset("ddp_topk", ddp_comm_hook=print)


@pytest.mark.parametrize("registry", [StrategyRegistry, STRATEGY_REGISTRY], ids=["trainer", "fabric"])
def test_every_preset_is_registered_with_lightnings_ddp_variants(registry: dict) -> None:
    for name, (_, params) in NAMED_STRATEGIES.items():
        for suffix, options in DDP_VARIANTS.items():
            assert registry[f"{name}_{suffix}"]["init_params"] == {**params, **options}
    strategy = StrategyRegistry.get("ddp_diana_find_unused_parameters_true")
    assert strategy._ddp_kwargs == {"find_unused_parameters": True} and strategy.memory.name == "diana"


class SometimesAuxiliary(TinyClassifier):
    """An auxiliary head (2048 weights, compressed) that joins the loss on even steps only: on odd steps its
    parameters get no gradient, which DDP handles only with ``find_unused_parameters=True``."""

    def __init__(self) -> None:
        super().__init__()
        self.aux = nn.Linear(32, 64)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        if batch_idx % 2 == 0:
            loss = loss + 0.01 * self.aux(batch[0]).pow(2).mean()
        return loss


def _loss(model: TinyClassifier) -> float:
    x, y = teacher_task().tensors
    with torch.no_grad():
        return float(nn.functional.cross_entropy(model(x), y))


def _unused_branch(rank: int, world_size: int) -> dict:
    strategies = {
        "ddp_topk_find_unused_parameters_true": "ddp_topk_find_unused_parameters_true",  # the registered name
        "ddp_terngrad": GradCompStrategy.from_preset("ddp_terngrad", find_unused_parameters=True),
        "ddp_diana": GradCompStrategy.from_preset("ddp_diana", find_unused_parameters=True, bucket_cap_mb=0.005),
    }
    results = {}
    for case, strategy in strategies.items():
        torch.manual_seed(0)
        before = _loss(SometimesAuxiliary())
        model, trainer = fit(strategy, world_size, 12, model_class=SometimesAuxiliary)
        hook = trainer.strategy.gradcomp_hook
        compressed = [s for s in hook.history if s.compressed]
        results[case] = {
            "weights": {k: v.detach().clone() for k, v in model.state_dict().items()},
            "before": before,
            "after": _loss(model),
            "compressed": len(compressed),
            "bytes": (sum(s.bytes_sent for s in compressed), sum(s.dense_bytes for s in compressed)),
        }
    try:  # the preset alone: DDP refuses the step after one that left the head out, naming the compressed ways
        fit("ddp_topk", world_size, 4, model_class=SometimesAuxiliary)
        results["refused"] = None
    except RuntimeError as err:
        results["refused"] = str(err)
    return results


def test_a_branch_that_sits_out_every_other_step_trains_under_presets_with_find_unused_parameters() -> None:
    ranks = run_ranks(_unused_branch, 2, init=False, timeout=400)
    assert [r.pop("refused") for r in ranks] == [UNUSED_PARAMETERS_ADVICE] * 2
    for case, first in ranks[0].items():
        other = ranks[1][case]
        assert first["weights"].keys() == other["weights"].keys()
        for key, value in first["weights"].items():
            assert torch.equal(value, other["weights"][key]), (case, key)  # ranks bit-identical
        assert first["after"] < first["before"], case
        assert first["compressed"] >= 10, case  # every step after the first warm-up one
        sent, dense = first["bytes"]
        assert sent < dense, case


def _warnings_of_short_runs(rank: int, world_size: int) -> dict:
    import warnings

    seen = {}
    runs = (("ddp_powersgd", {}), ("ddp_terngrad", {"warmup_steps": 50}), ("ddp_topk", {}), ("ddp_gradcomp_dense", {}))
    for name, overrides in runs:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fit(GradCompStrategy.from_preset(name, **overrides), world_size, 6)
        seen[name] = [str(w.message) for w in caught if "none of the run" in str(w.message)]
    return seen


def test_a_run_that_never_compressed_says_so_once_at_its_end() -> None:
    (seen,) = run_ranks(_warnings_of_short_runs, 1, init=False, timeout=300)
    dense = "every gradient was averaged densely, as plain DDP does. For a short run lower warmup_steps"
    assert seen["ddp_powersgd"] == [
        "lightning_gradcomp: none of the run's 6 steps was compressed (1 in the warm-up of warmup_steps=1, 5 in "
        f"Accordion's dense critical regimes): {dense}, or pass adaptive='none' or a shorter "
        "adaptive_kwargs={'interval': ...} (its first two intervals are critical)."
    ]
    assert seen["ddp_terngrad"] == [
        f"lightning_gradcomp: none of the run's 6 steps was compressed (6 in the warm-up of warmup_steps=50): {dense}."
    ]
    assert seen["ddp_topk"] == []  # compressed from step 2 (its critical regimes compress at 4x the density)
    assert seen["ddp_gradcomp_dense"] == []  # the dense baseline never compresses, by design
