"""What DiLoCo's Trainer and Fabric strategies share: their arguments, checked where they enter, the outer loop they
build for a module, and each rank's shard beside a checkpoint (weights, inner optimizer states, loss scaler, outer
state and memory: between two synchronisations every rank holds its own)."""

from __future__ import annotations

import inspect
from typing import Any

import torch
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from lightning_gradcomp.core.checkpoint import (
    ShardTags,
    manifest,
    on_every_rank,
    read_shard,
    refuse_other_run,
    write_shard,
)
from lightning_gradcomp.core.compressors import Compressor
from lightning_gradcomp.core.pipeline_arguments import pipeline_names
from lightning_gradcomp.core.presets import FromPreset, refuse_unknown
from lightning_gradcomp.diloco.outer import OuterSync, check_anchor, check_exchange_arguments, check_outer_arguments
from lightning_gradcomp.diloco.presets import DILOCO_PRESETS

__all__ = ["DILOCO_KEY", "WRAPPER_FREE", "DiLoCoSettings", "refuse_wrapper_arguments"]

#: The manifest's key in the checkpoint.
DILOCO_KEY = "diloco"
#: The strategies' own arguments besides DiLoCo's: those of ``DistributedDataParallel`` are refused (there is none).
WRAPPER_FREE = ("accelerator", "parallel_devices", "cluster_environment", "checkpoint_io", "precision_plugin",
                "process_group_backend", "timeout", "start_method")  # fmt: skip


