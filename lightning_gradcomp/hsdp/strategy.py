"""``GradCompHSDPStrategy`` (``strategy="hsdp_topk"``): HSDP on FSDP2 under Lightning's Trainer, its exchange between
replicas compressed.

Lightning's :class:`~lightning.pytorch.strategies.ModelParallelStrategy` with a ``(replicate, shard)`` device mesh:
each FSDP unit is sharded over a node's ranks (``mesh["shard"]``), FSDP2's reduce-scatter inside the node stays dense,
and every unit's gradient shard is averaged between the replicas (across the nodes) by
:class:`~lightning_gradcomp.hsdp.ReplicaExchange`. The units are the ones ``configure_model`` made with
``fully_shard(..., mesh=self.device_mesh["shard"])``, or, when it made none, the model's blocks
(:mod:`lightning_gradcomp.hsdp.sharding`). Every rank trains on its own share of the data. A checkpoint is Lightning's
(a distributed checkpoint folder by default) plus each rank's exchange state beside it (the memory of its gradient
shards and the units' step counts, :mod:`lightning_gradcomp.core.checkpoint`), so a resumed run goes on exactly.
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Literal

import lightning.pytorch as pl
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies import _StrategyRegistry
from lightning.fabric.utilities.init import _materialize_distributed_module
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn
from torch.distributed.fsdp import FSDPModule
from typing_extensions import override

from lightning_gradcomp.core.checkpoint import remove_shards
from lightning_gradcomp.core.compressors import Compressor
from lightning_gradcomp.core.validation import check_bool
from lightning_gradcomp.hsdp.presets import HSDP_PRESETS
from lightning_gradcomp.hsdp.settings import HSDP_KEY, HSDPSettings, check_precision

__all__ = ["GradCompHSDPStrategy"]


class GradCompHSDPStrategy(HSDPSettings, ModelParallelStrategy):
    """FSDP2 inside each node, the library's compression between the nodes' replicas.

    Args: :class:`~lightning_gradcomp.hsdp.settings.HSDPSettings`' (the exchange's ``compressor``, ``density``,
    ``wire_precision``, ``memory``, ``aggregator``, ...; ``replicate_size``, ``unit_modules``,
    ``reshard_after_forward``), then :class:`~lightning.pytorch.strategies.ModelParallelStrategy`'s
    ``save_distributed_checkpoint``, ``process_group_backend`` and ``timeout``. In ``configure_model`` the mesh is
    ``self.device_mesh``, with dimensions ``"replicate"`` and ``"shard"``.
    """

    strategy_name = "hsdp_gradcomp"

    def __init__(
        self,
        compressor: str | Compressor = "topk",
        compressor_kwargs: dict[str, Any] | None = None,
        density: float | None = None,
        wire_precision: Literal["fp16", "bf16", "2bit"] | None = None,
        memory: str = "ef",
        memory_kwargs: dict[str, Any] | None = None,
        aggregator: str = "auto",
        min_compress_numel: int = 0,
        seed: int = 0,
        replicate_size: Literal["auto"] | int = "auto",
        unit_modules: Sequence[str | type[nn.Module]] | None = None,
        reshard_after_forward: bool = True,
        save_distributed_checkpoint: bool = True,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
    ) -> None:
        check_bool("save_distributed_checkpoint", save_distributed_checkpoint)
        HSDPSettings.__init__(
            self, compressor, compressor_kwargs, density, wire_precision, memory, memory_kwargs, aggregator,
            min_compress_numel, seed, replicate_size, unit_modules, reshard_after_forward,
        )  # fmt: skip
        ModelParallelStrategy.__init__(
            self,
            save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )

    @override
    def setup_environment(self) -> None:
        """Join the process group and build the ``(replicate, shard)`` mesh ``configure_model`` can read."""
        check_precision(self.precision_plugin.precision, type(self).__name__)
        self._setup_distributed()
        self._device_mesh = self.build_mesh(self.root_device.type, self.world_size, self.num_nodes)
        assert self.lightning_module is not None
        self.lightning_module._device_mesh = self._device_mesh

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Every rank trains on its own share of the data (FSDP averages over the shards, the exchange over the
        replicas)."""
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        """Shard the model (unless ``configure_model`` did), install the exchange, then set up as Lightning's
        ``ModelParallelStrategy`` does (which requires ``configure_model``; here the strategy can shard itself)."""
        assert self.model is not None and self.accelerator is not None
        self.accelerator.setup(trainer)
        self.shard(self.model, self.device_mesh, lightning_module=True)
        _materialize_distributed_module(self.model, self.root_device)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self.install_exchange(self.model, self.device_mesh)
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Accumulate gradients without exchanging them: FSDP2 skips the reduce-scatter and the replica hook on the
        micro-batches before the last (``set_requires_all_reduce(False)`` would not stop the hook)."""
        units = [m for m in self.model.modules() if isinstance(m, FSDPModule)] if self.model is not None else []
        for unit in units:
            unit.set_requires_gradient_sync(False, recurse=False)
        try:
            yield
        finally:
            for unit in units:
                unit.set_requires_gradient_sync(True, recurse=False)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """Write this rank's exchange state beside ``filepath`` (every rank), then Lightning's checkpoint with its
        manifest; a checkpoint without optimizer states (weights only) gets none."""
        if storage_options is not None or "optimizer_states" not in checkpoint or self.replica_exchange is None:
            return super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)  # (refuses options)
        if HSDP_KEY in checkpoint:
            raise ValueError(f"the checkpoint has a key {HSDP_KEY!r}, which the strategy's manifest uses")
        path = self.broadcast(filepath)  # where Lightning writes it: rank 0's path
        checkpoint[HSDP_KEY] = self.write_hsdp_shard(path, self.global_rank, self.world_size)
        return super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        """Remove the checkpoint and its exchange-state shards (rank 0 all of them, each rank its own)."""
        super().remove_checkpoint(filepath)
        remove_shards(filepath, self.global_rank, self.world_size)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Load the weights and optimizer states (Lightning's) and, to fit on, this rank's exchange state."""
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        saved = checkpoint.get(HSDP_KEY)
        assert self.lightning_module is not None
        if saved is not None and self.lightning_module.trainer.state.fn == TrainerFn.FITTING:
            self.read_hsdp_shard(self.broadcast(checkpoint_path), self.global_rank, self.world_size, saved)
        return checkpoint

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        """Register ``hsdp_gradcomp`` and HSDP's named strategies with the Trainer."""
        strategy_registry.register(cls.strategy_name, cls, description=cls.__doc__.splitlines()[0], override=True)
        for name, (description, arguments) in HSDP_PRESETS.items():
            strategy_registry.register(name, cls, description=description, override=True, **arguments)
