"""The 2-bit wire format of ternary codes, and the payload shared by TernGrad and DIANA's quantizer.

Both methods send, per block of a tensor, one fp32 scale ``s_l`` and one code ``c_j`` in
``{-1, 0, 1}`` per element; the receiver reads ``s_l * c_j``. TernGrad (Wen et al., NIPS 2017,
Sec. 3) has one block per layer; DIANA's block p-norm quantizer (Mishchenko et al. 2019, Sec. 2,
"p-quantization") splits a tensor into blocks of ``d_l`` elements. Codes travel at 2
bits each, four per byte, which is 16x smaller than fp32 (the information limit is ``log2(3) =
1.58`` bits).

Encoding: code ``c`` is stored as the 2-bit value ``c + 1`` (``-1 -> 0``, ``0 -> 1``, ``1 -> 2``);
element ``4i + k`` of the tensor sits in bits ``2k, 2k+1`` of byte ``i``. Padding elements of the
last byte hold code 0. The byte layout does not depend on the machine's endianness.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_gradcomp.compressors.base import Payload
from lightning_gradcomp.compressors.wire import ByteReader, to_bytes

CODES_PER_BYTE = 4


def packed_nbytes(numel: int) -> int:
    """Bytes that :func:`pack_2bit` produces for ``numel`` codes: ``ceil(numel / 4)``."""
    return -(-numel // CODES_PER_BYTE)


def pack_2bit(codes: Tensor) -> Tensor:
    """Pack int8 codes in ``{-1, 0, 1}`` (any shape, read in flat order) into ``ceil(n / 4)`` uint8 bytes.

    Values outside ``{-1, 0, 1}`` are not checked (that would cost a pass over the codes on the hot
    path) and do not round-trip.
    """
    if codes.dtype != torch.int8:
        raise ValueError(f"codes must be an int8 tensor, got {codes.dtype}")
    flat = codes.reshape(-1)
    numel = flat.numel()
    biased = torch.empty(packed_nbytes(numel) * CODES_PER_BYTE, dtype=torch.uint8, device=codes.device)
    # uint8 arithmetic wraps: -1 (0xFF) + 1 = 0, 0 + 1 = 1, 1 + 1 = 2.
    torch.add(flat.view(torch.uint8), 1, out=biased[:numel])
    biased[numel:] = 1
    return _pack_words(biased) if _LITTLE_ENDIAN else _pack_columns(biased)


def unpack_2bit(packed: Tensor, numel: int) -> Tensor:
    """The first ``numel`` int8 codes (1-D) stored in the uint8 tensor ``packed`` by :func:`pack_2bit`."""
    if packed.dtype != torch.uint8 or packed.dim() != 1:
        raise ValueError(f"packed must be a 1-D uint8 tensor, got {packed.dtype} with shape {tuple(packed.shape)}")
    if packed.numel() != packed_nbytes(numel):
        raise ValueError(f"{numel} codes take {packed_nbytes(numel)} bytes, got {packed.numel()}")
    biased = _unpack_words(packed) if _LITTLE_ENDIAN else _unpack_columns(packed)
    return biased[:numel].view(torch.int8) - 1


# Two implementations of the same byte layout. The word form works on contiguous int32 lanes (about
# 4x faster while the data sits in cache) but relies on little-endian byte order inside a word; the
# column form is order-free. Tests check that both give the same bytes.
_LITTLE_ENDIAN = sys.byteorder == "little"


def _pack_words(biased: Tensor) -> Tensor:
    """Pack 2-bit values (uint8, length a multiple of 4) by folding each int32 word's four bytes into one."""
    words = biased.view(torch.int32)
    # byte k of a word holds its value in bits 8k, 8k+1: move them to bits 2k, 2k+1 of the low byte
    folded = words | (words >> 6)
    folded |= folded >> 12
    return folded.to(torch.uint8)  # keeps the low byte (integer narrowing wraps)


def _pack_columns(biased: Tensor) -> Tensor:
    """Pack 2-bit values (uint8, length a multiple of 4) column by column: any byte order."""
    columns = biased.view(-1, CODES_PER_BYTE)
    packed = columns[:, 0] | (columns[:, 1] << 2)
    packed |= columns[:, 2] << 4
    packed |= columns[:, 3] << 6
    return packed


