"""``GradCompDiLoCoStrategy`` (``strategy="ddp_diloco"``): DiLoCo under Lightning's Trainer.

Each rank trains its own copy of the model (no ``DistributedDataParallel``: inner steps exchange nothing) on its
share of the data, and after every ``sync_every``-th optimizer step :class:`~lightning_gradcomp.diloco.OuterSync`
averages the pseudo-gradient over the ranks and takes the outer step. Between two synchronisations the ranks hold
different weights and inner optimizer states, so a checkpoint keeps each rank's own beside it (one shard per rank,
as the compression state of the DDP strategies: :mod:`lightning_gradcomp.core.checkpoint`), with ``theta_prev``, the
outer optimizer's state, the memory of a compressed exchange and the precision plugin's (each rank's loss scaler
sees its own gradients); a resumed run goes on from exactly where each rank was. Buffers (BatchNorm's statistics)
stay each rank's own, as in torchft's DiLoCo. The checkpoint's weights, and what ``trainer.validate`` evaluates
after ``fit``, are rank 0's own, up to ``sync_every - 1`` steps past the last synchronisation (``theta_prev`` is
``strategy.outer_sync.anchor``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.fabric.strategies import _StrategyRegistry
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from typing_extensions import override

from lightning_gradcomp.core.checkpoint import remove_shards
from lightning_gradcomp.core.compressors import Compressor
from lightning_gradcomp.diloco.presets import DILOCO_PRESETS
from lightning_gradcomp.diloco.settings import DILOCO_KEY, DiLoCoSettings, refuse_wrapper_arguments

__all__ = ["GradCompDiLoCoStrategy"]


class GradCompDiLoCoStrategy(DiLoCoSettings, DDPStrategy):
    """Local SGD with an outer optimizer (Douillard et al., 2023): ``sync_every`` inner steps, then one exchange.

    Args: :class:`~lightning_gradcomp.diloco.settings.DiLoCoSettings`' (``sync_every``, ``outer_lr``,
    ``outer_momentum``, ``nesterov``, and a compressed exchange's ``compressor``, ``density``, ``wire_precision``,
    ``memory``, ``memory_kwargs``, ``aggregator``, ``min_compress_numel``, ``seed``), then
    :class:`~lightning.pytorch.strategies.DDPStrategy`'s (``timeout``, ...); those of the
    ``DistributedDataParallel`` wrapper are refused (there is none).
    """

    strategy_name = "ddp_diloco"

    def __init__(
        self,
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
        **kwargs: Any,
    ) -> None:
        DiLoCoSettings.__init__(
            self, sync_every, outer_lr, outer_momentum, nesterov, compressor, compressor_kwargs, density,
            wire_precision, memory, memory_kwargs, aggregator, min_compress_numel, seed,
        )  # fmt: skip
        DDPStrategy.__init__(self, **refuse_wrapper_arguments(type(self), kwargs))
        self._pending: dict[str, Any] | None = None

    @override
    def configure_ddp(self) -> None:
        """No ``DistributedDataParallel``: build the outer loop (every rank starts from rank 0's weights), and give
        a restored rank its own weights and ``theta_prev`` back."""
        module = self.lightning_module
        outer_sync = self.build_outer_sync(module)
        if self._pending is not None:
            module.load_state_dict(self._pending["model"], strict=module.strict_loading)
            outer_sync.load_state_dict(self._pending["outer"])

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        super().setup(trainer)
        if trainer.state.fn == TrainerFn.FITTING and len(self.optimizers) != 1:
            raise ValueError(
                f"GradCompDiLoCoStrategy synchronises after every sync_every-th step of one inner optimizer; "
                f"configure_optimizers returned {len(self.optimizers)}"
            )

    @override
    def teardown(self) -> None:
        self._pending = None
        super().teardown()

    @override
    def optimizer_step(self, optimizer: torch.optim.Optimizer, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        """The inner step, then (every ``sync_every``-th) the synchronisation."""
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        assert self.outer_sync is not None
        self.outer_sync.step()
        return output

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """Write this rank's weights, inner optimizer states and outer state beside ``filepath`` (every rank), then
        the checkpoint with their manifest (rank 0)."""
        if "optimizer_states" in checkpoint and self.outer_sync is not None:
            checkpoint[DILOCO_KEY] = self.write_diloco_shard(
                filepath,
                self.global_rank,
                self.world_size,
                self.lightning_module,
                self.optimizers,
                self.precision_plugin.state_dict(),
            )
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        """Remove the checkpoint and its shards (rank 0 all of them, each rank its own)."""
        super().remove_checkpoint(filepath)
        remove_shards(filepath, self.global_rank, self.world_size)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Load the checkpoint and, to fit on, this rank's own shard (applied once the model and optimizers exist;
        evaluating takes rank 0's weights, as under DDP)."""
        self._pending = None
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        saved = checkpoint.get(DILOCO_KEY)
        if saved is not None and self.lightning_module.trainer.state.fn == TrainerFn.FITTING:
            self._pending = self.read_diloco_shard(
                checkpoint_path, self.global_rank, self.world_size, saved, self.lightning_module
            )
        return checkpoint

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        super().load_model_state_dict(checkpoint, strict=strict)
        if self._pending is not None:  # this rank's own weights, not rank 0's
            self.lightning_module.load_state_dict(self._pending["model"], strict=strict)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        super().load_optimizer_state_dict(checkpoint)
        if self._pending is not None:  # this rank's own inner optimizer states, its loss scaler's, its outer state
            for optimizer, state in zip(self.optimizers, self._pending["optimizers"], strict=True):
                optimizer.load_state_dict(state)
            if self._pending["precision"]:
                self.precision_plugin.load_state_dict(self._pending["precision"])
            if self.outer_sync is not None:  # a restore inside fit (the tuners' checkpoint) comes after setup
                self.outer_sync.load_state_dict(self._pending["outer"])
            self._pending = None

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        for name, (description, arguments) in DILOCO_PRESETS.items():
            strategy_registry.register(name, cls, description=description, override=True, **arguments)
