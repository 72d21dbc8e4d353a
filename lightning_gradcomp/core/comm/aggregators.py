"""Aggregators: turn every rank's payloads into the average, through counted collectives.

An aggregator sees payloads and the compressor interface that parses and sums them, never a
particular compressor. Each call handles every unit the hook hands over at once (the units a
DDP bucket completed), so the call costs one collective for the payloads (plus one exchange of
sizes when payload sizes vary across ranks); float sums of dense units get one allreduce each
(see :class:`AllreduceAggregator`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property, partial

import torch
from torch import Tensor

from lightning_gradcomp.core.comm.collectives import Collectives
from lightning_gradcomp.core.compressors import Compressor, Entries, IdentityCompressor, Payload
from lightning_gradcomp.core.compressors.finiteness import Finite, all_of, finiteness
from lightning_gradcomp.core.compressors.sparse import SparseEntries, dense_of
from lightning_gradcomp.core.host_copies import device_tensor
from lightning_gradcomp.core.workspace import Scratch


@dataclass(frozen=True)
class Contribution:
    """One flat tensor's payload from this rank, with the compressor that reads it.

    ``out``, when given, returns a flat tensor of the payload's size and dtype that the aggregator
    overwrites with the mean: a buffer the caller keeps across steps (never storage the payload
    reads), so that decoding allocates and faults in nothing. ``scratch`` hands out further kept
    buffers (:mod:`lightning_gradcomp.core.workspace`; its ``"mean"`` buffer is ``out``'s) for the
    allreduce aggregator's summands and, the first contribution's, the allgather aggregator's gathered bytes.
    """

    codec: Compressor
    payload: Payload
    out: Callable[[], Tensor] | None = None
    scratch: Scratch | None = None

    def decode_target(self, out: Tensor | None = None, zero: bool = True) -> Tensor:
        """Where the decoded payloads are summed, zeroed unless ``zero`` is false (a target written over whole):
        ``out`` when the caller names one (DDP's bucket), else ``out()``, else a fresh tensor."""
        if out is None and self.out is not None:
            out = self.out()
        if out is not None:
            return out.zero_() if zero else out
        payload = self.payload
        return torch.zeros(payload.numel, dtype=payload.dtype, device=payload.device)


class Aggregate:
    """The result for one contribution: the average over ranks, decoded when first asked for.

    Decoding is deferred so that the caller can first read what needs no decoded mean (whether the
    mean is finite, what of this rank's payload reached it) and let the memory move on with it, and
    only then have the mean written where it wants it: into the very storage the compressed tensor
    came from (DDP's bucket), which then needs no buffer of its own (:meth:`decode_into`).

    Args:
        decode: writes the mean into the flat tensor it is given (``None``: the contribution's kept
            ``out``, or a fresh tensor) and returns it; called at most once.
        finite: whether the mean will be finite, told from what was gathered or reduced without
            decoding it (every rank's payload values; a float sum); ``None`` when only the decoded
            mean can tell. (A sum of finite payloads that overflows reads as finite here; the mean
            then carries the infinity to the optimizer all the same.)
        local: this rank's contribution, when all of it reached the mean.
        partial: what of it reached the mean when only part did (gTop-k drops entries on the way).
        from_sum: whether decoding reads only a sum over ranks, never this rank's payload (an allreduce):
            the mean may then be written over the tensor the payload was taken from, even where the payload
            is a view of it (a dense payload), without knowing what of it reached the mean.
    """

    def __init__(
        self,
        decode: Callable[[Tensor | None], Tensor],
        finite: Callable[[], Finite] | None = None,
        local: Contribution | None = None,
        partial: Tensor | Entries | None = None,
        from_sum: bool = False,
    ) -> None:
        self._decode: Callable[[Tensor | None], Tensor] | None = decode
        self._finite = finite
        self._mean: Tensor | None = None
        self.local = local
        self.partial = partial
        self.from_sum = from_sum

    def decode_into(self, out: Tensor | None) -> Tensor:
        """The mean, written into the flat ``out`` if it is not decoded yet (``None``: the default target);
        a codec whose mean is a buffer of its own (a dense sum) may return that instead of ``out``."""
        if self._mean is None:
            assert self._decode is not None
            self._mean, self._decode = self._decode(out), None
        return self._mean

    @property
    def mean(self) -> Tensor:
        """The average over ranks of the decompressed payloads (flat)."""
        return self.decode_into(None)

    @property
    def finite_known(self) -> bool:
        """Whether :attr:`finite` is told without decoding the mean."""
        return self._finite is not None

    @cached_property
    def finite(self) -> Finite:
        """Whether every element of the mean is finite: from the gathered data when they tell (no pass over the
        mean, decoded or not), else from the mean; on a device, a flag there (no wait for it)."""
        return self._finite() if self._finite is not None else finiteness(self.mean)

    @cached_property
    def reached(self) -> Tensor | Entries:
        """What of this rank's payload reached ``mean``, which memory takes in: the entries themselves
        for a sparse payload, the codes for a ternary one, else the dense decompressed tensor (decoded
        only when asked for: a memoryless method never pays for it)."""
        if self.partial is not None:
            return self.partial
        assert self.local is not None
        return local_part(self.local.codec, self.local.payload)

    @property
    def reached_before_mean(self) -> bool:
        """Whether :attr:`reached` is known without decoding the mean: entries that gTop-k's merges kept, or a
        payload that is its own entries (a dense decompression may read the mean: PowerSGD's)."""
        return self.partial is not None or (self.local is not None and self.local.payload.entries() is not None)

    @property
    def sent(self) -> Tensor:
        """The dense (flat) form of :attr:`reached`, for inspection."""
        return dense_of(self.reached)


def local_part(codec: Compressor, payload: Payload) -> Tensor | Entries:
    """What of this rank's own payload reaches the average when all of it does (every aggregator but gTop-k):
    kept encoded where it can be added into the memory's state in one pass (sparse entries, ternary codes)."""
    entries = payload.entries()
    return codec.decompress(payload) if entries is None else entries


class Pending:
    """An aggregation whose last collective may still be in flight: :meth:`wait` gives the aggregates.

    Everything that decides *which* collectives run (size exchanges, shared scales, gTop-k's
    rounds) has run by the time a :class:`Pending` exists, so every rank has issued the same
    collectives in the same order; only the last one, and the decoding after it, are deferred.
    A summable form of several rounds (PowerSGD's) launches its later rounds in :meth:`wait`,
    each from the previous round's sum: every rank still issues them in the same order, as long
    as every rank waits for its pending aggregations in the same order (the hook lands them in
    bucket order).
    """

    def __init__(self, finish: Callable[[], list[Aggregate]]) -> None:
        self._finish: Callable[[], list[Aggregate]] | None = finish
        self._results: list[Aggregate] = []

    @classmethod
    def done(cls, results: list[Aggregate]) -> Pending:
        """An aggregation that completed synchronously."""
        return cls(lambda: results)

    def wait(self) -> list[Aggregate]:
        """Block until the collectives are done and decode: one :class:`Aggregate` per contribution, in order."""
        if self._finish is not None:
            self._results, self._finish = self._finish(), None
        return self._results


class Aggregator(ABC):
    """Averages contributions across the ranks of ``collectives``."""

    name: str

    @abstractmethod
    def start(self, contributions: Sequence[Contribution], collectives: Collectives) -> Pending:
        """Launch the aggregation of ``contributions`` (every rank calls it with the same units, in the same order)."""

    def aggregate(self, contributions: Sequence[Contribution], collectives: Collectives) -> list[Aggregate]:
        """One :class:`Aggregate` per contribution, in order; every rank gets the same means."""
        return self.start(contributions, collectives).wait()


class AllreduceAggregator(Aggregator):
    """Sum every contribution's summable form with allreduce, then decode the average.

    By default the summable form is the decompressed tensor pre-scaled by ``1/P`` (as DDP's
    reducer does, so the identity compressor reproduces plain DDP bit for bit); compressors with
    integer codes (TernGrad with a shared scale) sum those instead.

    A compressor whose summable form takes several rounds (:meth:`Compressor.next_summable`,
    PowerSGD's ``P`` then ``Q``) gets each round launched once the previous one's sum is known.

    Integer sums are exact, so all integer contributions of one dtype travel in one collective.
    A float sum over three or more ranks depends on where an element sits in the reduced tensor
    (gloo's ring adds the ranks' values in an order that depends on the element's chunk), so each
    float contribution is reduced alone: its result is then a function of the contribution
    itself, not of which other contributions travel with it (which follows DDP's bucket layout).
    """

    name = "allreduce"

    def start(self, contributions: Sequence[Contribution], collectives: Collectives) -> Pending:
        world = collectives.world_size
        summands = [c.codec.summable(c.payload, world, c.scratch) for c in contributions]
        first = _reduce_start(summands, collectives)

        def finish() -> list[Aggregate]:
            totals = first()
            # further rounds (PowerSGD's Q = M^T P after its P), each computed from the last one's sum
            live = list(range(len(contributions)))
            while following := [(i, s) for i in live if (s := _next(contributions[i], totals[i], world)) is not None]:
                live = [i for i, _ in following]
                for i, total in zip(live, _reduce_start([s for _, s in following], collectives)(), strict=True):
                    totals[i] = total
            return [_from_sum(c, total, world) for c, total in zip(contributions, totals, strict=True)]

        return Pending(finish)


def _from_sum(c: Contribution, total: Tensor, world: int) -> Aggregate:
    """The aggregate of a summed contribution: a float sum tells the mean's finiteness before it is decoded."""

    def decode(out: Tensor | None) -> Tensor:
        return c.codec.from_sum(total, c.payload, world, out if out is not None else c.out() if c.out else None)

    finite = (lambda: finiteness(total)) if total.is_floating_point() else None
    return Aggregate(decode, finite, local=c, from_sum=True)


def _next(contribution: Contribution, total: Tensor, world: int) -> Tensor | None:
    return contribution.codec.next_summable(contribution.payload, total, world)


def _reduce_start(summands: Sequence[Tensor], collectives: Collectives) -> Callable[[], list[Tensor]]:
    """Launch the sums over ranks of ``summands`` (each float tensor alone, integers batched by dtype; see
    :class:`AllreduceAggregator`); the returned function waits and gives the sums in order."""
    batches = [[i] for i, t in enumerate(summands) if t.is_floating_point()]
    integer_dtypes = dict.fromkeys(t.dtype for t in summands if not t.is_floating_point())
    batches += [[i for i, t in enumerate(summands) if t.dtype == dtype] for dtype in integer_dtypes]
    launched = []
    for positions in batches:
        flat = torch.cat([summands[i] for i in positions]) if len(positions) > 1 else summands[positions[0]]
        launched.append((positions, collectives.all_reduce_start(flat)))

    def wait() -> list[Tensor]:
        totals: list[Tensor | None] = [None] * len(summands)
        for positions, reduction in launched:
            flat = reduction.wait()
            for i, total in zip(positions, flat.split([summands[i].numel() for i in positions]), strict=True):
                totals[i] = total
        return totals  # type: ignore[return-value]

    return wait


class AllgatherAggregator(Aggregator):
    """Gather every rank's payload bytes (variable sizes allowed) and sum them on every rank.

    Costs ``O(P * payload)`` bytes received per rank. Contributions of the identity compressor
    (tensors left dense, such as biases) are all-reduced apart, by :class:`AllreduceAggregator`.
    """

    name = "allgather"

    def start(self, contributions: Sequence[Contribution], collectives: Collectives) -> Pending:
        return start_dense_apart(contributions, collectives, self._gather)

    def _gather(self, contributions: Sequence[Contribution], collectives: Collectives) -> Pending:
        world, rank = collectives.world_size, collectives.rank
        buffers = [c.payload.to_bytes() for c in contributions]
        fixed = [c.codec.payload_nbytes(c.payload.shape, c.payload.dtype) for c in contributions]
        sizes_fixed = all(size is not None for size in fixed)
        if sizes_fixed:
            if fixed != [b.numel() for b in buffers]:
                raise RuntimeError(f"payload sizes {[b.numel() for b in buffers]} differ from the declared {fixed}")
            unit_sizes = [fixed] * world
        else:
            local_sizes = device_tensor([b.numel() for b in buffers], torch.int64, buffers[0].device)
            unit_sizes = collectives.all_gather(local_sizes).tolist()
        # the payloads written end to end into this rank's row of the gathered bytes (no joined copy); where their
        # sizes are fixed, into a buffer kept with the first unit's (sizes that change would reallocate it anyway)
        scratch, device = contributions[0].scratch, buffers[0].device
        kept = scratch if sizes_fixed else None
        into = None if kept is None else (lambda numel: kept("gathered", numel, torch.uint8, device))
        gathering = collectives.all_gather_bytes_start(buffers, [sum(sizes) for sizes in unit_sizes], into)

        def finish() -> list[Aggregate]:
            rows = gathering.wait()
            results = []
            offsets = [0] * world
            for i, c in enumerate(contributions):
                shape, dtype = c.payload.shape, c.payload.dtype
                payloads = []
                for r in range(world):
                    size = unit_sizes[r][i]
                    if r == rank:
                        payloads.append(c.payload)
                    else:
                        payloads.append(c.codec.unpack(rows[r][offsets[r] : offsets[r] + size], shape, dtype))
                    offsets[r] += size
                results.append(Aggregate(partial(self.average, c, payloads, world), _entries_finite(payloads), local=c))
            return results

        return Pending(finish)

    def average(self, c: Contribution, payloads: list[Payload], world: int, out: Tensor | None) -> Tensor:
        """The mean of every rank's decoded payload (in rank order), written into ``out`` (or the default target)."""
        return c.codec.average_all(payloads, c.decode_target(out, zero=False), world)


class ChoosersAggregator(AllgatherAggregator):
    """Gather every rank's chosen entries, then average each index over the ranks that chose it.

    SparseLoCo's reference configuration (Templar, ``scatter_reduce(..., reduce="mean", include_self=False)``) takes
    this mean instead of the sum divided by the world: an index two of eight ranks chose is their mean, not a quarter of
    it, so a sparse step is not shrunk by the ranks that did not choose it. Defined for payloads of chosen entries
    (:attr:`~lightning_gradcomp.core.compressors.Compressor.selects_entries`); tensors left dense are averaged over
    every rank, who all chose every entry.
    """

    name = "allgather_choosers"

    def average(self, c: Contribution, payloads: list[Payload], world: int, out: Tensor | None) -> Tensor:
        """Each index's sum over the ranks that chose it, divided by how many did (0 where none did)."""
        total = c.codec.accumulate_all(payloads, c.decode_target(out))
        choosers = torch.zeros(total.numel(), dtype=total.dtype, device=total.device)
        for payload in payloads:
            entries = payload.entries()
            if not isinstance(entries, SparseEntries):
                raise TypeError(f"{type(payload).__name__} carries no chosen entries to average over their choosers")
            choosers.index_add_(0, entries.indices, torch.ones_like(entries.values, dtype=total.dtype))
        return total.div_(choosers.clamp_(min=1))


def _entries_finite(payloads: Sequence[Payload]) -> Callable[[], Finite] | None:
    """Whether every payload decodes to finite values, told from their entries (values, scales, norms: no decoding),
    or ``None`` when some payload has no entries."""
    entries = [p.entries() for p in payloads]
    if any(e is None for e in entries):
        return None
    return lambda: all_of(e.all_finite() for e in entries)  # type: ignore[union-attr]


def start_dense_apart(
    contributions: Sequence[Contribution],
    collectives: Collectives,
    compressed: Callable[[Sequence[Contribution], Collectives], Pending],
) -> Pending:
    """Route the identity compressor's contributions (tensors left dense) to the allreduce aggregator, the rest to
    ``compressed``, both launched before either is waited for; the results come in the contributions' order."""
    dense = [i for i, c in enumerate(contributions) if isinstance(c.codec, IdentityCompressor)]
    others = [i for i, c in enumerate(contributions) if not isinstance(c.codec, IdentityCompressor)]
    launched = [
        (positions, start([contributions[i] for i in positions], collectives))
        for positions, start in ((dense, AllreduceAggregator().start), (others, compressed))
        if positions
    ]

    def finish() -> list[Aggregate]:
        results: list[Aggregate | None] = [None] * len(contributions)
        for positions, pending in launched:
            for i, result in zip(positions, pending.wait(), strict=True):
                results[i] = result
        return results  # type: ignore[return-value]

    return Pending(finish)


AGGREGATORS: dict[str, type[Aggregator]] = {
    cls.name: cls for cls in (AllreduceAggregator, AllgatherAggregator, ChoosersAggregator)
}
