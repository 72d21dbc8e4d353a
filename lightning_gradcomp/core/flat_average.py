"""Flat tensors averaged over a group of ranks through the library's compressor, memory and aggregator, one unit per
tensor: what DiLoCo's compressed synchronisation does with each parameter's pseudo-gradient (SparseLoCo, Sarfi et
al., 2025, arXiv 2508.15706, Algorithm 1, with error feedback) and what compressed HSDP does with each FSDP unit's
gradient shard between replicas. (The DDP hook, whose units arrive in DDP's buckets, has its own pipeline.)

For each ``(name, x)`` (flat, in place):

1. ``memory.compensate_(name, x)`` (error feedback: ``x + beta * e``; DIANA: ``x - h_i``);
2. ``payload = compressor.compress(x, generator)``, the generator seeded from (seed, rank, step, unit): the same
   draws after any restart;
3. every compressed payload travels in one aggregation (one collective, plus a size exchange where sizes vary;
   tensors averaged densely take one allreduce each, as the DDP hook's dense units do);
4. ``memory.settle_`` takes what of this rank's payload reached the average (``e = x - sent``), then the average is
   written over ``x`` (``memory.conclude_``: DIANA adds its ``h``).

Tensors with fewer than ``min_compress_numel`` elements are averaged densely in the same call.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from lightning_gradcomp.core.comm import AGGREGATORS, Aggregate, Aggregator, Collectives, Contribution
from lightning_gradcomp.core.comm.aggregators import local_part
from lightning_gradcomp.core.compressors import Compressor, IdentityCompressor
from lightning_gradcomp.core.compressors.finiteness import nonfinite_count
from lightning_gradcomp.core.memory import Memory
from lightning_gradcomp.core.randomness import UnitStreams
from lightning_gradcomp.core.stats import StepStats
from lightning_gradcomp.core.units import unit_key

__all__ = ["CompressedAverage", "check_flat_compressor"]


def check_flat_compressor(compressor: Compressor, owner: str, aggregator: str, shapes_known: bool = False) -> None:
    """``ValueError`` unless ``compressor`` compresses each tensor on its own: no warm start (PowerSGD), no scale
    agreed over the ranks first (TernGrad's ``share_scale``), a tensor's own shape only where ``owner`` knows it
    (``shapes_known``: DiLoCo's parameters, not HSDP's flat shards), and sparse payloads for ``aggregator="gtopk"``."""
    shaped = compressor.takes_shapes or (compressor.needs_layer_shape and not shapes_known)
    flags = (("each tensor's own shape", shaped), ("a warm start carried between steps", compressor.warm_started),
             ("a scale shared over the ranks", compressor.shares_scale))  # fmt: skip
    needs = [what for what, flag in flags if flag]
    if needs:
        raise ValueError(
            f"compressor {compressor!r} needs {' and '.join(needs)}, which {owner} does not give (it compresses "
            "tensors one by one); use topk, randomk, dgc, gaussiank, qsgd, quantizer, sign, or terngrad without "
            "share_scale"
        )
    if aggregator == "gtopk" and not compressor.sparse:
        raise ValueError(
            f"aggregator='gtopk' merges sparse payloads, and {compressor!r} is not sparse; use 'allgather'"
        )


class CompressedAverage:
    """Averages flat tensors over the ranks of ``collectives`` through ``compressor``, ``memory`` and ``aggregator``.

    Args:
        compressor: compresses each (compensated) tensor; one that needs more than a flat tensor is refused
            (:func:`check_flat_compressor`).
        memory: this rank's state per tensor name (error feedback, DIANA's shifts), part of the checkpoint.
        aggregator: ``"allgather"``, ``"allreduce"``, ``"gtopk"``, ``"auto"`` (the compressor's choice) or an
            :class:`~lightning_gradcomp.core.comm.Aggregator`.
        collectives: the ranks' counted collectives; ``None`` alone (the average of one rank is its own payload).
        seed: base seed of the units' random streams (:mod:`lightning_gradcomp.core.randomness`).
        min_compress_numel: tensors with fewer elements are averaged densely.
        shapes: each tensor's own shape, by name, for a compressor that works on it
            (:attr:`~lightning_gradcomp.core.compressors.Compressor.needs_layer_shape`: SparseLoCo's chunks); the tensor
            is compressed as that view of its flat form.
    """

    def __init__(
        self,
        compressor: Compressor,
        memory: Memory,
        aggregator: str | Aggregator,
        collectives: Collectives | None,
        seed: int = 0,
        min_compress_numel: int = 0,
        shapes: Mapping[str, torch.Size] | None = None,
    ) -> None:
        self.compressor, self.memory, self.collectives = compressor, memory, collectives
        self._shapes = dict(shapes or {}) if compressor.needs_layer_shape else {}
        world = collectives.world_size if collectives is not None else 1
        if isinstance(aggregator, str):
            aggregator = AGGREGATORS[compressor.preferred_aggregator(world) if aggregator == "auto" else aggregator]()
        self.aggregator = aggregator
        self.streams = UnitStreams(seed, collectives.rank if collectives is not None else 0)
        self.min_compress_numel = min_compress_numel
        self._dense = IdentityCompressor()
        self._keys: dict[str, int] = {}

    def compressed(self, numel: int) -> bool:
        """Whether a tensor of ``numel`` elements is compressed (else averaged densely)."""
        return numel >= self.min_compress_numel

    def average_(self, deltas: Sequence[tuple[str, Tensor]], step: int, stats: StepStats) -> None:
        """Overwrite each ``(name, x)`` (flat views) with the average over the ranks of its compressed form, moving the
        memory on; ``step`` seeds the random streams (every rank alike); ``stats`` counts what was compressed and the
        payloads' bytes."""
        start = time.perf_counter()
        contributions = []
        for name, x in deltas:
            if not self.compressed(x.numel()):
                contributions.append(Contribution(self._dense, self._dense.compress(x)))
                continue
            self.memory.compensate_(name, x)
            key = self._keys.get(name)
            if key is None:
                key = self._keys[name] = unit_key([name])
            shaped = x.view(self._shapes[name]) if name in self._shapes else x
            payload = self.compressor.compress(shaped, self.streams.generator(x.device, step, key))
            contributions.append(Contribution(self.compressor, payload))
            stats.numel_compressed += x.numel()
            stats.payload_bytes += payload.nbytes
            stats.selected += payload.selected or 0
        stats.seconds_compress += time.perf_counter() - start
        start = time.perf_counter()
        aggregates = self._aggregate(contributions)
        stats.seconds_communicate += time.perf_counter() - start
        start = time.perf_counter()
        for (name, x), contribution, aggregate in zip(deltas, contributions, aggregates, strict=True):
            if contribution.codec is self._dense:
                x.copy_(aggregate.mean)
                continue
            finite = aggregate.finite if self.memory.keeps_state else True  # on a device, a flag there
            stats.nonfinite_units += nonfinite_count(finite)
            reached = aggregate.reached if self.memory.uses_sent else None
            self.memory.settle_(name, x, reached, x.numel(), finite=finite)  # type: ignore[arg-type]
            mean = aggregate.decode_into(None)
            self.memory.conclude_(name, mean, out=x, unit_numel=x.numel(), update=finite)
        stats.seconds_decompress += time.perf_counter() - start

    def _aggregate(self, contributions: list[Contribution]) -> list[Aggregate]:
        """The aggregator's averages; alone, each payload decoded (what the compressor sends is still what counts)."""
        if self.collectives is not None:
            return self.aggregator.aggregate(contributions, self.collectives)
        return [
            Aggregate(lambda out, c=c: c.codec.decompress(c.payload), local=c, partial=local_part(c.codec, c.payload))
            for c in contributions
        ]
