"""8-bit wires with a scale per block: int8 codes, or fp8 (e4m3) values, of each block divided by its largest magnitude.

Every block of ``block_size`` consecutive elements (the last one shorter) is divided by its scale, the block's largest
magnitude over the code's largest value (127 for int8, 448 for e4m3), and rounded to the nearest code: int8 to an
integer in ``[-127, 127]``, e4m3 by torch's cast (round to nearest even). A block decodes as its codes times its scale.
The error of an element ``x`` of a block of scale ``s`` is at most ``s / 2`` for int8, and at most
``max(2^-4 |x|, 2^-10 s)`` for e4m3 (three mantissa bits; the subnormals' spacing is ``2^-9 s``): a float32 scale per
block adds ``32 / block_size`` bits per element. torchft quantizes its allreduce the same way with a scale per row,
through Triton, on GPUs only; here the codecs are plain tensor code on any device.

The codecs are *block-aligned*: a payload cut at block boundaries is the payload of each slice, so an average in two
phases (:class:`~lightning_gradcomp.core.comm.two_phase.TwoPhaseAggregator`) sends each rank the slices it owns, which
it sums in float32 and quantizes again before every rank gathers them.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from lightning_gradcomp.core.compressors.base import Compressor, Payload
from lightning_gradcomp.core.compressors.draws import Draws
from lightning_gradcomp.core.compressors.wire import ByteReader, to_bytes
from lightning_gradcomp.core.validation import check_int

__all__ = ["BlockScaledPayload", "BlockScaledQuantizer", "FP8Compressor", "Int8Compressor"]

#: Elements sharing one scale.
DEFAULT_BLOCK = 256


@dataclass(frozen=True)
class BlockScaledPayload(Payload):
    """The codes of a tensor of ``shape`` (``int8``, or ``float8_e4m3fn`` stored as such) and one float32 scale per
    block of ``block_size``."""

    codes: Tensor
    scales: Tensor
    shape: torch.Size
    dtype: torch.dtype
    block_size: int

    @property
    def device(self) -> torch.device:
        return self.codes.device

    @property
    def nbytes(self) -> int:
        return self.codes.numel() + 4 * self.scales.numel()

    def to_bytes(self) -> Tensor:
        return to_bytes([self.codes.view(torch.uint8), self.scales])

    def piece(self, start: int, end: int) -> BlockScaledPayload:
        """The payload of elements ``[start, end)``, ``start`` on a block boundary unless the piece is empty (a flat
        slice)."""
        if start % self.block_size and start != end:
            raise ValueError(f"a piece starts on a block boundary (a multiple of {self.block_size}), not at {start}")
        first = math.ceil(start / self.block_size)  # an empty piece takes no block
        last = max(first, math.ceil(end / self.block_size))
        return BlockScaledPayload(self.codes[start:end], self.scales[first:last], torch.Size([end - start]),
                                  self.dtype, self.block_size)  # fmt: skip


class BlockScaledQuantizer(Compressor):
    """An 8-bit code per element and a float32 scale per block (see the module's docstring); ``code_dtype`` and
    ``code_max`` are the code's."""

    unbiased = False
    block_aligned: ClassVar[bool] = True
    code_dtype: ClassVar[torch.dtype]
    code_max: ClassVar[float]

    def __init__(self, block_size: int = DEFAULT_BLOCK) -> None:
        self.block_size = check_int("block_size", block_size, 1)

    @property
    def bias_reason(self) -> str:
        return f"it rounds each value to the nearest of its block's {self.name} codes"

    @property
    def summable_across_ranks(self) -> bool:
        return False  # each rank's blocks have their own scales

    def preferred_aggregator(self, world_size: int) -> str:
        return "two_phase"

    def piece_bounds(self, numel: int, parts: int) -> list[tuple[int, int]]:
        """``parts`` consecutive slices of ``numel`` elements, cut at block boundaries, as even as blocks allow."""
        blocks = math.ceil(numel / self.block_size)
        share, extra = divmod(blocks, parts)  # the first ``extra`` slices hold one block more
        edges = [min(numel, (i * share + min(i, extra)) * self.block_size) for i in range(parts + 1)]
        return list(itertools.pairwise(edges))

    def scales_of(self, x: Tensor) -> Tensor:
        """Each block's scale (float32): its largest magnitude over :attr:`code_max` (0 for a block of zeros)."""
        flat = x.reshape(-1).float()
        blocks = math.ceil(flat.numel() / self.block_size)
        padded = torch.nn.functional.pad(flat, (0, blocks * self.block_size - flat.numel()))
        return padded.view(blocks, self.block_size).abs().amax(dim=1).div_(self.code_max)

    def compress(self, x: Tensor, generator: Draws = None, **kwargs: Any) -> BlockScaledPayload:
        flat = x.reshape(-1)
        scales = self.scales_of(flat)
        divisor = torch.where(scales > 0, scales, torch.ones_like(scales)).repeat_interleave(self.block_size)
        scaled = flat.float() / divisor[: flat.numel()]
        return BlockScaledPayload(self._encode(scaled), scales, x.shape, x.dtype, self.block_size)

    def _encode(self, scaled: Tensor) -> Tensor:
        raise NotImplementedError

    def unpack(self, buffer: Tensor, shape: torch.Size, dtype: torch.dtype) -> BlockScaledPayload:
        numel = shape.numel()
        expected = self.payload_nbytes(shape, dtype)
        if buffer.numel() != expected:
            raise ValueError(f"{self.name} payload of {buffer.numel()} bytes, expected {expected} for {numel} elements")
        reader = ByteReader(buffer)
        codes = reader.take(numel, torch.uint8).view(self.code_dtype)
        scales = reader.take(math.ceil(numel / self.block_size), torch.float32)
        return BlockScaledPayload(codes, scales, shape, dtype, self.block_size)

    def decoded(self, payload: BlockScaledPayload) -> Tensor:
        """The values (flat, float32): codes times their block's scale."""
        scales = payload.scales.repeat_interleave(self.block_size)[: payload.codes.numel()]
        return payload.codes.float() * scales

    def accumulate(self, payload: Payload, out: Tensor) -> Tensor:
        assert isinstance(payload, BlockScaledPayload)
        return out.add_(self.decoded(payload).to(out.dtype))

    def payload_nbytes(self, shape: torch.Size, dtype: torch.dtype) -> int:
        numel = torch.Size(shape).numel()
        return numel + 4 * math.ceil(numel / self.block_size)


class Int8Compressor(BlockScaledQuantizer):
    """int8 codes (``[-127, 127]``) with a float32 scale per block: 8.125 bits per element at blocks of 256."""

    name = "int8"
    code_dtype = torch.int8
    code_max = 127.0

    def _encode(self, scaled: Tensor) -> Tensor:
        return scaled.round_().clamp_(-self.code_max, self.code_max).to(torch.int8)


class FP8Compressor(BlockScaledQuantizer):
    """fp8 (e4m3) values with a float32 scale per block: 8.125 bits per element at blocks of 256 (a torch with the
    ``float8_e4m3fn`` dtype, 2.1 or later)."""

    name = "fp8"
    code_max = 448.0

    def __init__(self, block_size: int = DEFAULT_BLOCK) -> None:
        if not hasattr(torch, "float8_e4m3fn"):
            raise ValueError(
                f"compressor 'fp8' needs torch's float8_e4m3fn dtype, which torch {torch.__version__} lacks"
            )
        super().__init__(block_size)

    @property
    def code_dtype(self) -> torch.dtype:  # type: ignore[override]
        return torch.float8_e4m3fn

    def _encode(self, scaled: Tensor) -> Tensor:
        return scaled.clamp_(-self.code_max, self.code_max).to(torch.float8_e4m3fn)
