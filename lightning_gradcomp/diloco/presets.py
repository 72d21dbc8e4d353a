"""DiLoCo's named strategies: the dense outer average of the paper, SparseLoCo's sparse one (as its reference
configuration runs it, and this library's per-parameter variant), a 4-bit one."""

from __future__ import annotations

from typing import Any

__all__ = ["DILOCO_PRESETS", "SPARSELOCO_DENSITY", "SPARSELOCO_EF_DECAY", "SPARSELOCO_SYNC_EVERY"]

#: SparseLoCo's Top-k density: 64 entries of every chunk of 4096 (Sarfi et al., 2025, arXiv 2508.15706, Sec. 4).
SPARSELOCO_DENSITY = 64 / 4096
#: The decay ``beta`` of its error-feedback buffer, ``e = beta * e + delta``, which replaces the outer momentum: the
#: reference configuration's 0.95 (Templar, September 2025). Other published Templar configurations use 0.999, and the
#: paper's own sweep over ``beta`` could not be read here to confirm either.
SPARSELOCO_EF_DECAY = 0.95

#: SparseLoCo's inner steps between synchronisations in its reference configuration (Templar's ``inner_steps``).
SPARSELOCO_SYNC_EVERY = 30

#: ``name -> (description, GradCompDiLoCoStrategy arguments)``, registered with the Trainer.
DILOCO_PRESETS: dict[str, tuple[str, dict[str, Any]]] = {
    "ddp_diloco": (
        "DiLoCo: local SGD, the pseudo-gradient averaged densely every sync_every steps, outer Nesterov SGD "
        "(lr 0.7, momentum 0.9)",
        {},
    ),
    "ddp_diloco_topk": (
        "SparseLoCo, this library's per-parameter variant: local SGD, the pseudo-gradient's Top-k (1.56% of each "
        "parameter) with 2-bit values (a sign and two magnitudes per 256) under error feedback with decay 0.95, "
        "gathered and summed over the ranks every sync_every steps, outer SGD lr 1 without momentum",
        {
            "compressor": "topk",
            "density": SPARSELOCO_DENSITY,
            "wire_precision": "2bit",
            "memory": "ef",
            "memory_kwargs": {"decay": SPARSELOCO_EF_DECAY},
            "aggregator": "allgather",
            "outer_lr": 1.0,
            "outer_momentum": 0.0,
            "nesterov": False,
        },
    ),
    "ddp_diloco_sparseloco": (
        "SparseLoCo as its reference configuration runs it: local SGD for 30 steps, then the pseudo-gradient's Top-64 "
        "of every 64x64 chunk (1.56%), 12-bit chunk indices and 2-bit values (4 bins over 6 sigma, decoded as their "
        "means) under error feedback with decay 0.95, gathered and averaged over the ranks that chose each index, "
        "outer SGD lr 1 without momentum",
        {
            "sync_every": SPARSELOCO_SYNC_EVERY,
            "compressor": "chunked_topk",
            "memory": "ef",
            "memory_kwargs": {"decay": SPARSELOCO_EF_DECAY},
            "aggregator": "allgather_choosers",
            "outer_lr": 1.0,
            "outer_momentum": 0.0,
            "nesterov": False,
        },
    ),
    "ddp_diloco_qsgd": (
        "DiLoCo with 4-bit outer gradients: QSGD with 7 levels and a 2-norm per block of 64 (4.5 bits per "
        "element) under error feedback, gathered every sync_every steps, outer Nesterov SGD (lr 0.7, momentum 0.9)",
        {
            "compressor": "qsgd",
            "compressor_kwargs": {"levels": 7, "block_size": 64},
            "memory": "ef",
            "aggregator": "allgather",
        },
    ),
}
