"""HSDP's named strategies: the replica exchange sparsified, or dense through the same pipeline (the baseline)."""

from __future__ import annotations

from typing import Any

__all__ = ["HSDP_PRESETS"]

#: ``name -> (description, GradCompHSDPStrategy arguments)``, registered with the Trainer and with Fabric.
HSDP_PRESETS: dict[str, tuple[str, dict[str, Any]]] = {
    "hsdp_topk": (
        "HSDP on FSDP2: shards inside a node, each unit's gradient shard averaged between the replicas (nodes) as "
        "its Top-k (1% of the shard, bfloat16 values) under error feedback",
        {"compressor": "topk", "density": 0.01, "wire_precision": "bf16", "memory": "ef", "aggregator": "allgather"},
    ),
    "hsdp_dense": (
        "HSDP on FSDP2 with the exchange between replicas dense, through the same hook (the baseline: FSDP2's own "
        "HSDP, with the same per-step statistics)",
        {"compressor": "none", "memory": "none", "aggregator": "allreduce"},
    ),
}
