"""gTop-k: merge sparse sets pairwise in log2(P) rounds, keeping k entries, instead of gathering P of them.

Shi et al., "A Distributed Synchronous SGD Algorithm with Global Top-k Sparsification for Low
Bandwidth Networks" (ICDCS 2019), Sec. IV, Algorithms 2 and 3.

Every rank holds a sparse set of at most ``k`` entries per tensor. A *merge* of two sets sums
the values at shared indices and keeps the ``k`` entries of largest ``|value|``. The authors
merge up a tree to rank 0 and broadcast the result; here the merges run as a recursive-doubling
butterfly, so that every rank ends with the result and no broadcast is needed:

* round ``r`` (``r = 0 .. log2(P') - 1``): exchange sets with rank ``rank XOR 2^r``, and both
  partners merge. The merge is a pure function of the unordered pair of sets (union in index
  order, each shared index summed as one addition ``a + b``, which IEEE arithmetic makes
  commutative, then a stable sort by ``|value|`` descending, so ties go to the lower index):
  both partners compute bit-identical sets, and after the last round all ranks do.
* Any world size: with ``P'`` the largest power of two ``<= P``, rank ``P' + j`` first sends its
  set to rank ``j``, which merges it in; the butterfly runs among the first ``P'`` ranks; rank
  ``j`` finally sends the result back to rank ``P' + j``. (The authors' code needs ``P`` to be
  a power of two.)

Cost per rank and call, ``P`` a power of two, ``B = k * (index + value bytes)`` (an index takes about
``2 + log2(d / k)`` bits): ``log2(P)``
messages of ``B`` sent and received, i.e. ``alpha * log2(P) + 2k * log2(P) * beta`` in the
paper's model (``k`` values and ``k`` indices per round), against ``2 (P - 1) k beta`` for an
allgather of the Top-k sets and ``2 (P - 1) / P * d * beta`` for a dense ring allreduce. Bytes
per rank per step therefore grow like ``log2(P)``, where the allgather's received bytes grow
like ``P``. Otherwise the first ``P - P'`` ranks pay one extra message each way, and the folded
ranks send and receive one message in all. All units of a call travel in one
message per round; each unit has a fixed size (a count, the indices as a sorted set in the format
and size of ``k`` of them, :mod:`~lightning_gradcomp.core.compressors.indices`, then ``k`` value slots,
zero-padded), so no sizes are exchanged. Under a wire precision (``wire_precision="bf16"``) the values
travel in it, and every rank rounds what it holds to it before each round, its own set included, so
that both partners of a merge sum the same numbers and hold the same set; sums are taken in the
values' own dtype. The rounding of a merged sum reaches no rank's residual (each rank's residual keeps
the rounding of its own entries only), so error feedback does not compensate it: use ``"bf16"``,
whose range is float32's (the sums are not divided by the world size first, and float16 is
refused: it could overflow where the allgather would not).

What reached the result (``Aggregate.sent``, which error feedback subtracts from ``acc``): a
local entry reached the global sum only if its index survived *every* merge along its owner's
path, not merely if the index is in the final set: rank 0's entry at ``i`` can be dropped in
round 0 while ranks 2 and 3 carry ``i`` into the result. Each rank therefore tracks the indices
that survived all merges it performed, and a folded rank receives that mask with the result.
``sent`` is the local set restricted to those indices, so that ``sum over ranks of sent`` equals
``P * mean`` (up to summation order) and nothing is lost from the error-feedback residual. The
authors put back only local entries whose index is absent from the final
set; that loses the values dropped on the way.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_gradcomp.core.comm.aggregators import Aggregate, Aggregator, Contribution, Pending, start_dense_apart
from lightning_gradcomp.core.comm.collectives import Collectives
from lightning_gradcomp.core.compressors import IdentityCompressor, SparseEntries, SparsePayload, all_finite
from lightning_gradcomp.core.compressors.finiteness import finiteness
from lightning_gradcomp.core.compressors.indices import decode_indices, encode_indices, encoded_nbytes, is_ascending
from lightning_gradcomp.core.compressors.precision import CastPayload
from lightning_gradcomp.core.compressors.sparse import itemsize
from lightning_gradcomp.core.compressors.topk import ascending_top_k, k_for
from lightning_gradcomp.core.compressors.wire import ByteReader, to_bytes
from lightning_gradcomp.core.validation import check_density

_COUNT_DTYPE = torch.int64


@dataclass(frozen=True)
class SparseSet:
    """At most ``k`` entries of a flat tensor: ascending unique ``indices`` (int32 where they fit, as payloads and
    merges make them, else int64) and their ``values``."""

    indices: Tensor
    values: Tensor


def canonical(indices: Tensor, values: Tensor) -> SparseSet:
    """Sort entries by index, summing the values of repeated indices (a payload's indices should be unique)."""
    indices = indices.reshape(-1)  # in the payload's own dtype (int32 where the tensor's positions fit)
    values = values.reshape(-1)
    if is_ascending(indices):  # Top-k's payloads come in order: nothing to sort or sum
        return SparseSet(indices, values)
    order = _index_order(indices)
    indices, values = indices[order], values[order]
    if indices.numel() > 1 and bool((indices[1:] == indices[:-1]).any()):
        indices, inverse = torch.unique_consecutive(indices, return_inverse=True)
        values = torch.zeros(indices.numel(), dtype=values.dtype, device=values.device).index_add_(0, inverse, values)
    return SparseSet(indices, values)


def _index_order(indices: Tensor) -> Tensor:
    """The stable ascending order of ``indices`` (sorted as int32 when they fit: about three times faster)."""
    small = (
        indices.dtype == torch.int32
        or indices.numel() == 0
        or (int(indices.min()) >= 0 and int(indices.max()) < 2**31)  # read back only for int64 indices
    )
    return torch.sort(indices.int() if small else indices, stable=True).indices


def _largest(magnitudes: Tensor, k: int) -> Tensor:
    """Ascending positions of the ``k`` largest ``magnitudes``, ties to the lower position (deterministic: both
    partners of a merge keep the same entries); a NaN ranks first, as in ``torch.topk``."""
    if all_finite(magnitudes):
        return ascending_top_k(magnitudes, k)
    return torch.argsort(magnitudes, descending=True, stable=True)[:k].sort().values


def keep_largest(entries: SparseSet, k: int) -> SparseSet:
    """The ``k`` entries of largest ``|value|``, ties to the lower index, in index order (all if there are fewer)."""
    if entries.indices.numel() <= k:
        return entries
    kept = _largest(entries.values.abs(), k)
    return SparseSet(entries.indices[kept], entries.values[kept])


def merge(a: SparseSet, b: SparseSet, k: int) -> SparseSet:
    """Sum two index-ordered sparse sets and keep the ``k`` entries of largest ``|value|``.

    ``merge(a, b, k)`` and ``merge(b, a, k)`` are bit-identical: each shared index is summed by
    one addition of its two values (commutative in IEEE arithmetic), and :func:`keep_largest`
    depends only on the summed, index-ordered entries.
    """
    return merge_tracked(a, b, k)[0]


def merge_tracked(a: SparseSet, b: SparseSet, k: int) -> tuple[SparseSet, Tensor, Tensor]:
    """:func:`merge`, with where each entry of ``a`` and of ``b`` went: its position in the result, or -1 (dropped).

    What lets gTop-k follow a rank's own entries through the rounds without a set-membership test per round (the
    positions are int32 where the indices fit in it).
    The entries are summed and chosen in the sorted union itself: an index held twice gets both values in its first
    entry and a magnitude of -1 in its second, below every real one, so the ``k`` largest magnitudes are the ``k``
    largest distinct entries in the same order (ties to the lower index), with no copy of the distinct entries out;
    the second entry then gets the place its first entry got.
    """
    indices, order = torch.sort(_joined(a.indices, b.indices), stable=True)  # the sorted indices come with it
    values = torch.cat([a.values, b.values]).index_select(0, order)
    device = indices.device
    shared = torch.nonzero(indices[1:] == indices[:-1]).reshape(-1)  # sorted positions the next entry repeats
    values.index_add_(0, shared, values.index_select(0, shared + 1))
    repeats = shared + 1
    if order.numel() - shared.numel() <= k:  # every distinct entry is kept
        kept = _first_entries(order.numel(), repeats, device)
    else:
        kept = _largest(values.abs().index_fill_(0, repeats, -1.0), k)
    merged = SparseSet(indices.index_select(0, kept), values.index_select(0, kept))
    positions = indices.dtype
    del indices, values  # freed before the places are made: a merge's temporaries peak lower
    # each sorted entry's place in the result (-1: dropped); a repeated index's second entry follows its first
    # (copies by int64 positions, ``kept`` and ``order``: ``index_copy_`` takes about 0.6 of ``index_put_``'s time)
    place = torch.full((order.numel(),), -1, dtype=positions, device=device)
    place.index_copy_(0, kept, torch.arange(kept.numel(), dtype=positions, device=device))
    place.index_copy_(0, repeats, place.index_select(0, shared))
    moved = torch.empty_like(place).index_copy_(0, order, place)
    na = a.indices.numel()
    return merged, moved[:na], moved[na:]


def _joined(a: Tensor, b: Tensor) -> Tensor:
    """Two ascending index sets end to end, as int32 when they fit (sorted about three times faster than int64, in
    half the memory; every position then fits too), else as int64. Sets already in int32 (as payloads and merges
    hold them where they fit) are joined as they are; others are checked by their ends."""
    if a.dtype == b.dtype == torch.int32:
        return torch.cat([a, b])
    ends = [t[i] for t in (a, b) if t.numel() for i in (0, -1)]
    read = torch.stack(ends).tolist() if ends else [0]  # the ends read back at once: one wait on a device
    if min(read) < 0 or max(read) >= 2**31:
        return torch.cat([a, b])
    joined = torch.empty(a.numel() + b.numel(), dtype=torch.int32, device=a.device)
    joined[: a.numel()].copy_(a)
    joined[a.numel() :].copy_(b)
    return joined


def _first_entries(count: int, repeats: Tensor, device: torch.device) -> Tensor:
    """Ascending positions of the ``count`` sorted entries that are not the second of a repeated index."""
    first = torch.ones(count, dtype=torch.bool, device=device)
    first[repeats] = False
    return torch.nonzero(first).reshape(-1)


def _follow(where: Tensor, moved: Tensor) -> Tensor:
    """Positions ``where`` (-1: gone) after a merge that moved the entries they point at to ``moved``."""
    return torch.where(where >= 0, moved[where.clamp(min=0)], -1)


@dataclass(frozen=True)
class _Unit:
    """Wire layout of one contribution: a count, the indices in the format of ``k`` of them, ``k`` value slots in
    the ``wire`` dtype (and ``k`` flags); ``dtype`` is the values' own, in which merges sum."""

    numel: int
    k: int
    dtype: torch.dtype
    wire: torch.dtype

    def nbytes(self, flags: bool = False) -> int:
        indices = encoded_nbytes(self.numel, self.k, capacity=self.k)
        return itemsize(_COUNT_DTYPE) + indices + self.k * (itemsize(self.wire) + int(flags))

    def rounded(self, entries: SparseSet) -> SparseSet:
        """``entries`` with their values as the wire carries them (rounded to ``wire`` and back)."""
        if self.wire == self.dtype:
            return entries
        return SparseSet(entries.indices, entries.values.to(self.wire).to(self.dtype))


def _padded(t: Tensor, length: int, dtype: torch.dtype) -> Tensor:
    out = torch.zeros(length, dtype=dtype, device=t.device)
    out[: t.numel()] = t
    return out


def _pack(sets: Sequence[SparseSet], units: Sequence[_Unit], flags: Sequence[Tensor] | None = None) -> Tensor:
    """One uint8 message for all units: per unit its count, padded indices, padded values (and padded flags)."""
    parts: list[Tensor] = []
    for i, (entries, unit) in enumerate(zip(sets, units, strict=True)):
        device = entries.values.device
        parts.append(torch.full((1,), entries.indices.numel(), dtype=_COUNT_DTYPE, device=device))
        parts.append(encode_indices(entries.indices, unit.numel, capacity=unit.k))
        parts.append(_padded(entries.values.to(unit.wire), unit.k, unit.wire))
        if flags is not None:
            parts.append(_padded(flags[i], unit.k, torch.uint8))
    return to_bytes(parts)


def _unpack(buffer: Tensor, units: Sequence[_Unit], flags: bool = False) -> tuple[list[SparseSet], list[Tensor]]:
    """Parse :func:`_pack`'s message: the sets, and the flags (as bool tensors) when ``flags``."""
    reader = ByteReader(buffer)
    sets, masks = [], []
    for unit in units:
        count = int(reader.take(1, _COUNT_DTYPE))
        if not 0 <= count <= unit.k:
            raise RuntimeError(f"gtopk message holds {count} entries for a unit of at most {unit.k}")
        encoded = reader.take(encoded_nbytes(unit.numel, unit.k, capacity=unit.k), torch.uint8)
        indices = decode_indices(encoded, unit.numel, count, capacity=unit.k)
        values = reader.take(unit.k, unit.wire)[:count].to(unit.dtype)
        sets.append(SparseSet(indices, values))
        if flags:
            masks.append(reader.take(unit.k, torch.uint8)[:count].bool())
    if reader.remaining:
        raise RuntimeError(f"gtopk message has {reader.remaining} unexpected trailing bytes")
    return sets, masks


class PointToPoint:
    """Counted point-to-point messages between ranks of ``collectives.group`` (group ranks).

    Every message is recorded in ``collectives.counter`` as one call: bytes handed to send as
    sent, bytes of the receive buffer as received. Calls block until the transfer completes
    (inside a DDP comm hook on gloo, blocking send/recv and waited-on isend/irecv both work).
    """

    def __init__(self, collectives: Collectives) -> None:
        self.collectives = collectives
        self.group = collectives.group

    def _global(self, group_rank: int) -> int:
        return dist.get_global_rank(self.group, group_rank)

    def send(self, buffer: Tensor, peer: int) -> None:
        """Send ``buffer`` (uint8, non-empty) to group rank ``peer``."""
        start = time.perf_counter()
        dist.send(buffer, self._global(peer), group=self.group)
        self.collectives.counter.record(buffer.numel(), 0, time.perf_counter() - start)

    def recv(self, nbytes: int, peer: int, device: torch.device) -> Tensor:
        """Receive ``nbytes`` bytes from group rank ``peer``."""
        out = torch.empty(nbytes, dtype=torch.uint8, device=device)
        start = time.perf_counter()
        dist.recv(out, self._global(peer), group=self.group)
        self.collectives.counter.record(0, nbytes, time.perf_counter() - start)
        return out

    def exchange(self, buffer: Tensor, peer: int, nbytes: int) -> Tensor:
        """Send ``buffer`` to group rank ``peer`` and receive ``nbytes`` bytes from it, concurrently."""
        out = torch.empty(nbytes, dtype=torch.uint8, device=buffer.device)
        start = time.perf_counter()
        ops = [
            dist.P2POp(dist.isend, buffer, self._global(peer), self.group),
            dist.P2POp(dist.irecv, out, self._global(peer), self.group),
        ]
        for request in dist.batch_isend_irecv(ops):
            request.wait()
        self.collectives.counter.record(buffer.numel(), nbytes, time.perf_counter() - start)
        return out


def _flags(count: int, where: Tensor) -> Tensor:
    """A mask over ``count`` held entries: those that ``where`` points at."""
    flags = torch.zeros(count, dtype=torch.bool, device=where.device)
    flags[where[where >= 0]] = True
    return flags


def _sorted_isin(elements: Tensor, test: Tensor) -> Tensor:
    """``torch.isin`` for ascending unique ``elements`` and ``test``, by one binary search per element."""
    if not test.numel():
        return torch.zeros(elements.numel(), dtype=torch.bool, device=elements.device)
    test = test if test.dtype == elements.dtype else test.to(elements.dtype)  # else searchsorted widens them all
    at = torch.searchsorted(test, elements).clamp(max=test.numel() - 1)
    return test[at] == elements


def _scatter_mean(c: Contribution, entries: SparseSet, world: int, out: Tensor | None) -> Tensor:
    """The global set divided by ``P``, written into ``out`` zeroed (``None``: the contribution's target)."""
    mean = c.decode_target(out)
    return mean.index_put_((entries.indices,), (entries.values / world).to(mean.dtype))


def _sparse_and_wire(payload: object) -> tuple[SparsePayload, torch.dtype]:
    """A contribution's sparse payload and the dtype its values travel in (a wire precision's, or their own)."""
    if isinstance(payload, CastPayload) and isinstance(payload.inner, SparsePayload):
        return payload.inner, payload.wire
    if not isinstance(payload, SparsePayload):
        raise ValueError(f"gtopk needs SparsePayload contributions, got {type(payload).__name__}")
    return payload, payload.dtype


def _density(codec: object) -> float:
    density = getattr(codec, "density", None)
    try:
        return check_density("density", density)
    except ValueError:
        raise ValueError(
            f"gtopk needs the compressor's density in (0, 1] to size its sets; "
            f"{type(codec).__name__} has density={density!r}"
        ) from None


class GTopKAggregator(Aggregator):
    """Global Top-k: every rank ends with the same ``k``-entry sparse estimate of the sum of the ranks' sets.

    The result is exactly the Top-k of the sum for ``P = 2``; for more ranks each merge keeps
    ``k`` entries, so an index dropped from a partial sum cannot come back through it (the
    paper's approximation, Sec. IV).

    For sparse compressors (``codec.sparse``) with a ``density``; ``k = k_for(numel, density)``
    per contribution, read at every call (a density schedule may change it). A payload with more
    than ``k`` entries (a compressor whose count varies) is cut to its ``k`` largest first.
    Contributions of the identity compressor (parameters left dense) are all-reduced apart, by
    :class:`~lightning_gradcomp.core.comm.AllreduceAggregator`. See the module docstring for the butterfly, its cost
    (``alpha log2 P + 2k log2 P beta``), any-``P`` folding, and what counts as sent.

    ``mean`` is the global set divided by ``P`` (dense, flat, at most ``k`` nonzeros) and is
    bit-identical on every rank; ``sent`` is the local entries that survived every merge.
    """

    name = "gtopk"

    def start(self, contributions: Sequence[Contribution], collectives: Collectives) -> Pending:
        """The butterfly runs at once (each round needs the last one's sets); parameters left dense overlap it."""
        for c in contributions:
            if isinstance(c.codec, IdentityCompressor):
                continue  # left dense: all-reduced apart
            if not c.codec.sparse:
                raise ValueError(
                    f"gtopk merges sparse payloads; compressor {type(c.codec).__name__} is not sparse "
                    "(use aggregator 'allreduce' or 'allgather')"
                )
            _density(c.codec)
            _sparse_and_wire(c.payload)
        return start_dense_apart(contributions, collectives, lambda cs, col: Pending.done(self._global_topk(cs, col)))

    def _global_topk(self, contributions: Sequence[Contribution], collectives: Collectives) -> list[Aggregate]:
        world, rank = collectives.world_size, collectives.rank
        units, local = [], []
        vouching = []
        for c in contributions:
            payload, wire = _sparse_and_wire(c.payload)
            vouching.append(payload.largest)
            numel = payload.numel
            k = k_for(numel, _density(c.codec))
            unit = _Unit(numel, k, payload.dtype, wire)
            units.append(unit)
            # in a wire precision every rank merges the values it sends: both partners of a merge then hold the
            # same sets, and what reached the result (error feedback's ``sent``) carries the rounding
            local.append(unit.rounded(keep_largest(canonical(payload.indices, payload.values), k)))
        device = contributions[0].payload.device
        size = sum(u.nbytes() for u in units)
        size_flagged = sum(u.nbytes(flags=True) for u in units)
        p2p = PointToPoint(collectives)
        base = 1 << (world.bit_length() - 1)  # P', the largest power of two <= P
        held = list(local)
        if rank >= base:
            p2p.send(_pack(held, units), rank - base)
            held, masks = _unpack(p2p.recv(size_flagged, rank - base, device), units, flags=True)
            reached_by = [_sorted_isin(m.indices, g.indices[f]) for m, g, f in zip(local, held, masks, strict=True)]
        else:
            # where this rank's own entries sit in the sets held (-1: dropped by a merge), and the folded rank's
            where = [torch.arange(m.indices.numel(), dtype=torch.int32, device=device) for m in local]  # k < 2^31
            folded = rank + base if rank + base < world else None
            if folded is not None:
                theirs, _ = _unpack(p2p.recv(size, folded, device), units)
                merged = [merge_tracked(a, b, u.k) for a, b, u in zip(held, theirs, units, strict=True)]
                held = [u.rounded(m[0]) for m, u in zip(merged, units, strict=True)]
                where = [m[1] for m in merged]
                where_folded = [m[2] for m in merged]
            for r in range(int(math.log2(base))):
                theirs, _ = _unpack(p2p.exchange(_pack(held, units), rank ^ (1 << r), size), units)
                merged = [merge_tracked(a, b, u.k) for a, b, u in zip(held, theirs, units, strict=True)]
                held = [u.rounded(m[0]) for m, u in zip(merged, units, strict=True)]
                where = [_follow(w, m[1]) for w, m in zip(where, merged, strict=True)]
                if folded is not None:
                    where_folded = [_follow(w, m[1]) for w, m in zip(where_folded, merged, strict=True)]
            if folded is not None:
                flags = [_flags(h.indices.numel(), w) for h, w in zip(held, where_folded, strict=True)]
                p2p.send(_pack(held, units, flags), folded)
            reached_by = [w >= 0 for w in where]

        results = []
        for c, unit, entries, mine, reached, vouches in zip(
            contributions, units, held, local, reached_by, vouching, strict=True
        ):
            survived = torch.nonzero(reached).reshape(-1)  # positions once: a bool mask indexes at twice the cost
            # the survivors' finiteness is told by this rank's whole set: when the payload vouches for the tensor
            # (the k largest magnitudes), so does that set (a cut to k keeps the largest too), and error feedback
            # need not sum the tensor again
            sent = SparseEntries(
                mine.indices.index_select(0, survived),
                mine.values.index_select(0, survived),
                unit.numel,
                vouches_finite=vouches,
                finite_of=mine.values if vouches else None,
            )
            results.append(
                Aggregate(partial(_scatter_mean, c, entries, world), partial(finiteness, entries.values), partial=sent)
            )
        return results
