"""The named strategies: presets of the compression arguments, by the name a user passes as ``strategy=``.

The same names are registered with the Trainer (``Trainer(strategy="ddp_topk")``) and with Fabric
(``Fabric(strategy="ddp_topk")``) when :mod:`lightning_gradcomp` is imported.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lightning.fabric.strategies import _StrategyRegistry

from lightning_gradcomp.core.presets import preset_arguments as merged_preset

#: The Top-k family's density in the presets, outside Accordion's critical regimes (four times it inside them):
#: Accordion's own Top-k setting keeps 1% of the entries outside critical regimes (Agarwal et al., MLSys 2021,
#: Sec. 5). The papers' 0.001 (ImageNet-scale models, many epochs) took a third more steps to reach plain DDP's
#: accuracy on LeNet-5 and the MNIST MLP (docs/benchmarks/time-to-accuracy.md), and an Elias-Fano index with
#: a bfloat16 value costs about 3 bytes an entry, so 1% of a gradient is about 1/130 of its dense bytes.
PRESET_SPARSE_DENSITY = 0.01

#: What every compressed preset shares: the logits layer stays dense (TernGrad's authors' practice;
#: it is small and its gradient is the one every class's error flows through).
_LAST_LAYER_DENSE = {"keep_last_layer_dense": True}
#: Adaptive compression (Accordion): critical regimes, detected from the gradient norm's changes, are compressed
#: less (a sparsifier four times denser) or averaged densely (PowerSGD, ATOMO), instead of a fixed number of dense or
#: warm-up steps tuned on one model. The first two intervals (100 steps) are critical.
_ADAPTIVE = {"adaptive": "accordion"}
#: The Top-k family: error feedback, one unit for the whole model (the authors' setting), Accordion, values in
#: bfloat16 on the wire (error feedback keeps the rounding; bfloat16 has float32's range, so gradients scaled by a
#: loss scaler cannot overflow it).
_SPARSIFIER = {"density": PRESET_SPARSE_DENSITY, "memory": "ef", "granularity": "model", "wire_precision": "bf16",
               **_ADAPTIVE}  # fmt: skip

#: The half-precision dense presets: every parameter (none too small) in size-capped groups, as DDP's buckets.
_HALF_WIRE = {"compressor": "none", "memory": "none", "aggregator": "allreduce", "granularity": "group",
              "min_compress_numel": 0}  # fmt: skip

#: The 8-bit dense presets: every parameter in size-capped groups, each averaged in two phases (a reduce-scatter of the
#: 8-bit slices, sums in float32, an all-gather of the slices quantized again; ZeRO++'s qgZ, torchft's quantized
#: allreduce).
_EIGHT_BIT_WIRE = {"memory": "none", "aggregator": "two_phase", "granularity": "group", "min_compress_numel": 0}

#: Named strategies registered with Lightning when ``lightning_gradcomp`` is imported.
NAMED_STRATEGIES: dict[str, tuple[str, dict[str, Any]]] = {
    "ddp_gradcomp_dense": (
        "Dense baseline through the gradcomp hook (identity compressor, allreduce)",
        {"compressor": "none", "memory": "none", "aggregator": "allreduce"},
    ),
    "ddp_atomo": (
        "Spectral ATOMO: unbiased sampling of rank-1 SVD atoms (budget 3), allgather of variable-size payloads; "
        "dense in Accordion's critical regimes, last layer dense",
        {"compressor": "atomo", "memory": "none", "aggregator": "allgather", **_ADAPTIVE, **_LAST_LAYER_DENSE},
    ),
    "ddp_diana": (
        "DIANA: compressed gradient differences with per-rank shifts, QSGD with 7 levels (4 bits per element, a "
        "2-norm per block of 512), last layer dense",
        {"compressor": "qsgd", "memory": "diana", "aggregator": "allgather", **_LAST_LAYER_DENSE},
    ),
    "ddp_efsign": (
        "EF-SignSGD: scaled signs (1 bit per element, one scale per layer) with error feedback, allgather of "
        "the averaged scaled signs; last layer dense",
        {"compressor": "sign", "memory": "ef", "aggregator": "allgather", **_LAST_LAYER_DENSE},
    ),
    "ddp_fp16": (
        "Dense gradients sent as float16, divided by the world size before the sum (PyTorch's fp16_compress_hook), "
        "allreduce per parameter group",
        _HALF_WIRE | {"wire_precision": "fp16"},
    ),
    "ddp_bf16": (
        "Dense gradients sent as bfloat16 (float32's range, 8-bit mantissa), divided by the world size before the "
        "sum, allreduce per parameter group",
        _HALF_WIRE | {"wire_precision": "bf16"},
    ),
    "ddp_int8": (
        "Dense gradients sent as int8 with a float32 scale per block of 256 (8.125 bits per element), averaged in two "
        "phases: each rank sums the slices it owns in float32 and quantizes them again, then all gather",
        _EIGHT_BIT_WIRE | {"compressor": "int8"},
    ),
    "ddp_fp8": (
        "Dense gradients sent as fp8 (e4m3) with a float32 scale per block of 256, averaged in two phases as ddp_int8",
        _EIGHT_BIT_WIRE | {"compressor": "fp8"},
    ),
    "ddp_gaussiank": (
        "Gaussian_k: O(d) threshold selection with error feedback, k/2 to k entries in k fixed slots, allgather; "
        "density 0.01 (0.04 in Accordion's critical regimes), bfloat16 values, last layer dense",
        {"compressor": "gaussiank", "aggregator": "allgather", **_SPARSIFIER, **_LAST_LAYER_DENSE},
    ),
    "ddp_gtopk": (
        "gTop-k: Top-k with error feedback, sparse butterfly aggregation in O(k log P); density 0.01 (0.04 in "
        "Accordion's critical regimes), bfloat16 values, last layer dense",
        {"compressor": "topk", "aggregator": "gtopk", **_SPARSIFIER, **_LAST_LAYER_DENSE},
    ),
    "ddp_powersgd": (
        "PowerSGD: rank-4 approximations by one warm-started power iteration with error feedback, two "
        "allreduces per group of matrices; dense in Accordion's critical regimes, last layer dense",
        {
            "compressor": "powersgd",
            "compressor_kwargs": {"rank": 4},
            "memory": "ef",
            "aggregator": "allreduce",
            "granularity": "group",
            **_ADAPTIVE,
            **_LAST_LAYER_DENSE,
        },
    ),
    "ddp_terngrad": (
        "TernGrad: 2-bit stochastic ternary gradients, shared per-layer scalers, 2.5-sigma clipping, last layer dense",
        {"compressor": "terngrad", "memory": "none", "aggregator": "auto", **_LAST_LAYER_DENSE},
    ),
    "ddp_topk": (
        "Top-k sparsification with error feedback, allgather of sparse payloads; density 0.01 (0.04 in Accordion's "
        "critical regimes), bfloat16 values, last layer dense",
        {"compressor": "topk", "aggregator": "allgather", **_SPARSIFIER, **_LAST_LAYER_DENSE},
    ),
}


#: ``DistributedDataParallel`` options that Lightning names as variants of its own DDP strategy
#: (``ddp_find_unused_parameters_true``): every preset is registered with the same suffix too
#: (``ddp_topk_find_unused_parameters_true``).
DDP_VARIANTS: dict[str, dict[str, Any]] = {"find_unused_parameters_true": {"find_unused_parameters": True}}


def preset_arguments(name: str, overrides: Mapping[str, Any]) -> dict[str, Any]:
    """The arguments of the named strategy ``name`` with ``overrides`` applied, by the rules every front end shares
    (:func:`lightning_gradcomp.core.presets.preset_arguments`): every argument given replaces the preset's, DDP's own
    included (``find_unused_parameters``, ``static_graph``, ``gradient_as_bucket_view``, ``bucket_cap_mb``), except a
    ``*_kwargs`` dict, which updates the preset's key by key while its method stays the preset's."""
    return merged_preset(NAMED_STRATEGIES, name, overrides)


def register_presets(registry: _StrategyRegistry, cls: type, strategy_name: str) -> None:
    """Register ``cls`` in ``registry`` as ``strategy_name`` (configured by arguments), as every preset, and as every
    preset's :data:`DDP_VARIANTS`."""
    registry.register(strategy_name, cls, description="DDP with gradient compression (configure via arguments)",
                      override=True)  # fmt: skip
    for name, (description, init_params) in NAMED_STRATEGIES.items():
        registry.register(name, cls, description=description, override=True, **init_params)
        for suffix, options in DDP_VARIANTS.items():
            registry.register(f"{name}_{suffix}", cls, description=f"{description}; {suffix.replace('_', ' ')}",
                              override=True, **{**init_params, **options})  # fmt: skip
