"""Sparse payloads, (indices, values) pairs, shared by every selection compressor."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate
from typing import ClassVar

import torch
from torch import Tensor

from lightning_gradcomp.core.compressors.base import Compressor, Entries, Payload, subtract_by_adding
from lightning_gradcomp.core.compressors.finiteness import Finite, finiteness
from lightning_gradcomp.core.compressors.indices import (
    decode_indices,
    edges_if_ascending,
    encode_indices,
    encoded_nbytes,
    is_ascending,
    narrowed,
)
from lightning_gradcomp.core.compressors.segments import Segments
from lightning_gradcomp.core.compressors.wire import ByteReader, to_bytes
from lightning_gradcomp.core.host_copies import device_tensor
from lightning_gradcomp.core.host_waits import reads_wait

#: The count that starts a sparse payload's wire form (int64: a unit of any size).
COUNT_DTYPE = torch.int64
#: The largest fraction of a tensor's entries (all ranks' together) that a sparse mean divides one by one instead of
#: dividing the whole tensor: on one CPU thread, for 25.2M entries in the 6 pieces of an MLP and 2 ranks, 17.7 ms
#: against 22.8 at 0.8%, 31.1 against 26.4 at 2% (``benchmarks/sparse_mean.py``).
SPARSE_DIVISION = 1 / 80


def sparse_nbytes(numel: int, k: int, float_itemsize: int, slots: int | None = None) -> int:
    """Wire size of a :class:`SparsePayload` of ``k`` entries of ``numel`` (with ``slots``, of any count up to it)."""
    return 8 + encoded_nbytes(numel, k, slots) + (k if slots is None else slots) * float_itemsize


def is_power_of_two(n: int) -> bool:
    """Whether ``n`` is 1, 2, 4, 8, ...: a world size whose ``1 / n`` is exact in binary floating point."""
    return n > 0 and n & (n - 1) == 0


def itemsize(dtype: torch.dtype) -> int:
    """Bytes per element of ``dtype``."""
    return torch.empty(0, dtype=dtype).element_size()


@dataclass(frozen=True)
class SparsePayload(Payload):
    """``k`` entries of a tensor of ``shape`` (flat indices); absent entries are zero.

    Wire form: the count ``k`` as int64, the indices as a sorted set in the fewest bytes their count
    allows (:mod:`~lightning_gradcomp.core.compressors.indices`: Elias-Fano, about ``2 + log2(d / k)``
    bits each, or a bitmap), then the values in ascending index order, in the gradient's dtype (or a
    wire precision's): ``8 + encoded_nbytes(d, k) + k * itemsize`` bytes, a function of ``d`` and ``k``
    alone. With ``slots`` (a compressor whose count varies up to a known bound, Gaussian_k), the wire
    form has a fixed size instead: the indices in the format of ``slots`` indices, then ``slots``
    values, zero-padded, so that an allgather needs no exchange of sizes (one collective instead of
    two, as gTop-k's fixed sets). The indices are held as
    :func:`~lightning_gradcomp.core.compressors.indices.position_dtype` of ``d`` (int32 up to ``2^31`` elements),
    whatever dtype they are given in.
    """

    indices: Tensor
    values: Tensor
    shape: torch.Size
    slots: int | None = None
    #: the entries are the ``k`` of largest magnitude, a NaN ranked above everything (Top-k's): some value is not
    #: finite whenever the tensor had such an element, so their finiteness is the tensor's (error feedback need not
    #: read the tensor again to learn it)
    largest: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "indices", narrowed(self.indices, self.numel))

    @property
    def dtype(self) -> torch.dtype:
        return self.values.dtype

    @property
    def device(self) -> torch.device:
        return self.values.device

    @property
    def k(self) -> int:
        """Number of entries carried."""
        return self.values.numel()

    @property
    def selected(self) -> int:
        return self.k

    @property
    def nbytes(self) -> int:
        return self.wire_nbytes(self.values.element_size())

    def wire_nbytes(self, float_itemsize: int) -> int:
        return sparse_nbytes(self.numel, self.k, float_itemsize, self.slots)

    def cast(self, dtype: torch.dtype) -> SparsePayload:
        return SparsePayload(self.indices, self.values.to(dtype), self.shape, self.slots, self.largest)

    def entries(self) -> SparseEntries:
        return SparseEntries(self.indices, self.values, self.numel, self.largest)

    def to_bytes(self) -> Tensor:
        if self.slots is not None and self.k > self.slots:
            raise ValueError(f"{self.k} entries do not fit in {self.slots} slots")
        indices, values = self.indices.reshape(-1), self.values.reshape(-1)
        # Top-k sends them in order already; off the CPU, a sort of sorted indices costs less than waiting for the check
        if reads_wait(indices.device) or not is_ascending(indices):
            indices, order = torch.sort(indices)
            values = values[order]
        count = torch.full((1,), self.k, dtype=COUNT_DTYPE, device=self.values.device)  # filled there: no copy
        encoded = encode_indices(indices, self.numel, self.slots)
        padding = 0 if self.slots is None else self.slots - self.k
        return to_bytes([count, encoded, zero_padded(values, padding)])

    @classmethod
    def from_bytes(
        cls, buffer: Tensor, shape: torch.Size, dtype: torch.dtype, slots: int | None = None, k: int | None = None
    ) -> SparsePayload:
        """Parse the wire form; its header gives the count, unless the caller knows it (``k``: a compressor of
        fixed count, which then reads nothing back from the device before decoding)."""
        numel = shape.numel()
        reader = ByteReader(buffer)
        header = reader.take(1, COUNT_DTYPE) if buffer.numel() >= 8 else None
        if k is None:
            k = int(header) if header is not None else -1
        if k < 0 or (slots is not None and k > slots) or (slots is None and k > numel):
            raise ValueError(f"sparse payload of {buffer.numel()} bytes claims {k} entries")
        expected = sparse_nbytes(numel, k, itemsize(dtype), slots)
        if buffer.numel() != expected:
            raise ValueError(f"sparse payload of {buffer.numel()} bytes, expected {expected} for {k} entries")
        indices = decode_indices(reader.take(encoded_nbytes(numel, k, slots), torch.uint8), numel, k, slots)
        values = reader.take(k if slots is None else slots, dtype)[:k]
        return cls(indices, values, shape, slots)

    def accumulate(self, out: Tensor, alpha: float = 1.0) -> Tensor:
        """Add the entries, times ``alpha``, into the flat dense tensor ``out`` (in place)."""
        return out.index_add_(0, self.indices, self.values, alpha=alpha)


def zero_padded(t: Tensor, extra: int) -> Tensor:
    """``t`` (1-D) followed by ``extra`` zeros."""
    return torch.cat([t, t.new_zeros(extra)]) if extra else t


@dataclass(frozen=True)
class SparseEntries:
    """Some entries of a flat tensor of ``numel`` elements (unique ``indices``, any order); the rest are zero.

    How the aggregators report what of a sparse payload reached the result, so that error
    feedback subtracts ``k`` entries instead of a dense tensor (one scatter instead of a
    zero-fill, a scatter and a full subtraction).
    """

    indices: Tensor
    values: Tensor
    numel: int
    #: whether :meth:`all_finite` also tells whether the whole tensor compressed was finite (the ``k`` largest
    #: magnitudes, :attr:`SparsePayload.largest`); a sampled selection may leave a NaN out: error feedback reads the
    #: tensor itself then
    vouches_finite: bool = False
    #: the values whose finiteness :meth:`all_finite` reports: the whole selection's, for a slice of a vouching one
    #: (one parameter of a unit: a non-finite element of another parameter may have taken the place of its own)
    finite_of: Tensor | None = None

    def to_dense(self) -> Tensor:
        """The dense flat tensor."""
        dense = torch.zeros(self.numel, dtype=self.values.dtype, device=self.values.device)
        return dense.index_put_((self.indices,), self.values)

    def add_to_(self, out: Tensor, alpha: float = 1.0) -> Tensor:
        """``out += alpha * self`` in place, one scatter (``alpha=-1`` is exact: an entry equal to the
        subtracted value becomes exactly 0)."""
        return out.index_add_(0, self.indices, self.values, alpha=alpha)

    def subtract_from(self, compensated: Tensor, out: Tensor) -> Tensor:
        return subtract_by_adding(self, compensated, out)

    def all_finite(self) -> Finite:
        """Whether every entry is finite (the zeros between them are); for a slice of a vouching selection, whether
        every entry of the whole selection is."""
        return finiteness(self.values if self.finite_of is None else self.finite_of)

    def split(self, numels: Sequence[int]) -> list[SparseEntries]:
        """The entries of each consecutive slice of ``numels`` elements, with indices local to the slice."""
        if len(numels) == 1:
            return [self]
        starts = [0, *accumulate(numels)]
        vouches = self.vouches_finite
        whole = (self.values if self.finite_of is None else self.finite_of) if vouches else None
        # each slice's entries are one run where the indices ascend: cut by binary search (one read-back for both)
        edges = edges_if_ascending(self.indices, device_tensor(starts, self.indices.dtype, self.indices.device))
        if edges is not None:
            return [
                SparseEntries(
                    self.indices[lo:hi] - start if start else self.indices[lo:hi], self.values[lo:hi], n, vouches, whole
                )
                for start, n, lo, hi in zip(starts[:-1], numels, edges[:-1], edges[1:], strict=True)
            ]
        parts = []
        for start, n in zip(starts[:-1], numels, strict=True):
            inside = (self.indices >= start) & (self.indices < start + n)
            parts.append(SparseEntries(self.indices[inside] - start, self.values[inside], n, vouches, whole))
        return parts


def dense_of(entries: Tensor | Entries) -> Tensor:
    """The dense flat tensor of ``entries``, whether they are kept encoded or already dense."""
    return entries if isinstance(entries, Tensor) else entries.to_dense()


def k_for(numel: int, density: float) -> int:
    """Entries to keep: ``max(1, int(density * numel))`` (the authors' rule), never above ``numel``."""
    if numel == 0:
        return 0
    return min(numel, max(1, int(density * numel)))


class FixedKSparsifier(Compressor):
    """The wire side of a compressor that sends exactly ``k_for(d, density)`` entries as a :class:`SparsePayload`
    (Top-k, random-k): a payload's size follows from the tensor's, so the allgather needs no size exchange."""

    sparse = True
    float_wire = True
    density: float
    #: whether every payload carries exactly ``k_for(d, density)`` entries (Gaussian_k's count varies below it)
    exact_count: ClassVar[bool] = True

    def unpack(self, buffer: Tensor, shape: torch.Size, dtype: torch.dtype) -> SparsePayload:
        # the count is k unless a subclass sends a count that varies (and declares no fixed size): then the header's
        fixed = self.payload_nbytes(shape, dtype) is not None
        return SparsePayload.from_bytes(buffer, shape, dtype, k=k_for(shape.numel(), self.density) if fixed else None)

    def accumulate(self, payload: Payload, out: Tensor) -> Tensor:
        assert isinstance(payload, SparsePayload)
        return payload.accumulate(out)

    def average_all(self, payloads: Sequence[Payload], out: Tensor | Segments, world: int) -> Tensor | Segments:
        """The mean written over ``out``: over a power-of-two number of ranks, :meth:`average_scaled` (no division);
        else :meth:`average_where_landed` while the entries of all ranks together are at most
        :data:`SPARSE_DIVISION` of the tensor (past it, a read and a write at each entry cost more than a streamed
        division), else the whole tensor divided."""
        sparse = all(isinstance(p, SparsePayload) for p in payloads)
        if sparse and is_power_of_two(world):
            return self.average_scaled(payloads, out, world)  # type: ignore[arg-type]
        landed = sum(p.indices.numel() for p in payloads) if sparse else None  # type: ignore[attr-defined]
        if landed is None or landed > SPARSE_DIVISION * out.numel():
            return super().average_all(payloads, out, world)
        return self.average_where_landed(payloads, out, world)  # type: ignore[arg-type]

    @staticmethod
    def average_scaled(payloads: Sequence[SparsePayload], out: Tensor | Segments, world: int) -> Tensor | Segments:
        """``out`` zeroed and every rank's entries added in rank order times ``1 / world``, a power of two: one dense
        pass (the zeroing) and no division. Scaling by a power of two commutes with every rounding of the sum, so
        the mean is bit for bit the sum divided by ``world``, but where a value or a partial sum lies among the
        subnormals or the sum alone overflows."""
        out.zero_()
        for payload in payloads:
            payload.accumulate(out, alpha=1.0 / world)
        return out

    def average_where_landed(
        self, payloads: Sequence[SparsePayload], out: Tensor | Segments, world: int
    ) -> Tensor | Segments:
        """``out`` zeroed, every rank's entries added in rank order, then divided by ``world`` only where entries
        landed (elsewhere ``0 / P`` is 0): the streamed division's values, with one dense pass (the zeroing) instead
        of two. An index several ranks sent is written several times, with the same value. ``out`` may be pieces of
        DDP's buckets (:class:`~lightning_gradcomp.core.compressors.segments.Segments`), each rank's entries routed to
        them apart (sorted, as they arrive: a binary search per piece)."""
        total = self.accumulate_all(payloads, out.zero_())
        if isinstance(total, Segments):
            means = [total.gather(p.indices).div_(world) for p in payloads]
            for p, mean in zip(payloads, means, strict=True):  # every mean read before any is written
                total.index_put_((p.indices,), mean)
            return total
        landed = torch.cat([p.indices for p in payloads])
        return total.index_put_((landed,), total.index_select(0, landed).div_(world))  # int32 indices too

    def payload_nbytes(self, shape: torch.Size, dtype: torch.dtype) -> int:
        return sparse_nbytes(shape.numel(), k_for(shape.numel(), self.density), itemsize(dtype))