def _unpack_words(packed: Tensor) -> Tensor:
    """2-bit values (uint8, 4 per packed byte) by spreading each byte over the four bytes of an int32 word."""
    words = packed.to(torch.int32)
    words |= words << 12
    words |= words << 6
    words &= 0x03030303
    return words.view(torch.uint8)


def _unpack_columns(packed: Tensor) -> Tensor:
    """2-bit values (uint8, 4 per packed byte), one bit position at a time: any byte order."""
    columns = torch.empty(packed.numel(), CODES_PER_BYTE, dtype=torch.uint8, device=packed.device)
    for k in range(CODES_PER_BYTE):
        torch.bitwise_and(packed >> (2 * k), 3, out=columns[:, k])
    return columns.view(-1)


def num_blocks(numel: int, block_size: int) -> int:
    """Blocks of ``block_size`` elements (the last one possibly shorter) covering ``numel`` elements."""
    return -(-numel // block_size)


def scale_blocks_(values: Tensor, scales: Tensor, block_size: int) -> Tensor:
    """Multiply the flat ``values`` in place by their block's entry of ``scales`` and return them."""
    full = values.numel() // block_size
    if full:
        values[: full * block_size].view(full, block_size).mul_(scales[:full, None])
    if values.numel() > full * block_size:
        values[full * block_size :].mul_(scales[full])
    return values


def ternarize(g: Tensor, thresholds: Tensor) -> Tensor:
    """Codes ``sign(g_j) * [thresholds_j < |g_j|]`` as int8, overwriting ``thresholds`` (flat, float).

    With ``thresholds_j = U_j * s`` and ``U_j ~ U[0, 1)`` this keeps element ``j`` with probability
    ``|g_j| / s`` (1 if ``|g_j| >= s``): the Bernoulli draw of TernGrad's ternarization and of DIANA's
    quantizer, written ``U * s < |g|`` (the authors' form) so that no division by ``s`` occurs and
    ``s = 0`` needs no special case. Two comparisons give the sign and the draw at once.
    """
    positive = g > thresholds
    negative = g < thresholds.neg_()
    return positive.view(torch.int8) - negative.view(torch.int8)


@dataclass(frozen=True, eq=False)
class TernaryPayload(Payload):
    """Ternary codes of a tensor of ``shape`` with one fp32 scale per block of ``block_size`` elements.

    Wire form: the scales (fp32, one per block), then the codes packed 2 bits each:
    ``4 * blocks + ceil(numel / 4)`` bytes.

    Attributes:
        codes: int8, flat, values in ``{-1, 0, 1}``.
        scales: float32, one per block.
        shape: the tensor's shape.
        dtype: the gradient's dtype, which decoding returns.
        block_size: elements per scale (the last block may be shorter).
        shared: whether ``scales`` is a scale agreed on by every rank (TernGrad's scaler sharing).
    """

    codes: Tensor
    scales: Tensor
    shape: torch.Size
    dtype: torch.dtype
    block_size: int
    shared: bool = False

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return self.codes.device

    @property
    def nbytes(self) -> int:
        return 4 * self.scales.numel() + packed_nbytes(self.codes.numel())

    def to_bytes(self) -> Tensor:
        return to_bytes([self.scales.to(torch.float32), pack_2bit(self.codes)])

    @classmethod
    def from_bytes(
        cls, buffer: Tensor, shape: torch.Size, dtype: torch.dtype, block_size: int, blocks: int
    ) -> TernaryPayload:
        """Parse the wire form of a tensor of ``shape`` cut into ``blocks`` blocks of ``block_size``."""
        numel = shape.numel()
        expected = 4 * blocks + packed_nbytes(numel)
        if buffer.numel() != expected:
            raise ValueError(f"ternary payload of {buffer.numel()} bytes, expected {expected} for shape {tuple(shape)}")
        reader = ByteReader(buffer)
        scales = reader.take(blocks, torch.float32)
        codes = unpack_2bit(reader.take(packed_nbytes(numel), torch.uint8), numel)
        return cls(codes, scales, shape, dtype, block_size)

    def dense(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """``codes * scale`` per element, flat, in ``dtype`` (each product is exact: codes are 0 or +-1)."""
        return scale_blocks_(self.codes.to(dtype), self.scales.to(dtype), self.block_size)


def working_dtype(dtype: torch.dtype) -> torch.dtype:
    """Precision of the arithmetic behind a gradient of ``dtype``: fp64 stays fp64, everything else fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32
