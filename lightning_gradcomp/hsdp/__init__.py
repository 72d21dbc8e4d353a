"""Compressed HSDP: FSDP2 shards inside a node, the library compresses the gradient shards' exchange between
replicas (a front end beside the DDP hook and DiLoCo, over the same core:
:class:`~lightning_gradcomp.core.flat_average.CompressedAverage`): :class:`ReplicaExchange` for plain torch,
:class:`GradCompHSDPStrategy` for the Trainer, :class:`GradCompHSDPFabricStrategy` for Fabric."""

from lightning_gradcomp.hsdp.fabric import GradCompHSDPFabricStrategy
from lightning_gradcomp.hsdp.presets import HSDP_PRESETS
from lightning_gradcomp.hsdp.replica import ReplicaExchange
from lightning_gradcomp.hsdp.strategy import GradCompHSDPStrategy

__all__ = ["HSDP_PRESETS", "GradCompHSDPFabricStrategy", "GradCompHSDPStrategy", "ReplicaExchange"]
