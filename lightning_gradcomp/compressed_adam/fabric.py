"""``GradCompAdamFabricStrategy``: compressed Adam under Lightning Fabric (``Fabric(strategy="ddp_onebit_adam")``).

``fabric.setup(model, optimizer)`` wraps the model in ``DistributedDataParallel`` whose averaging compressed Adam
replaces, and puts compressed Adam in the optimizer's ``step`` (:class:`~lightning_gradcomp.compressed_adam.
CompressedAdam`); ``fabric.save``/``fabric.load`` with the optimizer in the state keep each rank's own residuals and the
stage beside the checkpoint.
"""

from __future__ import annotations

from typing import Any, Literal

from lightning.fabric.strategies import DDPStrategy, _StrategyRegistry
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_gradcomp.compressed_adam.presets import COMPRESSED_ADAM_PRESETS
from lightning_gradcomp.compressed_adam.settings import COMPRESSED_ADAM_KEY, CompressedAdamSettings
from lightning_gradcomp.compressed_adam.strategy import refuse_loss_scaler
from lightning_gradcomp.core.compressors import Compressor

__all__ = ["GradCompAdamFabricStrategy"]


class GradCompAdamFabricStrategy(CompressedAdamSettings, DDPStrategy):
    """Compressed Adam under Fabric; arguments as :class:`~lightning_gradcomp.GradCompAdamStrategy` takes them (the
    compressed Adam's, then Fabric's DDP strategy's and ``DistributedDataParallel``'s). One model and one Adam."""

    strategy_name = "ddp_compressed_adam"

    def __init__(
        self,
        compressor: str | Compressor = "sign",
        compressor_kwargs: dict[str, Any] | None = None,
        freeze_step: int = 100,
        variance_refresh: Literal["none", "exponential"] = "none",
        seed: int = 0,
        **kwargs: Any,
    ) -> None:
        CompressedAdamSettings.__init__(self, compressor, compressor_kwargs, freeze_step, variance_refresh, seed)
        DDPStrategy.__init__(self, **kwargs)

    @override
    def setup_module_and_optimizers(
        self, module: Module, optimizers: list[Optimizer], scheduler: Any | None = None
    ) -> tuple[Module, list[Optimizer], Any | None]:
        """Wrap ``module`` in DDP and put compressed Adam in the one optimizer's ``step``."""
        if self.compressed_adam is not None:
            raise RuntimeError(
                f"{type(self).__name__} compresses one model's Adam, and fabric.setup already gave it one"
            )
        refuse_loss_scaler(self.precision, type(self).__name__)
        module = self.setup_module(module)
        optimizers = [self.setup_optimizer(optimizer) for optimizer in optimizers]
        self.build_compressed_adam(optimizers, module)
        return module, optimizers, scheduler

    @override
    def save_checkpoint(
        self,
        path: Any,
        state: dict[str, Module | Optimizer | Any],
        storage_options: Any | None = None,
        filter: dict[str, Any] | None = None,
    ) -> None:
        """Save ``state`` (rank 0) and, when it holds an optimizer, every rank's own state beside ``path``."""
        if any(isinstance(obj, Optimizer) for obj in state.values()) and self.compressed_adam is not None:
            if COMPRESSED_ADAM_KEY in state:
                raise ValueError(
                    f"the state to save has a key {COMPRESSED_ADAM_KEY!r}, which the strategy's manifest uses"
                )
            state = {**state, COMPRESSED_ADAM_KEY: self.write_adam_shard(path, self.global_rank, self.world_size)}
        super().save_checkpoint(path, state, storage_options=storage_options, filter=filter)

    @override
    def load_checkpoint(
        self,
        path: Any,
        state: Module | Optimizer | dict[str, Module | Optimizer | Any] | None = None,
        strict: bool = True,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """Restore ``state`` from ``path`` and, when it holds an optimizer, this rank's own compressed-Adam state; what
        is left is returned without the manifest."""
        remainder = super().load_checkpoint(path, state, strict=strict, weights_only=weights_only)
        saved = remainder.pop(COMPRESSED_ADAM_KEY, None)
        resuming = isinstance(state, dict) and any(isinstance(obj, Optimizer) for obj in state.values())
        if saved is not None and resuming:
            if self.compressed_adam is None:
                raise RuntimeError("fabric.load of a compressed-Adam checkpoint to train on needs fabric.setup first")
            self.compressed_adam.load_state_dict(self.read_adam_shard(path, self.global_rank, self.world_size, saved))
        return remainder

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        strategy_registry.register(cls.strategy_name, cls, description=cls.__doc__.splitlines()[0], override=True)
        for name, (description, arguments) in COMPRESSED_ADAM_PRESETS.items():
            strategy_registry.register(name, cls, description=description, override=True, **arguments)
