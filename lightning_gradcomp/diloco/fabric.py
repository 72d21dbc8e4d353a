"""``GradCompDiLoCoFabricStrategy``: DiLoCo for Lightning Fabric loops (``Fabric(strategy="ddp_diloco_topk")``).

``fabric.setup(model, optimizer)`` leaves the model unwrapped (no ``DistributedDataParallel``: inner steps exchange
nothing) and builds :class:`~lightning_gradcomp.diloco.OuterSync` for it, every rank starting from rank 0's
weights; each ``optimizer.step()`` is an inner step, and every ``sync_every``-th ends with the synchronisation.
``fabric.save(path, state)`` with an optimizer in ``state`` writes every rank's weights, inner optimizer states,
outer state and memory beside ``path`` (as the Trainer strategy does) and their manifest in the checkpoint;
``fabric.load(path, state)`` gives each rank its own back, so a loop stopped between two synchronisations resumes
where it was. The per-inner-step records are ``strategy.outer_sync.history``.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from datetime import timedelta
from typing import Any, Literal

import torch
from lightning.fabric.accelerators import Accelerator
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment, Precision
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies import DDPStrategy, _StrategyRegistry
from lightning.fabric.strategies.strategy import _BackwardSyncControl
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_gradcomp.core.compressors import Compressor
from lightning_gradcomp.diloco.presets import DILOCO_PRESETS
from lightning_gradcomp.diloco.settings import DILOCO_KEY, DiLoCoSettings

__all__ = ["GradCompDiLoCoFabricStrategy"]


class _NothingToSkip(_BackwardSyncControl):
    """``fabric.no_backward_sync``: inner steps exchange nothing, so there is no gradient synchronisation to skip."""

    def no_backward_sync(self, module: Module, enabled: bool) -> AbstractContextManager:
        return nullcontext()


class GradCompDiLoCoFabricStrategy(DiLoCoSettings, DDPStrategy):
    """Fabric's DDP strategy without the wrapper, synchronising every ``sync_every`` optimizer steps (DiLoCo).

    Args: Fabric's :class:`~lightning.fabric.strategies.DDPStrategy` arguments (``DistributedDataParallel``'s own
    keywords are refused: there is no wrapper), then DiLoCo's, as :class:`~lightning_gradcomp.GradCompDiLoCoStrategy`
    takes them. One model and one optimizer per strategy.
    """

    strategy_name = "ddp_diloco"

    def __init__(
        self,
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        sync_every: int = 500,
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        nesterov: bool = True,
        compressor: str | Compressor | None = None,
        compressor_kwargs: dict[str, Any] | None = None,
        density: float | None = None,
        wire_precision: Literal["fp16", "bf16", "2bit"] | None = None,
        memory: str = "none",
        memory_kwargs: dict[str, Any] | None = None,
        aggregator: str = "auto",
        min_compress_numel: int = 0,
        seed: int = 0,
    ) -> None:
        DiLoCoSettings.__init__(
            self, sync_every, outer_lr, outer_momentum, nesterov, compressor, compressor_kwargs, density,
            wire_precision, memory, memory_kwargs, aggregator, min_compress_numel, seed,
        )  # fmt: skip
        DDPStrategy.__init__(
            self,
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision=precision,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
        )
        self._backward_sync_control = _NothingToSkip()
        self._module: Module | None = None
        self._optimizers: list[Optimizer] = []

    @override
    def setup_module(self, module: Module) -> Module:
        """Leave ``module`` unwrapped and build its outer loop (one model per strategy)."""
        if self._module is not None:
            raise RuntimeError(
                "GradCompDiLoCoFabricStrategy synchronises one model, and fabric.setup already gave it one; set up "
                "further models with their own Fabric, or wrap them in one module"
            )
        self._module = module
        self.build_outer_sync(module)
        return module

    @override
    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        """The inner optimizer (one: the synchronisation follows its steps)."""
        if self._optimizers:
            raise ValueError(
                "GradCompDiLoCoFabricStrategy synchronises after every sync_every-th step of one inner optimizer; "
                "fabric.setup was given a second one"
            )
        self._optimizers.append(optimizer)
        return super().setup_optimizer(optimizer)

    @override
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        """The inner step, then (every ``sync_every``-th) the synchronisation."""
        output = super().optimizer_step(optimizer, **kwargs)
        if self.outer_sync is None:
            raise RuntimeError("fabric.setup(model, optimizer) builds DiLoCo's outer loop; call it first")
        self.outer_sync.step()
        return output

    @override
    def save_checkpoint(
        self,
        path: Any,
        state: dict[str, Module | Optimizer | Any],
        storage_options: Any | None = None,
        filter: dict[str, Any] | None = None,
    ) -> None:
        """Save ``state`` (rank 0) and, when it holds an optimizer (a checkpoint to resume from), every rank's own
        weights, inner optimizer state, outer state and memory beside ``path``, their manifest in the checkpoint."""
        if any(isinstance(obj, Optimizer) for obj in state.values()) and self._module is not None:
            if DILOCO_KEY in state:
                raise ValueError(f"the state to save has a key {DILOCO_KEY!r}, which the strategy's manifest uses")
            saved = self.write_diloco_shard(
                path, self.global_rank, self.world_size, self._module, self._optimizers, self.precision.state_dict()
            )
            state = {**state, DILOCO_KEY: saved}
        super().save_checkpoint(path, state, storage_options=storage_options, filter=filter)

    @override
    def load_checkpoint(
        self,
        path: Any,
        state: Module | Optimizer | dict[str, Module | Optimizer | Any] | None = None,
        strict: bool = True,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """Restore ``state`` from ``path`` and, when it holds an optimizer (to train on), this rank's own weights, inner
        optimizer state, outer state and memory; without one (to evaluate), rank 0's weights as saved. What is left is
        returned without the manifest."""
        remainder = super().load_checkpoint(path, state, strict=strict, weights_only=weights_only)
        saved = remainder.pop(DILOCO_KEY, None)
        resuming = isinstance(state, dict) and any(isinstance(obj, Optimizer) for obj in state.values())
        if saved is not None and resuming:  # to train on: this rank's own state (else rank 0's weights, as saved)
            if self._module is None or self.outer_sync is None or not self._optimizers:
                raise RuntimeError(
                    "fabric.load of a DiLoCo checkpoint to train on needs fabric.setup(model, optimizer)"
                )
            shard = self.read_diloco_shard(path, self.global_rank, self.world_size, saved, self._module)
            self._module.load_state_dict(shard["model"], strict=strict)
            for optimizer, optimizer_state in zip(self._optimizers, shard["optimizers"], strict=True):
                optimizer.load_state_dict(optimizer_state)
            self.outer_sync.load_state_dict(shard["outer"])
            if shard["precision"]:
                self.precision.load_state_dict(shard["precision"])
        return remainder

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        """Register DiLoCo's named strategies with Fabric."""
        for name, (description, arguments) in DILOCO_PRESETS.items():
            strategy_registry.register(name, cls, description=description, override=True, **arguments)
