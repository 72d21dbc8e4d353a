"""GradCompStrategy construction: bad input is refused up front, names are registered."""

from __future__ import annotations

import inspect
import math
from datetime import timedelta

import pytest
import torch
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry

from lightning_gradcomp import NAMED_STRATEGIES, GradCompStrategy, TopKCompressor
from lightning_gradcomp.core.adaptive import Accordion
from lightning_gradcomp.core.checkpoint import ShardError
from lightning_gradcomp.core.compressors import TernGradCompressor
from lightning_gradcomp.core.schedule import DensityWarmup
from lightning_gradcomp.ddp.arguments import SETTINGS
from lightning_gradcomp.ddp.presets import PRESET_SPARSE_DENSITY
from lightning_gradcomp.ddp.settings import CompressionSettings


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"compressor": "terngrad2"},
            r"compressor must be one of \[.*\] or a Compressor instance, got 'terngrad2'",
        ),
        ({"memory": "residual"}, r"memory must be one of \['diana', 'ef', 'none'\], got 'residual'"),
        (
            {"aggregator": "ring"},
            r"aggregator must be one of \['allgather', 'allgather_choosers', 'allreduce', 'gtopk', 'two_phase', "
            r"'auto'\], got 'ring'",
        ),
        ({"granularity": "tensor"}, r"granularity must be one of \['layer', 'model', 'group'\], got 'tensor'"),
        ({"unit_cap_mb": 0}, r"unit_cap_mb must be a finite number > 0 \(MiB\), got 0"),
        ({"unit_cap_mb": float("nan")}, r"unit_cap_mb must be a finite number > 0 \(MiB\), got nan"),
        ({"density": 0.0}, r"density must be a number in \(0, 1\], got 0.0"),
        ({"density": -1}, r"density must be a number in \(0, 1\], got -1"),
        ({"density": 1.5}, r"density must be a number in \(0, 1\], got 1.5"),
        ({"warmup_steps": -1}, r"warmup_steps must be an integer >= 0, got -1"),
        ({"warmup_steps": 1.5}, r"warmup_steps must be an integer >= 0, got 1.5"),
        ({"min_compress_numel": -3}, r"min_compress_numel must be an integer >= 0, got -3"),
        ({"compressor": "none", "density": 0.1}, r"compressor 'none' does not take the arguments \['density'\]"),
        ({"compressor": TopKCompressor(), "density": 0.1}, r"set them on the instance"),
        ({"ddp_comm_hook": print}, r"installs its own communication hook; do not pass \['ddp_comm_hook'\]"),
    ],
)
def test_bad_arguments_raise_value_error_naming_argument_and_choices(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        GradCompStrategy(**kwargs)


@pytest.mark.parametrize("granularity", ["model", "group"])
def test_shape_needing_compressors_refuse_flat_units(granularity: str) -> None:
    with pytest.raises(ValueError, match=f"granularity='{granularity}' hands 'atomo' flat vectors"):
        GradCompStrategy(compressor="atomo", granularity=granularity)


def test_bucket_granularity_is_a_deprecated_alias_of_group() -> None:
    with pytest.deprecated_call(match="granularity='bucket' is deprecated"):
        strategy = GradCompStrategy(compressor="topk", granularity="bucket")
    assert strategy.granularity == "group"


def test_good_arguments_are_kept_and_ddp_keywords_pass_through() -> None:
    strategy = GradCompStrategy(
        compressor="topk",
        density=0.01,
        aggregator="auto",
        bucket_cap_mb=5,
        find_unused_parameters=True,
        timeout=timedelta(seconds=30),
        start_method="spawn",
    )
    assert isinstance(strategy, DDPStrategy)
    assert isinstance(strategy.compressor, TopKCompressor) and strategy.compressor.density == 0.01
    assert strategy.resolved_aggregator(4) == "allgather"  # auto: sparse payloads are gathered
    assert strategy._ddp_kwargs == {"bucket_cap_mb": 5, "find_unused_parameters": True}
    assert strategy._timeout == timedelta(seconds=30) and strategy._start_method == "spawn"
    assert GradCompStrategy(compressor="none").resolved_aggregator(4) == "allreduce"
    instance = TopKCompressor(0.2)
    assert GradCompStrategy(compressor=instance).compressor is instance


def test_named_strategies_are_registered_with_lightning() -> None:
    assert {"ddp_gradcomp", "ddp_topk", "ddp_gradcomp_dense"} <= set(StrategyRegistry)
    for name, (_, params) in NAMED_STRATEGIES.items():
        strategy = StrategyRegistry.get(name)
        assert isinstance(strategy, GradCompStrategy)
        assert strategy.compressor.name == params["compressor"]
        assert strategy.memory.name == params["memory"]
        assert strategy.aggregator_name == params["aggregator"]


def test_density_schedule_is_validated_and_indexed_by_epoch() -> None:
    strategy = GradCompStrategy(compressor="topk", density_schedule=[0.004, 0.001])
    assert [strategy.density_for_epoch(e) for e in range(4)] == [0.004, 0.001, 0.001, 0.001]
    assert GradCompStrategy().density_for_epoch(3) is None
    with pytest.raises(ValueError, match=r"density_schedule: density must be a number in \(0, 1\], got 2"):
        GradCompStrategy(density_schedule=[0.1, 2])
    with pytest.raises(ValueError, match="density_schedule must be a non-empty list"):
        GradCompStrategy(density_schedule=[])
    with pytest.raises(ValueError, match="needs a compressor with a density"):
        GradCompStrategy(compressor="none", density_schedule=[0.1])


def test_dense_parameters_and_last_layer_resolve_to_names() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    named = list(model.named_parameters())
    assert GradCompStrategy(keep_last_layer_dense=True).dense_parameter_names(named) == {"2.weight", "2.bias"}
    assert GradCompStrategy(dense_parameters=["0.*"]).dense_parameter_names(named) == {"0.weight", "0.bias"}
    with pytest.raises(ValueError, match=r"dense_parameters pattern 'fc\.\*' matches no parameter"):
        GradCompStrategy(dense_parameters=["fc.*"]).dense_parameter_names(named)
    with pytest.raises(ValueError, match="dense_parameters must be a list of name patterns"):
        GradCompStrategy(dense_parameters="0.*")


def test_a_checkpoint_of_an_unknown_state_format_is_refused_by_name() -> None:
    with pytest.raises(
        ShardError, match=r"run.ckpt holds compression state of format 9; this version reads formats 1 and 2"
    ):
        GradCompStrategy()._read_state("run.ckpt", {"format": 9, "world_size": 1}, rank=0)


def test_diana_refuses_a_compressor_biased_for_the_gradient_it_is_given() -> None:
    # TernGrad's 2.5-sigma clipping makes it unbiased only for the clipped gradient: an outlier averages
    # to the clipping bound, which DIANA's shifts would learn instead of the gradient
    refused = r"memory='diana' needs .*unbiased.*TernGradCompressor\(clip_sigma=2.5.*clipped gradient.*clip_sigma=0"
    with pytest.raises(ValueError, match=refused):
        GradCompStrategy(compressor="terngrad", memory="diana", aggregator="allgather")
    with pytest.raises(ValueError, match=refused):  # an instance gets the same reason as a name
        GradCompStrategy(compressor=TernGradCompressor(), memory="diana", aggregator="allgather")
    with pytest.raises(ValueError, match=r"memory='diana' needs .*TopKCompressor.* is not: it is biased"):
        GradCompStrategy(compressor="topk", memory="diana", memory_kwargs={"alpha": 0.5})
    accepted = GradCompStrategy(
        compressor="terngrad",
        compressor_kwargs={"clip_sigma": 0.0},
        memory="diana",
        memory_kwargs={"alpha": 0.5},
        aggregator="allgather",
    )
    assert accepted.compressor.unbiased


def test_density_warmup_falls_geometrically_to_the_density_and_is_validated() -> None:
    warmup = DensityWarmup(0.001, steps=4, start=0.25)
    assert [warmup.density(t) for t in (0, 4, 5, 100)] == [0.25, 0.001, 0.001, 0.001]
    assert warmup.density(2) == pytest.approx(math.sqrt(0.25 * 0.001), rel=1e-12)  # geometric midpoint
    assert all(warmup.density(t) > warmup.density(t + 1) for t in range(3))
    assert DensityWarmup(0.5, steps=10, start=0.25).density(0) == 0.5  # target above start: no warm-up
    with pytest.raises(ValueError, match="density warm-up steps must be an integer >= 0, got -1"):
        DensityWarmup(0.01, steps=-1)
    with pytest.raises(ValueError, match=r"density warm-up start must be a number in \(0, 1\], got 0"):
        DensityWarmup(0.01, steps=1, start=0)


def test_density_warmup_argument_of_the_strategy() -> None:
    strategy = GradCompStrategy(compressor="topk", density=0.01, density_warmup_steps=50, density_warmup_start=0.1)
    assert (strategy.density_warmup.target, strategy.density_warmup.steps, strategy.density_warmup.start) == (
        0.01,
        50,
        0.1,
    )
    assert GradCompStrategy(compressor="topk").density_warmup is None
    with pytest.raises(ValueError, match=r"density_warmup_steps must be an integer >= 0, got 1\.5"):
        GradCompStrategy(density_warmup_steps=1.5)
    with pytest.raises(ValueError, match=r"density_warmup_start must be a number in \(0, 1\], got 2"):
        GradCompStrategy(density_warmup_steps=5, density_warmup_start=2)
    with pytest.raises(ValueError, match="density_warmup_steps needs a compressor with a density"):
        GradCompStrategy(compressor="terngrad", memory="none", density_warmup_steps=5)
    with pytest.raises(ValueError, match="both set the density; give one"):
        GradCompStrategy(density_schedule=[0.004, 0.001], density_warmup_steps=5)


def test_presets_adapt_the_top_k_family_powersgd_and_atomo_and_keep_the_logits_layer_dense() -> None:
    adaptive = {"ddp_topk", "ddp_gaussiank", "ddp_gtopk", "ddp_powersgd", "ddp_atomo"}
    for name, (_, params) in NAMED_STRATEGIES.items():
        strategy = StrategyRegistry.get(name)
        # the dense presets (plain, in half precision, in 8 bits) keep no layer apart
        assert strategy.keep_last_layer_dense == (params["compressor"] not in ("none", "int8", "fp8")), name
        assert isinstance(strategy.schedule, Accordion) == (name in adaptive), name
        assert strategy.density_warmup is None and strategy.warmup_steps == 1, name
        if params["compressor"] in ("topk", "gaussiank"):  # 1% of the entries, 4% in critical regimes, bf16 values
            assert (strategy.compressor.density, strategy.schedule.critical_density) == (PRESET_SPARSE_DENSITY, 0.04)
            assert repr(strategy.compressor).endswith("'bf16')"), name


def test_the_strategy_spells_out_the_settings_as_compression_settings_takes_them() -> None:
    """GradCompStrategy repeats the settings in its signature (LightningCLI reads types, defaults and help from
    it); the two must not drift."""
    strategy = list(inspect.signature(GradCompStrategy.__init__).parameters.values())[1 : 1 + len(SETTINGS)]
    settings = list(inspect.signature(CompressionSettings.__init__).parameters.values())[1:]
    assert [(p.name, p.default, p.annotation) for p in strategy] == [
        (p.name, p.default, p.annotation) for p in settings
    ]
