"""SparseLoCo's reference selection and wire: Top-k per chunk, chunk-local indices in 12 bits, values in 2 bits.

SparseLoCo (Sarfi et al., 2025, arXiv 2508.15706, Sec. 3) as its reference configuration runs it (Templar's
``compress/topk.py``, September 2025):

* **chunks**: a tensor of two or more dimensions is read as a matrix ``R x C`` (``C`` the product of the trailing
  dimensions) and cut into chunks of ``r x c``, ``r`` the largest divisor of ``R`` not above ``chunk`` (64) and ``c``
  likewise of ``C``; a 1-D tensor of ``n`` elements into runs of the largest divisor of ``n`` not above
  ``flat_chunk`` (4096). A dimension with no divisor near ``chunk`` (a prime one) gets thin chunks: the reference's
  rule, kept as it is.
* **selection**: in every chunk, the ``per_chunk`` (64) entries of largest magnitude: 1.56% of a 64 x 64 chunk.
* **indices**: each entry's position inside its chunk, ``ceil(log2(r c))`` bits (12 for 4096-element chunks), in
  chunk order; the receiver knows the chunks from the shape.
* **values**: with ``quantization_bins=4``, 2 bits each. The selected values' mean ``mu`` and standard deviation
  ``sigma`` (over the whole tensor's selection) set ``bins`` bins of width ``quantization_range * sigma / bins``
  centred on ``mu`` (6 sigma in all); each value takes the nearest bin centre's code, clamped to the outer bins, and
  decodes as the mean of the values that took that code, sent as a table of ``bins`` float32 numbers. With
  ``quantization_bins=None`` the values travel in the tensor's dtype.

A payload's size follows from the shape alone (a fixed count per chunk), so gathering needs no exchange of sizes.
Deviations from the reference code, both for the reader of this module: the count per chunk is ``per_chunk`` clamped
to the chunk's size (the reference also rounds it to an even number and to at least 2), and the reference's 1-D
tensors use the same chunk target as matrices (64), where this compressor takes ``flat_chunk``. Biased (Top-k and
rounding): pair it with error feedback, which SparseLoCo's decayed buffer is.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch
from torch import Tensor

from lightning_gradcomp.core.compressors.base import Compressor, Payload
from lightning_gradcomp.core.compressors.draws import Draws
from lightning_gradcomp.core.compressors.indices import pack_bits, unpack_bits
from lightning_gradcomp.core.compressors.sparse import SparseEntries, itemsize
from lightning_gradcomp.core.compressors.wire import ByteReader, to_bytes
from lightning_gradcomp.core.validation import check_int, check_number

__all__ = ["ChunkGeometry", "ChunkedPayload", "ChunkedTopKCompressor", "bin_values", "largest_divisor_up_to"]

#: The reference configuration: 64 entries of every 64 x 64 chunk, 1-D tensors in runs of 4096, 4 bins over 6 sigma.
CHUNK, FLAT_CHUNK, PER_CHUNK, BINS, QUANTIZATION_RANGE = 64, 4096, 64, 4, 6.0


def largest_divisor_up_to(n: int, limit: int) -> int:
    """The largest divisor of ``n`` not above ``limit`` (``n`` itself when ``n <= limit``)."""
    if n <= limit:
        return n
    return next(d for d in range(limit, 0, -1) if n % d == 0)


@dataclass(frozen=True)
class ChunkGeometry:
    """How a tensor of ``shape`` is cut: ``grid`` chunks (row-major over ``rows x cols`` of them for a matrix) of
    ``r x c`` elements (``r = 1`` for a 1-D run), ``k`` kept in each, indices of ``index_bits`` bits."""

    shape: torch.Size
    r: int
    c: int
    chunk_cols: int
    chunks: int
    k: int

    @classmethod
    def of(cls, shape: torch.Size, chunk: int, flat_chunk: int, per_chunk: int) -> ChunkGeometry:
        numel = shape.numel()
        if numel == 0:
            return cls(shape, 1, 1, 1, 0, 0)
        if len(shape) >= 2:
            rows, cols = shape[0], numel // shape[0]
            r, c = largest_divisor_up_to(rows, chunk), largest_divisor_up_to(cols, chunk)
        else:
            rows, cols = 1, numel
            r, c = 1, largest_divisor_up_to(numel, flat_chunk)
        chunk_cols = cols // c
        return cls(shape, r, c, chunk_cols, (rows // r) * chunk_cols, min(per_chunk, r * c))

    @property
    def selected(self) -> int:
        """Entries kept in the whole tensor."""
        return self.chunks * self.k

    @property
    def index_bits(self) -> int:
        """Bits of a chunk-local index."""
        return max(1, (self.r * self.c - 1).bit_length())

    @property
    def cols(self) -> int:
        return self.chunk_cols * self.c

    def chunked(self, x: Tensor) -> Tensor:
        """``x`` as ``[chunks, r * c]``, each row one chunk's elements in row-major order."""
        rows = self.chunks // self.chunk_cols * self.r
        return x.reshape(rows // self.r, self.r, self.chunk_cols, self.c).permute(0, 2, 1, 3).reshape(self.chunks, -1)

    def flat_indices(self, local: Tensor) -> Tensor:
        """Flat indices into the tensor of ``[chunks, k]`` chunk-local ones."""
        chunk = torch.arange(self.chunks, device=local.device).unsqueeze(1)
        row = (chunk // self.chunk_cols) * self.r + local // self.c
        col = (chunk % self.chunk_cols) * self.c + local % self.c
        return (row * self.cols + col).reshape(-1)


def bin_values(values: Tensor, bins: int, quantization_range: float) -> tuple[Tensor, Tensor]:
    """``(codes, table)``: each value's bin (uint8, ``0..bins-1``) and each bin's decoded value (float32: the mean of
    its values; the overall mean for an empty bin). Bins of width ``quantization_range * sigma / bins`` centred on the
    mean ``mu``: the code is ``round((v - mu) / width) + bins // 2``, clamped to the outer bins."""
    v = values.float()
    n = v.numel()
    table = torch.zeros(bins, dtype=torch.float32, device=v.device)
    if n == 0:
        return torch.zeros(0, dtype=torch.uint8, device=v.device), table
    shift = v.mean()
    centred = v - shift
    std = centred.norm() / (n - 1) ** 0.5 if n > 1 else torch.zeros((), device=v.device)
    width = quantization_range * std / bins
    width = torch.where(torch.isfinite(width) & (width > 0), width, torch.ones_like(width))
    codes = (centred / width + bins // 2).round().clamp_(0, bins - 1).to(torch.uint8)
    sums = table.index_add(0, codes.long(), centred)
    counts = torch.zeros(bins, dtype=torch.float32, device=v.device).index_add_(0, codes.long(), torch.ones_like(v))
    table = shift + torch.where(counts > 0, sums / counts.clamp(min=1), torch.zeros_like(sums))
    return codes, table


@dataclass(frozen=True)
class ChunkedPayload(Payload):
    """The kept entries of a tensor of ``shape``: ``local`` (``[chunks, k]`` chunk-local indices, ascending in each
    chunk), and either ``codes`` with their ``table`` (2-bit values) or the ``raw`` values."""

    geometry: ChunkGeometry
    local: Tensor
    dtype: torch.dtype
    codes: Tensor | None = None
    table: Tensor | None = None
    raw: Tensor | None = None

    @property
    def shape(self) -> torch.Size:  # type: ignore[override]
        return self.geometry.shape

    @property
    def device(self) -> torch.device:
        return self.local.device

    @property
    def selected(self) -> int:
        return self.geometry.selected

    @property
    def nbytes(self) -> int:
        bins = None if self.table is None else self.table.numel()
        return chunked_nbytes(self.geometry, bins, itemsize(self.dtype))

    @cached_property
    def indices(self) -> Tensor:
        """The flat indices, in chunk order."""
        return self.geometry.flat_indices(self.local)

    @cached_property
    def values(self) -> Tensor:
        """The decoded values, in the tensor's dtype (decoded once: the finiteness check, the memory and the sum
        read them)."""
        if self.raw is not None:
            return self.raw
        assert self.codes is not None and self.table is not None
        return self.table[self.codes.long()].to(self.dtype)

    def entries(self) -> SparseEntries:
        return SparseEntries(self.indices, self.values, self.numel)

    def to_bytes(self) -> Tensor:
        g = self.geometry
        parts = [pack_bits(self.local.reshape(-1), g.index_bits, _bytes(g.selected * g.index_bits))]
        if self.raw is not None:
            parts.append(self.raw)
        else:
            assert self.codes is not None and self.table is not None
            width = _code_bits(self.table.numel())
            parts += [pack_bits(self.codes.long(), width, _bytes(g.selected * width)), self.table]
        return to_bytes(parts)


def _bytes(bits: int) -> int:
    return (bits + 7) // 8


def _code_bits(bins: int) -> int:
    return max(1, (bins - 1).bit_length())


def chunked_nbytes(geometry: ChunkGeometry, bins: int | None, float_itemsize: int) -> int:
    """Wire size of a :class:`ChunkedPayload`: the indices, then the codes and the bins' table (or the raw values)."""
    k = geometry.selected
    indices = _bytes(k * geometry.index_bits)
    if bins is None:
        return indices + k * float_itemsize
    return indices + _bytes(k * _code_bits(bins)) + 4 * bins


class ChunkedTopKCompressor(Compressor):
    """Top-k per chunk with SparseLoCo's 2-bit values and 12-bit chunk-local indices (see the module's docstring).

    Args:
        per_chunk: entries kept in every chunk (clamped to its size); 64 of a 64 x 64 chunk is 1.56%.
        chunk: the side of a matrix's chunks (largest divisors not above it).
        flat_chunk: the length of a 1-D tensor's runs (largest divisor not above it).
        quantization_bins: bins of the values (a power of two from 2 to 256: ``log2(bins)`` bits each), or ``None``
            to send them in the tensor's dtype.
        quantization_range: the bins' span in standard deviations of the selected values, centred on their mean.
    """

    name = "chunked_topk"
    unbiased = False
    needs_layer_shape = True
    selects_entries = True

    def __init__(
        self,
        per_chunk: int = PER_CHUNK,
        chunk: int = CHUNK,
        flat_chunk: int = FLAT_CHUNK,
        quantization_bins: int | None = BINS,
        quantization_range: float = QUANTIZATION_RANGE,
    ) -> None:
        self.per_chunk = check_int("per_chunk", per_chunk, 1)
        self.chunk = check_int("chunk", chunk, 1)
        self.flat_chunk = check_int("flat_chunk", flat_chunk, 1)
        if quantization_bins is not None:
            check_int("quantization_bins", quantization_bins, 2, 256)
            if quantization_bins & (quantization_bins - 1):
                raise ValueError(
                    f"quantization_bins must be a power of two from 2 to 256 or None, got {quantization_bins}"
                )
        self.quantization_bins = quantization_bins
        self.quantization_range = check_number("quantization_range", quantization_range, 0, open_min=True)

    @property
    def bias_reason(self) -> str:
        rounded = (
            "" if self.quantization_bins is None else f", and rounds each value to one of {self.quantization_bins}"
        )
        return f"it keeps the {self.per_chunk} entries of largest magnitude of each chunk{rounded}"

    def geometry(self, shape: torch.Size) -> ChunkGeometry:
        """How a tensor of ``shape`` is cut into chunks."""
        return ChunkGeometry.of(torch.Size(shape), self.chunk, self.flat_chunk, self.per_chunk)

    def preferred_aggregator(self, world_size: int) -> str:
        return "allgather"

    def compress(self, x: Tensor, generator: Draws = None, **kwargs: Any) -> ChunkedPayload:
        """The ``per_chunk`` entries of largest magnitude of each chunk of ``x`` (in its own shape)."""
        g = self.geometry(x.shape)
        if g.chunks == 0:
            empty = torch.zeros(0, 0, dtype=torch.long, device=x.device)
            return ChunkedPayload(g, empty, x.dtype, raw=x.reshape(-1)[:0])
        chunks = g.chunked(x)
        local = chunks.abs().topk(g.k, dim=1, sorted=False).indices.sort(dim=1).values
        values = chunks.gather(1, local).reshape(-1)
        if self.quantization_bins is None:
            return ChunkedPayload(g, local, x.dtype, raw=values)
        codes, table = bin_values(values, self.quantization_bins, self.quantization_range)
        return ChunkedPayload(g, local, x.dtype, codes=codes, table=table)

    def unpack(self, buffer: Tensor, shape: torch.Size, dtype: torch.dtype) -> ChunkedPayload:
        g = self.geometry(shape)
        expected = chunked_nbytes(g, self.quantization_bins, itemsize(dtype))
        if buffer.numel() != expected:
            raise ValueError(f"chunked Top-k payload of {buffer.numel()} bytes, expected {expected} for shape {shape}")
        reader = ByteReader(buffer)
        index_bytes = reader.take(_bytes(g.selected * g.index_bits), torch.uint8)
        local = unpack_bits(index_bytes, g.selected, g.index_bits).view(g.chunks, g.k)
        if local.numel() and int(local.max()) >= g.r * g.c:
            raise ValueError(f"a chunk-local index {int(local.max())} is out of range for chunks of {g.r * g.c}")
        if self.quantization_bins is None:
            return ChunkedPayload(g, local, dtype, raw=reader.take(g.selected, dtype))
        width = _code_bits(self.quantization_bins)
        codes = unpack_bits(reader.take(_bytes(g.selected * width), torch.uint8), g.selected, width)
        table = reader.take(self.quantization_bins, torch.float32)
        return ChunkedPayload(g, local, dtype, codes=codes.to(torch.uint8), table=table)

    def accumulate(self, payload: Payload, out: Tensor) -> Tensor:
        assert isinstance(payload, ChunkedPayload)
        return out.index_add_(0, payload.indices, payload.values)

    def payload_nbytes(self, shape: torch.Size, dtype: torch.dtype) -> int:
        return chunked_nbytes(self.geometry(shape), self.quantization_bins, itemsize(dtype))
