"""Sparse payloads whose values travel in 2 bits: a sign and one of two magnitudes per block of entries.

SparseLoCo (Sarfi et al., 2025, arXiv 2508.15706, Sec. 3) sends the Top-k entries of its error-feedback buffer
with their values quantised to 2 bits; what the rounding drops stays in the buffer and goes later. Here the
selected entries, in ascending index order, are cut into blocks of ``block_size``; in each block the magnitudes
are split at their mean and each side is sent as its own mean: the 2-level quantiser of least squared error for
that split (one step of Lloyd's algorithm from the mean). An entry decodes as ``sign * level``. Two float32
levels per block of 256 entries add a quarter of a bit per entry.

Wire form (a function of the tensor's size and the density alone, so an allgather needs no exchange of sizes):
the indices as :class:`~lightning_gradcomp.core.compressors.SparsePayload` encodes them (Elias-Fano or a bitmap, no
count: ``k`` follows from the density), the codes sixteen to a 32-bit word, then the levels.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch
from torch import Tensor

from lightning_gradcomp.core.compressors.base import Compressor, Payload
from lightning_gradcomp.core.compressors.draws import Draws
from lightning_gradcomp.core.compressors.indices import decode_indices, encode_indices, encoded_nbytes, is_ascending
from lightning_gradcomp.core.compressors.sparse import FixedKSparsifier, SparseEntries, SparsePayload, k_for
from lightning_gradcomp.core.compressors.ternary import pack_2bit, packed_nbytes, unpack_2bit
from lightning_gradcomp.core.compressors.wire import ByteReader, to_bytes
from lightning_gradcomp.core.validation import check_int

__all__ = ["DEFAULT_LEVEL_BLOCK", "TwoBitPayload", "TwoBitValues"]

#: Selected entries that share one pair of levels.
DEFAULT_LEVEL_BLOCK = 256


def twobit_nbytes(numel: int, k: int, block_size: int) -> int:
    """Wire size of :class:`TwoBitPayload`: indices, ``4 ceil(k / 16)`` bytes of codes, two float32 per block."""
    return encoded_nbytes(numel, k) + packed_nbytes(k) + 8 * math.ceil(k / block_size)


def _levels(magnitudes: Tensor, block_size: int) -> tuple[Tensor, Tensor]:
    """``(levels, upper)``: each block's low and high level (``[blocks, 2]``, float32) and whether each entry takes
    the high one (at or above its block's mean magnitude)."""
    k = magnitudes.numel()
    blocks = math.ceil(k / block_size)
    padded = torch.zeros(blocks * block_size, dtype=torch.float32, device=magnitudes.device)
    padded[:k] = magnitudes
    padded = padded.view(blocks, block_size)
    valid = (torch.arange(blocks * block_size, device=magnitudes.device) < k).view(blocks, block_size)
    counts = valid.sum(1).clamp_(min=1)
    mean = padded.sum(1) / counts
    upper = (padded >= mean[:, None]) & valid
    lower = valid & ~upper
    high_n, low_n = upper.sum(1), lower.sum(1)
    high = torch.where(high_n > 0, (padded * upper).sum(1) / high_n.clamp(min=1), mean)
    low = torch.where(low_n > 0, (padded * lower).sum(1) / low_n.clamp(min=1), mean)
    return torch.stack([low, high], 1), upper.reshape(-1)[:k]


def _decode(codes: Tensor, levels: Tensor, block_size: int, dtype: torch.dtype) -> Tensor:
    """The values of codes in ``{0, 1, 2, 3}`` (int8): bit 0 picks the block's level, bit 1 the sign."""
    k = codes.numel()
    block = torch.arange(k, device=codes.device) // block_size
    magnitude = levels.view(-1, 2)[block, (codes & 1).long()]
    return torch.where(codes >= 2, -magnitude, magnitude).to(dtype)


@dataclass(frozen=True)
class TwoBitPayload(Payload):
    """``k`` entries of a tensor of ``shape`` (ascending flat ``indices``), each value a 2-bit code: its sign and
    which of its block's two ``levels`` it takes."""

    indices: Tensor
    codes: Tensor
    levels: Tensor
    shape: torch.Size
    dtype: torch.dtype
    block_size: int

    @property
    def device(self) -> torch.device:
        return self.indices.device

    @property
    def k(self) -> int:
        return self.indices.numel()

    @property
    def selected(self) -> int:
        return self.k

    @property
    def nbytes(self) -> int:
        return twobit_nbytes(self.numel, self.k, self.block_size)

    def values(self) -> Tensor:
        """The decoded values, in index order and the tensor's dtype (decoded once: the aggregator reads them for the
        finiteness check, the memory and the sum)."""
        return self._decoded

    @cached_property
    def _decoded(self) -> Tensor:
        return _decode(self.codes, self.levels, self.block_size, self.dtype)

    def entries(self) -> SparseEntries:
        return SparseEntries(self.indices, self.values(), self.numel)

    def to_bytes(self) -> Tensor:
        return to_bytes([encode_indices(self.indices, self.numel), pack_2bit(self.codes - 1), self.levels])


class TwoBitValues(Compressor):
    """A fixed-count sparsifier (``topk``, ``randomk``) whose values travel in 2 bits (SparseLoCo's wire).

    Biased (it rounds every value to one of two magnitudes per block): pair it with error feedback, which sends the
    rounding later.

    Args:
        inner: the sparsifier choosing the entries.
        block_size: selected entries sharing one pair of levels (integer >= 1).
    """

    unbiased = False
    gatherable = True

    def __init__(self, inner: Compressor, block_size: int = DEFAULT_LEVEL_BLOCK) -> None:
        if not isinstance(inner, FixedKSparsifier) or not inner.exact_count:
            raise ValueError(
                f"wire_precision='2bit' quantises the values of a sparsifier of fixed count (topk, randomk), and "
                f"{inner!r} is none"
            )
        self.inner = inner
        self.block_size = check_int("block_size", block_size, 1)

    @property
    def name(self) -> str:  # type: ignore[override]
        return self.inner.name

    @property
    def density(self) -> float:
        return self.inner.density

    @density.setter
    def density(self, value: float) -> None:
        self.inner.density = value

    @property
    def bias_reason(self) -> str:
        return f"{self.inner.bias_reason}, and it rounds each value to one of two magnitudes per block"

    @property
    def selects_entries(self) -> bool:
        return True

    def preferred_aggregator(self, world_size: int) -> str:
        return "allgather"

    def compress(self, x: Tensor, generator: Draws = None, **kwargs: Any) -> TwoBitPayload:
        sparse = self.inner.compress(x, generator, **kwargs)
        assert isinstance(sparse, SparsePayload)
        indices, values = sparse.indices.reshape(-1).long(), sparse.values.reshape(-1)
        if not is_ascending(indices):
            indices, order = torch.sort(indices)
            values = values[order]
        levels, upper = _levels(values.abs().float(), self.block_size)
        codes = upper.to(torch.int8) + 2 * (values < 0).to(torch.int8)
        return TwoBitPayload(indices, codes, levels.reshape(-1), x.shape, x.dtype, self.block_size)

    def unpack(self, buffer: Tensor, shape: torch.Size, dtype: torch.dtype) -> TwoBitPayload:
        numel = shape.numel()
        k = k_for(numel, self.inner.density)
        expected = twobit_nbytes(numel, k, self.block_size)
        if buffer.numel() != expected:
            raise ValueError(f"2-bit sparse payload of {buffer.numel()} bytes, expected {expected} for {k} entries")
        reader = ByteReader(buffer)
        indices = decode_indices(reader.take(encoded_nbytes(numel, k), torch.uint8), numel, k)
        codes = unpack_2bit(reader.take(packed_nbytes(k), torch.uint8), k).add_(1)
        levels = reader.take(2 * math.ceil(k / self.block_size), torch.float32)
        return TwoBitPayload(indices, codes, levels, shape, dtype, self.block_size)

    def accumulate(self, payload: Payload, out: Tensor) -> Tensor:
        assert isinstance(payload, TwoBitPayload)
        return out.index_add_(0, payload.indices, payload.values())

    def payload_nbytes(self, shape: torch.Size, dtype: torch.dtype) -> int:
        return twobit_nbytes(shape.numel(), k_for(shape.numel(), self.inner.density), self.block_size)

    def __repr__(self) -> str:
        return f"TwoBitValues({self.inner!r}, block_size={self.block_size})"
