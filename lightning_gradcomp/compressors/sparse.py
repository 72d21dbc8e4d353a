"""Sparse payloads, (indices, values) pairs, shared by every selection compressor."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_gradcomp.compressors.base import Compressor, Entries, Payload, all_finite
from lightning_gradcomp.compressors.wire import ByteReader, to_bytes

_INT32_LIMIT = 2**31 - 1


def index_dtype(numel: int) -> torch.dtype:
    """Narrowest index type that addresses ``numel`` elements: int32 up to 2**31 - 1, else int64."""
    return torch.int32 if numel <= _INT32_LIMIT else torch.int64


def itemsize(dtype: torch.dtype) -> int:
    """Bytes per element of ``dtype``."""
    return torch.empty(0, dtype=dtype).element_size()


@dataclass(frozen=True)
class SparsePayload(Payload):
    """``k`` entries of a tensor of ``shape`` (flat indices); absent entries are zero.

    Wire form: the indices (int32 below 2**31 elements, else int64), then the values in the
    gradient's dtype: ``k * (4 + itemsize)`` bytes for the usual case. With ``slots`` (a compressor
    whose count varies up to a known bound, Gaussian_k), the wire form has a fixed size instead: the
    count as int32, then ``slots`` indices and ``slots`` values, zero-padded, so that an allgather
    needs no exchange of sizes (one collective instead of two, as gTop-k's fixed sets).
    """

    indices: Tensor
    values: Tensor
    shape: torch.Size
    slots: int | None = None

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
        per_entry = itemsize(index_dtype(self.numel)) + float_itemsize
        return self.k * per_entry if self.slots is None else 4 + self.slots * per_entry

    def cast(self, dtype: torch.dtype) -> SparsePayload:
        return SparsePayload(self.indices, self.values.to(dtype), self.shape, self.slots)

    def entries(self) -> SparseEntries:
        return SparseEntries(self.indices, self.values, self.numel)

    def to_bytes(self) -> Tensor:
        indices = self.indices.to(index_dtype(self.numel))
        if self.slots is None:
            return to_bytes([indices, self.values])
        if self.k > self.slots:
            raise ValueError(f"{self.k} entries do not fit in {self.slots} slots")
        pad = self.slots - self.k
        count = torch.tensor([self.k], dtype=torch.int32, device=self.values.device)
        return to_bytes([count, zero_padded(indices, pad), zero_padded(self.values, pad)])

    @classmethod
    def from_bytes(
        cls, buffer: Tensor, shape: torch.Size, dtype: torch.dtype, slots: int | None = None
    ) -> SparsePayload:
        """Parse the wire form; the entry count follows from the buffer's length, or from its header with ``slots``."""
        numel = shape.numel()
        per_entry = itemsize(index_dtype(numel)) + itemsize(dtype)
        if slots is not None:
            if buffer.numel() != 4 + slots * per_entry:
                raise ValueError(f"sparse payload of {buffer.numel()} bytes, expected {4 + slots * per_entry}")
            reader = ByteReader(buffer)
            k = int(reader.take(1, torch.int32))
            if not 0 <= k <= slots:
                raise ValueError(f"sparse payload claims {k} entries in {slots} slots")
            indices = reader.take(slots, index_dtype(numel))[:k].long()
            return cls(indices, reader.take(slots, dtype)[:k], shape, slots)
        if buffer.numel() % per_entry:
            raise ValueError(
                f"sparse payload of {buffer.numel()} bytes is not a whole number of {per_entry}-byte entries"
            )
        k = buffer.numel() // per_entry
        reader = ByteReader(buffer)
        indices = reader.take(k, index_dtype(numel)).long()
        values = reader.take(k, dtype)
        return cls(indices, values, shape)

    def accumulate(self, out: Tensor) -> Tensor:
        """Add the entries into the flat dense tensor ``out`` (in place)."""
        return out.index_add_(0, self.indices, self.values)


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

    def to_dense(self) -> Tensor:
        """The dense flat tensor."""
        dense = torch.zeros(self.numel, dtype=self.values.dtype, device=self.values.device)
        return dense.index_put_((self.indices,), self.values)

    def add_to_(self, out: Tensor, alpha: float = 1.0) -> Tensor:
        """``out += alpha * self`` in place, one scatter (``alpha=-1`` is exact: an entry equal to the
        subtracted value becomes exactly 0)."""
        return out.index_add_(0, self.indices, self.values, alpha=alpha)

    def all_finite(self) -> bool:
        """Whether every entry is finite (the zeros between them are)."""
        return all_finite(self.values)

    def split(self, numels: Sequence[int]) -> list[SparseEntries]:
        """The entries of each consecutive slice of ``numels`` elements, with indices local to the slice."""
        if len(numels) == 1:
            return [self]
        parts, start = [], 0
        for n in numels:
            inside = (self.indices >= start) & (self.indices < start + n)
            parts.append(SparseEntries(self.indices[inside] - start, self.values[inside], n))
            start += n
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

    def unpack(self, buffer: Tensor, shape: torch.Size, dtype: torch.dtype) -> SparsePayload:
        return SparsePayload.from_bytes(buffer, shape, dtype)

    def accumulate(self, payload: Payload, out: Tensor) -> Tensor:
        assert isinstance(payload, SparsePayload)
        return payload.accumulate(out)

    def payload_nbytes(self, shape: torch.Size, dtype: torch.dtype) -> int:
        numel = shape.numel()
        return k_for(numel, self.density) * (itemsize(index_dtype(numel)) + itemsize(dtype))
