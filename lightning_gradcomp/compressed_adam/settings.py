"""What compressed Adam's Trainer and Fabric strategies share: their arguments, checked where they enter, the
:class:`~lightning_gradcomp.compressed_adam.CompressedAdam` they build around the user's optimizer, and each rank's
shard beside a checkpoint (its error-feedback residuals and the stage; the momentum and the variance are in the
optimizer's own state, alike on every rank)."""

from __future__ import annotations

from typing import Any, Literal

import torch
from torch import nn

from lightning_gradcomp.compressed_adam.optimizer import REFRESH, CompressedAdam, build_codec, check_adam
from lightning_gradcomp.compressed_adam.presets import COMPRESSED_ADAM_PRESETS
from lightning_gradcomp.core.checkpoint import (
    ShardTags,
    manifest,
    on_every_rank,
    read_shard,
    refuse_other_run,
    write_shard,
)
from lightning_gradcomp.core.compressors import Compressor
from lightning_gradcomp.core.presets import FromPreset
from lightning_gradcomp.core.validation import check_choice, check_int

__all__ = ["COMPRESSED_ADAM_KEY", "CompressedAdamSettings"]

#: The manifest's key in the checkpoint.
COMPRESSED_ADAM_KEY = "compressed_adam"


class CompressedAdamSettings(FromPreset):
    """Compressed Adam's arguments (those of :class:`~lightning_gradcomp.compressed_adam.CompressedAdam`), validated
    once; ``from_preset(name, **overrides)`` changes any of a named strategy's.

    Args:
        compressor: the momentum's compressor in both phases (``"sign"``: 1 bit and a scale per parameter, the
            paper's; ``"topk"``, ``"qsgd"``, ``"int8"``, ``"fp8"``), with ``compressor_kwargs``.
        freeze_step: optimizer steps of the dense warm-up before the variance is frozen (>= 1).
        variance_refresh: ``"none"``, or ``"exponential"`` (0/1 Adam's: the variance updated on a dense step at
            twice, four times, ... ``freeze_step``).
        seed: base seed of a random compressor's streams.
    """

    presets = COMPRESSED_ADAM_PRESETS

    def __init__(
        self,
        compressor: str | Compressor = "sign",
        compressor_kwargs: dict[str, Any] | None = None,
        freeze_step: int = 100,
        variance_refresh: Literal["none", "exponential"] = "none",
        seed: int = 0,
    ) -> None:
        build_codec(compressor, compressor_kwargs)  # a bad combination fails here, not at setup
        self.compressor_name = compressor if isinstance(compressor, str) else type(compressor).__name__
        self.adam_arguments = {
            "compressor": compressor,
            "compressor_kwargs": compressor_kwargs,
            "freeze_step": check_int("freeze_step", freeze_step, 1),
            "variance_refresh": check_choice("variance_refresh", variance_refresh, REFRESH),
            "seed": check_int("seed", seed, 0),
        }
        #: the compressed Adam around the user's optimizer, once the strategy has it
        self.compressed_adam: CompressedAdam | None = None
        self._tags = ShardTags()

    def build_compressed_adam(self, optimizers: list[torch.optim.Optimizer], ddp: nn.Module | None) -> CompressedAdam:
        """Compressed Adam around the one optimizer (refused by name unless it is one Adam or AdamW), installed in its
        ``step``'s place and on ``ddp``'s gradients; the run's tag shared from rank 0."""
        owner = type(self).__name__
        if len(optimizers) != 1:
            raise ValueError(f"{owner} compresses the momentum of one Adam optimizer; got {len(optimizers)} optimizers")
        check_adam(optimizers[0], owner)
        self.compressed_adam = CompressedAdam(optimizers[0], **self.adam_arguments).install(ddp)
        self._tags.share()
        return self.compressed_adam

    def write_adam_shard(self, path: Any, rank: int, world_size: int) -> dict[str, Any]:
        """Write this rank's state beside ``path``; the manifest the checkpoint keeps under
        :data:`COMPRESSED_ADAM_KEY`."""
        assert self.compressed_adam is not None
        tag = self._tags.next()
        write_shard(path, rank, world_size, {"tag": tag, "adam": self.compressed_adam.state_dict()})
        return manifest(world_size, tag, "two-phase error feedback", self.compressor_name)

    def read_adam_shard(self, path: Any, rank: int, world_size: int, saved: dict[str, Any]) -> dict[str, Any]:
        """This rank's state from the checkpoint at ``path`` whose manifest is ``saved``; one of another world size or
        compressor is refused by name, and a shard missing, unreadable or foreign on any rank on every rank."""

        def read() -> dict[str, Any]:
            refuse_other_run(path, "compressed Adam state", saved, world_size, "two-phase error feedback",
                             self.compressor_name)  # fmt: skip
            return read_shard(path, rank, saved)["adam"]

        return on_every_rank(read)