class DiLoCoSettings(FromPreset):
    """DiLoCo's arguments (those of :class:`~lightning_gradcomp.diloco.OuterSync`), validated once; the strategies'
    ``from_preset(name, **overrides)`` changes any of a named strategy's (:data:`DILOCO_PRESETS`).

    Args:
        sync_every: optimizer steps between synchronisations (``H``, at least 1).
        outer_lr: the outer SGD's learning rate (> 0; the paper's 0.7).
        outer_momentum: its momentum, in [0, 1) (the paper's 0.9).
        nesterov: Nesterov momentum (the paper's), which needs ``outer_momentum > 0``.
        compressor: ``None`` averages the pseudo-gradient densely; else it is averaged through this compressor (a
            registry name or an instance) with ``compressor_kwargs``, ``density``, ``wire_precision``, ``memory``,
            ``memory_kwargs`` and ``aggregator``, as :class:`~lightning_gradcomp.GradCompStrategy` takes them;
            each rank's memory goes in its checkpoint shard.
        min_compress_numel: parameters with fewer elements are averaged densely (compressed exchange only).
        seed: base seed of the compressor's random streams.
    """

    presets = DILOCO_PRESETS

    @classmethod
    def preset_keywords(cls) -> set[str]:
        """DiLoCo's arguments, the strategy's own (``timeout``, ...) and ``DistributedDataParallel``'s, which the
        strategy refuses by name (there is no wrapper)."""
        return super().preset_keywords() | set(WRAPPER_FREE) | _wrapper_keywords()

    def __init__(
        self,
        sync_every: int = 500,
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        nesterov: bool = True,
        compressor: str | Compressor | None = None,
        compressor_kwargs: dict[str, Any] | None = None,
        density: float | None = None,
        wire_precision: str | None = None,
        memory: str = "none",
        memory_kwargs: dict[str, Any] | None = None,
        aggregator: str = "auto",
        min_compress_numel: int = 0,
        seed: int = 0,
    ) -> None:
        check_outer_arguments(sync_every, outer_lr, outer_momentum, nesterov)
        exchange = {
            "compressor": compressor, "compressor_kwargs": compressor_kwargs, "density": density,
            "wire_precision": wire_precision, "memory": memory, "memory_kwargs": memory_kwargs,
            "aggregator": aggregator, "min_compress_numel": min_compress_numel, "seed": seed,
        }  # fmt: skip
        dense = check_exchange_arguments(**exchange) is None  # a bad combination fails here, not at setup
        self.sync_every, self.outer_lr = sync_every, outer_lr
        self.outer_momentum, self.nesterov = outer_momentum, nesterov
        #: the compressed exchange's arguments (empty: the dense average)
        self.exchange_arguments: dict[str, Any] = {} if dense else exchange
        #: the outer loop, once the strategy has its module
        self.outer_sync: OuterSync | None = None
        self._tags = ShardTags()

    def build_outer_sync(self, module: nn.Module) -> OuterSync:
        """The outer loop for ``module``, every rank starting from rank 0's module state (parameters, frozen ones
        included, and buffers, as DDP starts), and the run's tag shared from rank 0 (it marks this run's shards)."""
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            with torch.no_grad():
                for tensor in [*module.parameters(), *module.buffers()]:
                    torch.distributed.broadcast(tensor.data, src=0)
        self.outer_sync = OuterSync(
            module.named_parameters(),
            self.sync_every,
            self.outer_lr,
            self.outer_momentum,
            self.nesterov,
            **self.exchange_arguments,
        )
        self._tags.share()
        return self.outer_sync

    def write_diloco_shard(
        self,
        path: Any,
        rank: int,
        world_size: int,
        module: nn.Module,
        optimizers: list[torch.optim.Optimizer],
        precision: dict[str, Any],
    ) -> dict[str, Any]:
        """Write this rank's shard beside ``path`` and return the manifest the checkpoint keeps under
        :data:`DILOCO_KEY`."""
        assert self.outer_sync is not None
        tag = self._tags.next()
        shard = {
            "tag": tag,
            "model": module.state_dict(),
            "optimizers": [optimizer.state_dict() for optimizer in optimizers],
            "outer": self.outer_sync.state_dict(),
            "precision": precision,
        }
        write_shard(path, rank, world_size, shard)
        return manifest(world_size, tag, *self._exchange_names())

    def _exchange_names(self) -> tuple[str, str]:
        """The memory's and the compressor's names (with a wire precision), as the manifest records them."""
        arguments = self.exchange_arguments
        return pipeline_names(
            arguments.get("compressor"), arguments.get("memory", "none"), arguments.get("wire_precision")
        )

    def read_diloco_shard(
        self, path: Any, rank: int, world_size: int, saved: dict[str, Any], module: nn.Module
    ) -> dict[str, Any]:
        """This rank's shard of the checkpoint at ``path`` whose manifest is ``saved``, for ``module``. Refused by name,
        on every rank alike when any rank's is: a checkpoint of another world size, memory or compressor (its state
        would not mean what this run's does), a shard missing, unreadable or foreign, and one whose ``theta_prev``
        holds other parameters than ``module`` trains."""

        def read() -> dict[str, Any]:
            refuse_other_run(path, "DiLoCo state", saved, world_size, *self._exchange_names())
            shard = read_shard(path, rank, saved)
            trained = {name: p for name, p in module.named_parameters() if p.requires_grad}
            check_anchor(shard["outer"]["anchor"], trained)
            return shard

        return on_every_rank(read)


def refuse_wrapper_arguments(owner: type[DiLoCoSettings], kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` without a config parser's ``None``\\s, or a ``ValueError`` naming the arguments among them that
    ``owner`` does not take (misspelt), or that are ``DistributedDataParallel``'s (DiLoCo trains without the
    wrapper)."""
    given = sorted(k for k, value in kwargs.items() if k not in WRAPPER_FREE and value is not None)
    refuse_unknown(owner.__name__, [k for k in given if k not in _wrapper_keywords()], owner.preset_keywords())
    if given:
        raise ValueError(
            f"{owner.__name__} trains without a DistributedDataParallel wrapper (inner steps exchange nothing); do not "
            f"pass its arguments {given}"
        )
    return {k: value for k, value in kwargs.items() if k in WRAPPER_FREE}


def _wrapper_keywords() -> set[str]:
    """``DistributedDataParallel``'s keywords and the DDP strategy's, which a DDP strategy would take."""
    return set(inspect.signature(DistributedDataParallel).parameters) | set(inspect.signature(DDPStrategy).parameters)
