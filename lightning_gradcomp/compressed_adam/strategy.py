"""``GradCompAdamStrategy`` (``strategy="ddp_onebit_adam"``): compressed Adam under Lightning's Trainer.

Lightning's DDP, whose gradient averaging is replaced by compressed Adam's (:mod:`~lightning_gradcomp.compressed_adam`):
the warm-up's gradients averaged densely, then each rank's momentum compressed and averaged in the optimizer step. It
takes the Adam or AdamW that ``configure_optimizers`` returns, with its hyper-parameters and learning-rate schedule;
any other optimizer is refused by name. A checkpoint keeps each rank's error-feedback residuals and the stage in a
shard beside it (the momentum and the frozen variance are in the optimizer's state, the same on every rank).
"""

from __future__ import annotations

from typing import Any, Literal

import lightning.pytorch as pl
from lightning.fabric.strategies import _StrategyRegistry
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from typing_extensions import override

from lightning_gradcomp.compressed_adam.presets import COMPRESSED_ADAM_PRESETS
from lightning_gradcomp.compressed_adam.settings import COMPRESSED_ADAM_KEY, CompressedAdamSettings
from lightning_gradcomp.core.checkpoint import remove_shards
from lightning_gradcomp.core.compressors import Compressor

__all__ = ["GradCompAdamStrategy", "refuse_loss_scaler"]

#: DDP arguments the strategy owns (its hook replaces DDP's averaging).
_OWNED = ("ddp_comm_hook", "ddp_comm_state", "ddp_comm_wrapper", "model_averaging_period")


def refuse_loss_scaler(precision: Any, owner: str) -> None:
    """``ValueError`` for a precision with a loss scaler (``16-mixed``): its overflow check and skipped steps would see
    each rank's own gradients in the compressed stage."""
    if getattr(precision, "scaler", None) is not None:
        raise ValueError(
            f"{owner} does not support a loss scaler (precision='16-mixed'); use 'bf16-mixed' or '32-true'"
        )


class GradCompAdamStrategy(CompressedAdamSettings, DDPStrategy):
    """Compressed Adam (1-bit Adam, Tang et al., 2021) under the Trainer.

    Args: :class:`~lightning_gradcomp.compressed_adam.settings.CompressedAdamSettings`' (``compressor``,
    ``compressor_kwargs``, ``freeze_step``, ``variance_refresh``, ``seed``), then
    :class:`~lightning.pytorch.strategies.DDPStrategy`'s and ``DistributedDataParallel``'s keywords (its communication
    hook is the strategy's own).
    """

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
        owned = sorted(k for k in _OWNED if kwargs.get(k) is not None)
        if owned:
            raise ValueError(f"{type(self).__name__} installs its own communication hook; do not pass {owned}")
        CompressedAdamSettings.__init__(self, compressor, compressor_kwargs, freeze_step, variance_refresh, seed)
        DDPStrategy.__init__(self, **kwargs)
        self._pending: dict[str, Any] | None = None

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        super().setup(trainer)
        if trainer.state.fn != TrainerFn.FITTING:
            return
        refuse_loss_scaler(self.precision_plugin, type(self).__name__)
        adam = self.build_compressed_adam(self.optimizers, self.model)
        if self._pending is not None:  # the optimizer's own state is restored after setup, the momentum adopted then
            adam.load_state_dict(self._pending)
            self._pending = None

    @override
    def on_train_end(self) -> None:
        """Warn when the whole run was the warm-up: it exchanged what plain DDP does."""
        adam = self.compressed_adam
        if adam is not None and adam.frozen_at is None and adam.steps:
            rank_zero_warn(
                f"lightning_gradcomp: none of the run's {adam.steps} steps was compressed (freeze_step="
                f"{adam.freeze_step}): every gradient was averaged densely, as plain DDP does. Lower freeze_step."
            )

    @override
    def teardown(self) -> None:
        self._pending = None
        super().teardown()

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """Write this rank's state beside ``filepath`` (every rank), then the checkpoint with its manifest (rank 0)."""
        if "optimizer_states" in checkpoint and self.compressed_adam is not None:
            checkpoint[COMPRESSED_ADAM_KEY] = self.write_adam_shard(filepath, self.global_rank, self.world_size)
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        super().remove_checkpoint(filepath)
        remove_shards(filepath, self.global_rank, self.world_size)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Load the checkpoint and, to fit on, this rank's own shard (applied once compressed Adam exists)."""
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        saved = checkpoint.get(COMPRESSED_ADAM_KEY)
        if saved is not None and self.lightning_module.trainer.state.fn == TrainerFn.FITTING:
            state = self.read_adam_shard(checkpoint_path, self.global_rank, self.world_size, saved)
            if self.compressed_adam is not None:  # a restore inside fit (a tuner's): compressed Adam exists already
                self.compressed_adam.load_state_dict(state)
            else:
                self._pending = state
        return checkpoint

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        strategy_registry.register(cls.strategy_name, cls, description=cls.__doc__.splitlines()[0], override=True)
        for name, (description, arguments) in COMPRESSED_ADAM_PRESETS.items():
            strategy_registry.register(name, cls, description=description, override=True, **arguments)
