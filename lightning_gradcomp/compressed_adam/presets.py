"""Compressed Adam's named strategies: 1-bit Adam as its paper runs it, and with Top-k or 4-bit QSGD momenta."""

from __future__ import annotations

from typing import Any

__all__ = ["COMPRESSED_ADAM_PRESETS"]

#: ``name -> (description, GradCompAdamStrategy arguments)``, registered with the Trainer and with Fabric.
COMPRESSED_ADAM_PRESETS: dict[str, tuple[str, dict[str, Any]]] = {
    "ddp_onebit_adam": (
        "1-bit Adam: the user's Adam/AdamW densely for freeze_step steps, then the variance frozen and the momentum "
        "averaged as 1-bit signs with a scale per parameter (its root mean square), in two phases with error feedback "
        "on the worker and on the server",
        {"compressor": "sign", "compressor_kwargs": {"magnitude": "rms"}},
    ),
    "ddp_topk_adam": (
        "Compressed Adam with the momentum's Top-k (1% of each parameter's slice) in both phases, error feedback on "
        "both",
        {"compressor": "topk", "compressor_kwargs": {"density": 0.01}},
    ),
    "ddp_qsgd_adam": (
        "Compressed Adam with the momentum in 4-bit QSGD (7 levels, a 2-norm per block of 64) in both phases",
        {"compressor": "qsgd", "compressor_kwargs": {"levels": 7, "block_size": 64}},
    ),
}
