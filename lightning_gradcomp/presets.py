"""The named strategies: presets of the compression arguments, by the name a user passes as ``strategy=``.

The same names are registered with the Trainer (``Trainer(strategy="ddp_topk")``) and with Fabric
(``Fabric(strategy="ddp_topk")``) when :mod:`lightning_gradcomp` is imported.
"""

from __future__ import annotations

from typing import Any

from lightning.fabric.strategies import _StrategyRegistry

#: Compressed steps of the Top-k family's density warm-up in the presets (see :mod:`lightning_gradcomp.schedule`).
PRESET_DENSITY_WARMUP_STEPS = 200

#: Dense steps before ATOMO's first compressed one in its preset: at lr 0.05 / momentum 0.9 LeNet-5's
#: first ~50 steps are on the edge of stability (plain DDP itself dips to 11% accuracy with one seed),
#: and budget-3 atoms compressed from step 2 pushed 2 of 8 seeds down to 9-16%, from which they ended
#: 1-2 points short (benchmarks/README.md, "Time to accuracy"). PyTorch's PowerSGD hook starts dense
#: for the same reason (``start_powerSGD_iter``).
PRESET_ATOMO_DENSE_STEPS = 100

#: Dense steps before PowerSGD's first compressed one in its preset: PyTorch's ``start_powerSGD_iter``,
#: which its documentation suggests setting to about 10% of training (1000 by default there).
PRESET_POWERSGD_DENSE_STEPS = 100

#: What every compressed preset shares: the logits layer stays dense (TernGrad's authors' practice;
#: it is small and its gradient is the one every class's error flows through).
_LAST_LAYER_DENSE = {"keep_last_layer_dense": True}
_SPARSIFIER = {"memory": "ef", "granularity": "model", "density_warmup_steps": PRESET_DENSITY_WARMUP_STEPS}

#: The half-precision dense presets: every parameter (none too small) in size-capped groups, as DDP's buckets.
_HALF_WIRE = {"compressor": "none", "memory": "none", "aggregator": "allreduce", "granularity": "group",
              "min_compress_numel": 0}  # fmt: skip

#: Named strategies registered with Lightning when ``lightning_gradcomp`` is imported.
NAMED_STRATEGIES: dict[str, tuple[str, dict[str, Any]]] = {
    "ddp_gradcomp_dense": (
        "Dense baseline through the gradcomp hook (identity compressor, allreduce)",
        {"compressor": "none", "memory": "none", "aggregator": "allreduce"},
    ),
    "ddp_atomo": (
        "Spectral ATOMO: unbiased sampling of rank-1 SVD atoms (budget 3), allgather of variable-size payloads; "
        f"{PRESET_ATOMO_DENSE_STEPS} dense steps first, last layer dense",
        {
            "compressor": "atomo",
            "memory": "none",
            "aggregator": "allgather",
            "warmup_steps": PRESET_ATOMO_DENSE_STEPS,
            **_LAST_LAYER_DENSE,
        },
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
    "ddp_gaussiank": (
        "Gaussian_k: O(d) threshold selection with error feedback, k/2 to k entries in k fixed slots, allgather; "
        "density warm-up, last layer dense",
        {"compressor": "gaussiank", "aggregator": "allgather", **_SPARSIFIER, **_LAST_LAYER_DENSE},
    ),
    "ddp_gtopk": (
        "gTop-k: Top-k with error feedback, sparse butterfly aggregation in O(k log P); density warm-up, "
        "last layer dense",
        {"compressor": "topk", "aggregator": "gtopk", **_SPARSIFIER, **_LAST_LAYER_DENSE},
    ),
    "ddp_powersgd": (
        "PowerSGD: rank-4 approximations by one warm-started power iteration with error feedback, two "
        f"allreduces per group of matrices; {PRESET_POWERSGD_DENSE_STEPS} dense steps first, last layer dense",
        {
            "compressor": "powersgd",
            "compressor_kwargs": {"rank": 4},
            "memory": "ef",
            "aggregator": "allreduce",
            "granularity": "group",
            "warmup_steps": PRESET_POWERSGD_DENSE_STEPS,
            **_LAST_LAYER_DENSE,
        },
    ),
    "ddp_terngrad": (
        "TernGrad: 2-bit stochastic ternary gradients, shared per-layer scalers, 2.5-sigma clipping, last layer dense",
        {"compressor": "terngrad", "memory": "none", "aggregator": "auto", **_LAST_LAYER_DENSE},
    ),
    "ddp_topk": (
        "Top-k sparsification with error feedback, allgather of sparse payloads; density warm-up, last layer dense",
        {"compressor": "topk", "aggregator": "allgather", **_SPARSIFIER, **_LAST_LAYER_DENSE},
    ),
}


def register_presets(registry: _StrategyRegistry, cls: type, strategy_name: str) -> None:
    """Register ``cls`` in ``registry`` as ``strategy_name`` (configured by arguments) and as every preset."""
    registry.register(strategy_name, cls, description="DDP with gradient compression (configure via arguments)",
                      override=True)  # fmt: skip
    for name, (description, init_params) in NAMED_STRATEGIES.items():
        registry.register(name, cls, description=description, override=True, **init_params)
