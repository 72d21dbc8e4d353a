"""``GradCompHSDPFabricStrategy``: compressed HSDP for Lightning Fabric loops (``Fabric(strategy="hsdp_topk")``).

``fabric.setup(model, optimizer)`` shards the model over a node's ranks (with the ``parallelize_fn`` given, which
shards over ``mesh["shard"]``, or block by block: :mod:`lightning_gradcomp.hsdp.sharding`) and installs
:class:`~lightning_gradcomp.hsdp.ReplicaExchange`; ``fabric.no_backward_sync(model)`` accumulates without exchanging.
``fabric.save(path, state)`` with an optimizer in ``state`` writes Lightning's checkpoint plus each rank's exchange
state beside it, and ``fabric.load(path, state)`` gives each rank its own back. The per-step records are
``strategy.replica_exchange.history``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, Literal

from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies import ModelParallelStrategy, ParallelStrategy, _StrategyRegistry
from torch.distributed.device_mesh import DeviceMesh
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_gradcomp.core.compressors import Compressor
from lightning_gradcomp.core.validation import check_bool
from lightning_gradcomp.hsdp.presets import HSDP_PRESETS
from lightning_gradcomp.hsdp.settings import HSDP_KEY, HSDPSettings, check_precision

__all__ = ["GradCompHSDPFabricStrategy"]


class GradCompHSDPFabricStrategy(HSDPSettings, ModelParallelStrategy):
    """Fabric's ``ModelParallelStrategy`` over a ``(replicate, shard)`` mesh, the exchange between replicas compressed.

    Args: ``parallelize_fn(module, mesh)``: shards ``module`` with ``fully_shard(..., mesh=mesh["shard"])`` and returns
    it (``None``: the strategy shards the blocks itself); then
    :class:`~lightning_gradcomp.hsdp.settings.HSDPSettings`' arguments, as
    :class:`~lightning_gradcomp.GradCompHSDPStrategy` takes them, and Fabric's ``save_distributed_checkpoint``,
    ``process_group_backend`` and ``timeout``. One model per strategy.
    """

    strategy_name = "hsdp_gradcomp"

    def __init__(
        self,
        parallelize_fn: Callable[[Module, DeviceMesh], Module] | None = None,
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
        unit_modules: Sequence[str | type[Module]] | None = None,
        reshard_after_forward: bool = True,
        save_distributed_checkpoint: bool = True,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
    ) -> None:
        if parallelize_fn is not None and not callable(parallelize_fn):
            raise ValueError(
                f"parallelize_fn must be None or a function (module, mesh) -> module, got {parallelize_fn!r}"
            )
        check_bool("save_distributed_checkpoint", save_distributed_checkpoint)
        HSDPSettings.__init__(
            self, compressor, compressor_kwargs, density, wire_precision, memory, memory_kwargs, aggregator,
            min_compress_numel, seed, replicate_size, unit_modules, reshard_after_forward,
        )  # fmt: skip
        ModelParallelStrategy.__init__(
            self,
            parallelize_fn=parallelize_fn if parallelize_fn is not None else self._shard_blocks,
            save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )

    def _shard_blocks(self, module: Module, mesh: DeviceMesh) -> Module:
        """The default ``parallelize_fn``: ``module``'s blocks, then ``module``, sharded over ``mesh["shard"]``."""
        self.shard(module, mesh, lightning_module=False)
        return module

    @override
    def setup_environment(self) -> None:
        """Join the process group and build the ``(replicate, shard)`` mesh."""
        check_precision(self.precision.precision, type(self).__name__)
        ParallelStrategy.setup_environment(self)
        self._setup_distributed()
        self._device_mesh = self.build_mesh(self.root_device.type, self.world_size, self.num_nodes)

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Every rank trains on its own share of the data."""
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    @override
    def setup_module(self, module: Module) -> Module:
        """Shard ``module`` (``parallelize_fn``), check every trainable parameter is in a unit, install the exchange."""
        if self.replica_exchange is not None:
            raise RuntimeError(
                "GradCompHSDPFabricStrategy compresses one model's exchange, and fabric.setup already gave it one; "
                "wrap the models in one module"
            )
        module = super().setup_module(module)
        self.shard(module, self.device_mesh, lightning_module=False)  # units exist: only the check
        self.install_exchange(module, self.device_mesh)
        return module

    @override
    def save_checkpoint(
        self,
        path: Any,
        state: dict[str, Module | Optimizer | Any],
        storage_options: Any | None = None,
        filter: dict[str, Any] | None = None,
    ) -> None:
        """Save ``state`` as Fabric does and, when it holds an optimizer (to resume from), every rank's exchange state
        beside ``path``, their manifest in the checkpoint."""
        refused = storage_options is not None or (filter is not None and self._save_distributed_checkpoint)
        if not refused and any(isinstance(o, Optimizer) for o in state.values()) and self.replica_exchange:
            if HSDP_KEY in state:
                raise ValueError(f"the state to save has a key {HSDP_KEY!r}, which the strategy's manifest uses")
            saved = self.write_hsdp_shard(self.broadcast(path), self.global_rank, self.world_size)
            state = {**state, HSDP_KEY: saved}
        super().save_checkpoint(path, state, storage_options=storage_options, filter=filter)

    @override
    def load_checkpoint(
        self,
        path: Any,
        state: Module | Optimizer | dict[str, Module | Optimizer | Any] | None = None,
        strict: bool = True,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """Restore ``state`` as Fabric does and, when it holds an optimizer (to train on), this rank's exchange state;
        what is left is returned without the manifest."""
        remainder = super().load_checkpoint(path, state, strict=strict, weights_only=weights_only)
        saved = remainder.pop(HSDP_KEY, None)
        resuming = isinstance(state, dict) and any(isinstance(obj, Optimizer) for obj in state.values())
        if saved is not None and resuming:
            if self.replica_exchange is None:
                raise RuntimeError("fabric.load of an HSDP checkpoint to train on needs fabric.setup(model) first")
            self.read_hsdp_shard(self.broadcast(path), self.global_rank, self.world_size, saved)
        return remainder

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        """Register ``hsdp_gradcomp`` and HSDP's named strategies with Fabric."""
        strategy_registry.register(cls.strategy_name, cls, description=cls.__doc__.splitlines()[0], override=True)
        for name, (description, arguments) in HSDP_PRESETS.items():
            strategy_registry.register(name, cls, description=description, override=True, **arguments)
