"""DiLoCo's named strategies: the dense outer average of the paper, SparseLoCo's sparse one, a 4-bit one."""

from __future__ import annotations

from typing import Any

__all__ = ["DILOCO_PRESETS", "SPARSELOCO_DENSITY", "SPARSELOCO_EF_DECAY"]

#: SparseLoCo's Top-k density: 64 entries of every chunk of 4096 (Sarfi et al., 2025, arXiv 2508.15706, Sec. 4).
SPARSELOCO_DENSITY = 64 / 4096
#: The decay ``beta`` of its error-feedback buffer, ``e = beta * e + delta``, which replaces the outer momentum: this
#: library's choice, not a value taken from the paper (the public Templar configuration that trains with SparseLoCo
#: uses 0.999).
SPARSELOCO_EF_DECAY = 0.95

#: ``name -> (description, GradCompDiLoCoStrategy arguments)``, registered with the Trainer.
DILOCO_PRESETS: dict[str, tuple[str, dict[str, Any]]] = {
    "ddp_diloco": (
        "DiLoCo: local SGD, the pseudo-gradient averaged densely every sync_every steps, outer Nesterov SGD "
        "(lr 0.7, momentum 0.9)",
        {},
    ),
    "ddp_diloco_topk": (
        "SparseLoCo: local SGD, the pseudo-gradient's Top-k (1.56% of each parameter) with 2-bit values under "
        "error feedback with decay 0.95, gathered every sync_every steps, outer SGD lr 1 without momentum",
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
