"""``GradCompFabricStrategy``: the same compression for Lightning Fabric loops (``Fabric(strategy="ddp_topk")``).

Fabric's :class:`~lightning.fabric.strategies.DDPStrategy` with the compression hook of
:class:`~lightning_gradcomp.ddp.settings.CompressionSettings` registered on the
``DistributedDataParallel`` that ``fabric.setup`` builds, on every device (gloo on CPU included). The
arguments, their checks and the named presets are the Trainer strategy's
(:class:`~lightning_gradcomp.GradCompStrategy`), except ``density_schedule``: Fabric has no epochs,
so a warm-up is given in steps (``density_warmup_steps``).

Checkpoints: ``fabric.save(path, state)`` with an optimizer in ``state`` writes every rank's
compression state beside ``path`` (``<path>.gradcomp/``, as the Trainer does) and a manifest in the
checkpoint; ``fabric.load(path, state)`` gives each rank its own back, so a resumed loop is the loop
that never stopped. The per-step statistics are ``strategy.gradcomp_hook.history`` (``last_step``).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Literal

import torch
from lightning.fabric.accelerators import Accelerator
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment, Precision
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies import DDPStrategy, _StrategyRegistry
from torch.nn import Module
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer
from typing_extensions import override

from lightning_gradcomp.core.checkpoint import CHECKPOINT_KEY
from lightning_gradcomp.ddp.arguments import check_ddp_keywords, refuse_density_schedule, split_settings
from lightning_gradcomp.ddp.presets import register_presets
from lightning_gradcomp.ddp.settings import CompressionSettings


class GradCompFabricStrategy(CompressionSettings, DDPStrategy):
    """Fabric's DDP whose gradient exchange is compressed by a communication hook.

    Args: Fabric's :class:`~lightning.fabric.strategies.DDPStrategy` arguments; then, as keywords, the
    compression settings of :class:`~lightning_gradcomp.GradCompStrategy` (``compressor``, ``memory``,
    ``density``, ...; without ``density_schedule``) and ``DistributedDataParallel``'s keywords
    (``bucket_cap_mb``, ``find_unused_parameters``, ...).
    """

    strategy_name = "ddp_gradcomp"

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
        **kwargs: Any,
    ) -> None:
        settings, ddp_kwargs = split_settings(kwargs)
        check_ddp_keywords("GradCompFabricStrategy", ddp_kwargs)
        refuse_density_schedule(settings.pop("density_schedule", None), "a Fabric loop")
        CompressionSettings.__init__(self, **settings)
        #: bounds the collectives of the node groups that ``hierarchy="node"`` creates, as the world's
        self.process_group_timeout = timeout
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
            **ddp_kwargs,
        )
        self._module: Module | None = None
        self._optimizers: list[Optimizer] = []

    @override
    def setup_module(self, module: Module) -> DistributedDataParallel:
        """Wrap ``module`` in ``DistributedDataParallel`` (Fabric's) and register the compression hook on it.

        One model per strategy: a second model would share the first one's compressor and memory (their
        residuals are keyed by parameter name), so it is refused.
        """
        if self.gradcomp_hook is not None:
            raise RuntimeError(
                "GradCompFabricStrategy compresses the gradients of one model, and fabric.setup already gave it "
                "one; set up further models with their own Fabric, or wrap them in one module"
            )
        ddp = super().setup_module(module)
        node_id = self.cluster_environment.node_rank() if self.cluster_environment is not None else None
        self.install_hook(ddp, node_id=node_id, timeout=self.process_group_timeout)
        self._module = module
        return ddp

    @override
    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        """Refuse an optimizer that adds momentum again under DGC's momentum correction."""
        if self._module is not None:
            self.check_momentum_correction(self._module.named_parameters(), [optimizer])
        self._optimizers.append(optimizer)
        return super().setup_optimizer(optimizer)

    @override
    def _optimizers_to_check(self) -> list[Optimizer]:
        return list(self._optimizers)

    @override
    def save_checkpoint(
        self,
        path: Any,
        state: dict[str, Module | Optimizer | Any],
        storage_options: Any | None = None,
        filter: dict[str, Any] | None = None,
    ) -> None:
        """Save ``state`` (rank 0) and, when it holds an optimizer (a checkpoint to resume from), every rank's
        compression state beside ``path``, with its manifest under ``"gradcomp"`` in the checkpoint."""
        if any(isinstance(obj, Optimizer) for obj in state.values()):
            if CHECKPOINT_KEY in state:
                raise ValueError(f"the state to save has a key {CHECKPOINT_KEY!r}, which the strategy's manifest uses")
            state = {**state, CHECKPOINT_KEY: self.save_compression_state(path, self.global_rank, self.world_size)}
        super().save_checkpoint(path, state, storage_options=storage_options, filter=filter)

    @override
    def load_checkpoint(
        self,
        path: Any,
        state: Module | Optimizer | dict[str, Module | Optimizer | Any] | None = None,
        strict: bool = True,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """Restore ``state`` from ``path`` and, when ``state`` is a dictionary of objects to restore, this rank's
        compression state too (what is left of the checkpoint is returned without the manifest)."""
        remainder = super().load_checkpoint(path, state, strict=strict, weights_only=weights_only)
        if isinstance(state, dict) and state and CHECKPOINT_KEY in remainder:
            saved = remainder.pop(CHECKPOINT_KEY)
            self.load_compression_state(path, saved, self.global_rank, self.world_size, self.root_device)
        return remainder

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        """Register ``ddp_gradcomp`` and the named presets with Fabric."""
        register_presets(strategy_registry, cls, cls.strategy_name)
