"""Compressed HSDP: FSDP2 shards inside a node, the library compresses the gradient shards' exchange between
replicas (a front end beside the DDP hook and DiLoCo, over the same core:
:class:`~lightning_gradcomp.exchange.CompressedAverage`)."""

from lightning_gradcomp.hsdp.replica import ReplicaExchange

__all__ = ["ReplicaExchange"]
