"""What the HSDP Trainer and Fabric strategies share: their arguments, checked where they enter, the mesh and units they
build, the replica exchange they install, and each rank's shard of its state beside a checkpoint (the memory of this
rank's gradient shards and the units' step counts: every rank holds its own)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy

from lightning_gradcomp.core.checkpoint import (
    ShardTags,
    manifest,
    on_every_rank,
    read_shard,
    refuse_other_run,
    write_shard,
)
from lightning_gradcomp.core.compressors import Compressor
from lightning_gradcomp.core.flat_average import check_flat_compressor
from lightning_gradcomp.core.pipeline_arguments import aggregator_name, build_pipeline, pipeline_names
from lightning_gradcomp.core.presets import FromPreset
from lightning_gradcomp.core.validation import check_bool, check_int
from lightning_gradcomp.hsdp.presets import HSDP_PRESETS
from lightning_gradcomp.hsdp.replica import ReplicaExchange
from lightning_gradcomp.hsdp.sharding import (
    check_unit_modules,
    hsdp_mesh,
    shard_model,
    unsharded_parameters,
)

__all__ = ["HSDP_KEY", "PRECISIONS", "REDUCE_IN_FLOAT32", "HSDPSettings", "check_precision"]

#: The manifest's key in the checkpoint.
HSDP_KEY = "hsdp"
#: The units the strategies shard reduce their gradients in float32 whatever the parameters' dtype (``bf16-true``):
#: the shard the exchange gets, and the error-feedback residual kept for it, hold small values.
REDUCE_IN_FLOAT32 = MixedPrecisionPolicy(reduce_dtype=torch.float32)
#: The precisions Lightning's ``ModelParallelStrategy`` takes (a loss scaler would decide from each rank's shards).
PRECISIONS = ("32-true", "bf16-mixed", "bf16-true", "16-true")


def check_precision(precision: str, owner: str) -> None:
    """``ValueError`` unless ``precision`` is one of :data:`PRECISIONS` (Lightning refuses the others for its
    ``ModelParallelStrategy`` given as an object, but not for one named by a string)."""
    if precision not in PRECISIONS:
        raise ValueError(f"{owner} does not support precision={precision!r}; choose one of {list(PRECISIONS)}")


class HSDPSettings(FromPreset):
    """Compressed HSDP's arguments, validated once; the strategies' ``from_preset(name, **overrides)`` changes any of a
    named strategy's (:data:`~lightning_gradcomp.hsdp.presets.HSDP_PRESETS`).

    Args:
        compressor, compressor_kwargs, density, wire_precision, memory, memory_kwargs, aggregator: the replica
            exchange's pipeline, as :class:`~lightning_gradcomp.GradCompStrategy` takes them (compressors that need a
            tensor's own shape, a warm start or a shared scale are refused: a unit's shard is a flat slice of several
            parameters).
        min_compress_numel: shards with fewer elements are averaged densely.
        seed: base seed of the compressors' random streams.
        replicate_size: replicas (the mesh's first dimension); ``"auto"``: one per node. The shard dimension is the
            rest, ``world_size // replicate_size`` ranks.
        unit_modules: the blocks to shard as FSDP units when ``configure_model`` (or Fabric's ``parallelize_fn``)
            has not: module classes or class names; ``None``, each element of the model's outermost
            ``nn.ModuleList``\\s (:func:`~lightning_gradcomp.hsdp.sharding.plan_units`).
        reshard_after_forward: ``fully_shard``'s: free the gathered parameters after the forward (ZeRO-3) or keep
            them until the backward (ZeRO-2, one all-gather fewer).
    """

    presets = HSDP_PRESETS

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
    ) -> None:
        check_int("min_compress_numel", min_compress_numel, 0)
        check_int("seed", seed, 0)
        if replicate_size != "auto":
            check_int("replicate_size", replicate_size, 1, note="or 'auto' (one replica per node)")
        check_bool("reshard_after_forward", reshard_after_forward)
        self.unit_modules = check_unit_modules(unit_modules)
        name = aggregator_name(aggregator)
        codec, _ = build_pipeline(compressor, compressor_kwargs, density, wire_precision, memory, memory_kwargs, name)
        check_flat_compressor(codec, "HSDP's replica exchange", name)  # a bad combination fails here, not at setup
        #: the replica exchange's arguments
        self.exchange_arguments: dict[str, Any] = {
            "compressor": compressor, "compressor_kwargs": compressor_kwargs, "density": density,
            "wire_precision": wire_precision, "memory": memory, "memory_kwargs": memory_kwargs,
            "aggregator": aggregator, "min_compress_numel": min_compress_numel, "seed": seed,
        }  # fmt: skip
        self.replicate_size = replicate_size
        self.reshard_after_forward = reshard_after_forward
        #: the exchange between replicas, once the strategy has sharded its module
        self.replica_exchange: ReplicaExchange | None = None
        self._exchange_module: nn.Module | None = None
        self._mesh_shape: tuple[int, int] | None = None
        self._tags = ShardTags()

    def build_mesh(self, device_type: str, world_size: int, num_nodes: int) -> DeviceMesh:
        """The ``(replicate, shard)`` mesh: ``replicate_size`` replicas (one per node for ``"auto"``)."""
        replicas = num_nodes if self.replicate_size == "auto" else self.replicate_size
        mesh = hsdp_mesh(device_type, world_size, replicas)
        self._mesh_shape = (replicas, world_size // replicas)
        return mesh

    def shard(self, module: nn.Module, mesh: DeviceMesh, lightning_module: bool) -> None:
        """``fully_shard`` ``module``'s blocks over the shard dimension, gradients reduced in float32
        (:data:`REDUCE_IN_FLOAT32`), unless its units exist already; every trainable parameter must end up in a unit
        (else it would train apart on every rank)."""
        if not any(isinstance(m, FSDPModule) for m in module.modules()):
            shard_model(module, mesh["shard"], self.unit_modules, self.reshard_after_forward, not lightning_module,
                        REDUCE_IN_FLOAT32)  # fmt: skip
        outside = unsharded_parameters(module)
        if outside:
            raise ValueError(
                f"parameters {outside} are in no FSDP unit: shard every module holding trainable parameters with "
                "fully_shard(..., mesh=device_mesh['shard']) in configure_model, or leave the sharding to the strategy"
            )

    def install_exchange(self, module: nn.Module, mesh: DeviceMesh) -> ReplicaExchange:
        """Install the compressed exchange on ``module``'s units (once per module: a later ``fit`` of the same model
        keeps its memory), and share rank 0's run tag (it marks this run's shards)."""
        if self.replica_exchange is not None and self._exchange_module is module:
            return self.replica_exchange
        self.replica_exchange = ReplicaExchange(module, mesh, **self.exchange_arguments)
        self._exchange_module = module
        self._tags.share()
        return self.replica_exchange

    def write_hsdp_shard(self, path: Any, rank: int, world_size: int) -> dict[str, Any]:
        """Write this rank's exchange state beside ``path`` and return the manifest the checkpoint keeps under
        :data:`HSDP_KEY`."""
        assert self.replica_exchange is not None
        tag = self._tags.next()
        write_shard(path, rank, world_size, {"tag": tag, "exchange": self.replica_exchange.state_dict()})
        return {**manifest(world_size, tag, *self._names()), "mesh": list(self._mesh_shape or ())}

    def _names(self) -> tuple[str, str]:
        arguments = self.exchange_arguments
        return pipeline_names(arguments["compressor"], arguments["memory"], arguments["wire_precision"])

    def read_hsdp_shard(self, path: Any, rank: int, world_size: int, saved: dict[str, Any]) -> None:
        """Restore this rank's exchange state from the checkpoint at ``path`` whose manifest is ``saved``. Refused by
        name, on every rank alike when any rank's is: a checkpoint of another world size, mesh, memory or compressor
        (the shards and their memory would not match), a shard missing, unreadable or foreign, and one holding units
        this model lacks."""
        exchange = self.replica_exchange
        assert exchange is not None
        mesh = ("a (replicate, shard) mesh", self._mesh_shape)

        def restore() -> None:
            refuse_other_run(path, "HSDP exchange state", saved, world_size, *self._names(), mesh=mesh)
            exchange.load_state_dict(read_shard(path, rank, saved)["exchange"])

        on_every_rank(restore)
