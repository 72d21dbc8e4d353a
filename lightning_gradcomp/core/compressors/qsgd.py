"""QSGD with ``s`` levels: per block, its 2-norm and a signed level in ``{-s, ..., s}`` per element.

Alistarh, Grubic, Li, Tomioka, Vojnovic, "QSGD: Communication-Efficient SGD via Gradient
Quantization and Encoding", NeurIPS 2017, Sec. 3.1. For a block ``v`` with ``N = ||v||_2`` and
``u_j = s |v_j| / N``, element ``j`` is sent as

    Q(v)_j = N sign(v_j) xi_j / s,   xi_j = l_j + 1 w.p. u_j - l_j, else l_j  (l_j = floor(u_j)),

so ``E[xi_j] = u_j`` and ``Q`` is unbiased. Its variance is bounded by Lemma 3.1:
``E||Q(v) - v||^2 <= min(d / s^2, sqrt(d) / s) ||v||^2`` for a block of ``d`` elements, which
:meth:`QSGDCompressor.omega` returns for DIANA (Mishchenko et al., 2019, take ``alpha = 1 / (omega
+ 1)``). With ``s = 1`` this is DIANA's 2-norm quantizer (``compressor="quantizer"`` with ``p=2``),
whose exact bound ``sqrt(d) - 1`` the quantizer gives; ``s`` generalises it.

Wire: one float32 norm per block, then the levels offset by ``s`` and packed, 4 bits each for
``s <= 7`` (eight per 32-bit word, in the planar rows of :mod:`~lightning_gradcomp.core.compressors.planar`: field
``k`` of a row's word ``v`` holds its level ``v + 512 k``) and 8 bits for ``s <= 127`` (four per word, the same
rows). The paper's Elias coding of the levels
(Sec. 3.2) is not used: fixed-width codes keep the payload's size a function of the tensor's,
so the allgather needs no exchange of sizes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate

import torch
from torch import Tensor

from lightning_gradcomp.core.compressors.base import STREAM_CHUNK, Payload, chunk_for, subtract_by_adding
from lightning_gradcomp.core.compressors.draws import Draws
from lightning_gradcomp.core.compressors.finiteness import Finite, finiteness
from lightning_gradcomp.core.compressors.quantizer import BlockQuantizer
from lightning_gradcomp.core.compressors.ternary import (
    CodePacking,
    PackedCodes,
    add_blocks_fused_,
    average_packed_,
    num_blocks,
    own_wire,
    scale_blocks_,
    stochastic_levels,
    working_dtype,
)
from lightning_gradcomp.core.compressors.wire import ByteReader
from lightning_gradcomp.core.validation import check_int
from lightning_gradcomp.core.workspace import Scratch

#: QSGD's default: 7 levels, the most that 4-bit codes hold, in blocks of 512 elements (the
#: paper's bucketing: a norm per bucket keeps the variance bound independent of the layer size).
DEFAULT_LEVELS = 7
DEFAULT_QSGD_BLOCK = 512


def code_bits(levels: int) -> int:
    """Bits per element on the wire: 4 for ``s <= 7``, 8 for ``s <= 127``."""
    return 4 if levels <= 7 else 8


def codes_nbytes(numel: int, levels: int) -> int:
    """Bytes of ``numel`` packed levels: whole words, 8 levels to one up to ``s = 7``, 4 beyond."""
    return level_packing(levels).nbytes(numel)


def level_packing(levels: int) -> CodePacking:
    """How levels of ``s = levels`` lie in their words: ``c + s``, eight to a word up to 7, four beyond (planar rows,
    padding fields 0)."""
    return CodePacking(8 // code_bits(levels), bias=levels, pad=0)


def pack_levels(codes: Tensor, levels: int, out: Tensor | None = None) -> Tensor:
    """The wire form of the int8 signed levels ``codes`` (flat order): ``c + s`` in planar words, eight to a word for
    4-bit codes and four for 8-bit ones (:func:`level_packing`); into ``out`` when given."""
    return level_packing(levels).pack(codes, out)


def unpack_levels(packed: Tensor, numel: int, levels: int) -> Tensor:
    """The ``numel`` int8 levels of :func:`pack_levels`' bytes."""
    return unpack_level_range(packed, numel, 0, numel, levels)


def unpack_level_range(packed: Tensor, numel: int, start: int, count: int, levels: int) -> Tensor:
    """Levels ``[start, start + count)`` (int8) of :func:`pack_levels`' bytes of ``numel`` levels, unpacked alone."""
    return level_packing(levels).unpack(packed, numel, start, count)


@dataclass(frozen=True, eq=False)
class LevelsPayload(PackedCodes, Payload):
    """Signed levels ``c_j`` in ``[-s, s]`` (int8) and one norm per block: element ``j`` is ``N_l c_j / s``.

    A compressor's payload and one received off the wire keep their levels packed
    (:class:`~.ternary.PackedCodes`): 4 bits per element, not an int8, in ``packed``, a view of ``wire``, the
    whole wire form (the norms, then the levels).
    """

    stored_codes: Tensor | None
    norms: Tensor
    shape: torch.Size
    dtype: torch.dtype
    block: int
    levels: int
    packed: Tensor | None = None
    wire: Tensor | None = None

    @property
    def packing(self) -> CodePacking:
        return level_packing(self.levels)

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return self.norms.device

    @property
    def nbytes(self) -> int:
        return 4 * self.norms.numel() + codes_nbytes(self.numel, self.levels)

    def to_bytes(self) -> Tensor:
        return self.wire_form(self.norms)

    @classmethod
    def from_bytes(
        cls, buffer: Tensor, shape: torch.Size, dtype: torch.dtype, block: int, levels: int
    ) -> LevelsPayload:
        numel = shape.numel()
        reader = ByteReader(buffer)
        norms = reader.take(num_blocks(numel, block), torch.float32)
        packed = reader.take(codes_nbytes(numel, levels), torch.uint8)
        if reader.remaining:
            raise ValueError(f"QSGD payload has {reader.remaining} unexpected trailing bytes")
        return cls(None, norms, shape, dtype, block, levels, packed=packed, wire=buffer)

    def dense(self) -> Tensor:
        """The decoded flat tensor, in float32 (or float64 for float64 gradients)."""
        values = self.codes.to(working_dtype(self.dtype))
        return scale_blocks_(values, self.norms.to(values.dtype) / self.levels, self.block)

    def add_to_(self, out: Tensor, alpha: float = 1.0, first: int = 0) -> Tensor:
        """``out += alpha * decoded[first : first + out.numel()]``: whole rows of whole blocks of fp32 in one compiled
        pass where
        kernels run compiled (:func:`~.ternary.add_blocks_fused_`; for ``alpha`` other than 1 it rounds ``alpha * v``
        before adding, where eager torch fuses the two: one rounding apart), the rest decoded chunk by chunk into a
        small buffer: the same products and roundings as adding :meth:`dense` (cast to ``out``'s dtype), no tensor of
        the model's size."""
        work = working_dtype(self.dtype)
        scales = self.norms.to(work) / self.levels
        block, n = self.block, out.numel()
        low, high = add_blocks_fused_(out, self.packed, scales, alpha, first, self.numel, block, self.packing)
        span = chunk_for(out.device, STREAM_CHUNK)
        buffer = torch.empty(min(n - (high - low), span), dtype=work, device=out.device)
        for done, stop in ((0, low), (high, n)):
            while done < stop:
                start = first + done
                # a block edge unless it is the last piece, or blocks are longer than a chunk
                edge = start - start % block + span
                end = min(first + stop, edge if edge > start else start + span)
                values = buffer[: end - start].copy_(self.code_range(start, end - start))
                head = min((-start) % block, end - start)  # the rest of the block ``start`` lies in
                if head:
                    values[:head].mul_(scales[start // block])
                scale_blocks_(values[head:], scales[(start + head) // block :], block)
                target = out[done : done + end - start]
                target.add_(values if out.dtype == work else values.to(out.dtype), alpha=alpha)
                done += end - start
        return out

    def entries(self) -> LevelsEntries:
        """The levels with their norms, added into DIANA's shift without a decoded copy."""
        return LevelsEntries(self, 0, self.numel)


@dataclass(frozen=True)
class LevelsEntries:
    """Elements ``first .. first + numel`` of a QSGD payload, decoded only where they are added."""

    payload: LevelsPayload
    first: int
    numel: int

    def to_dense(self) -> Tensor:
        out = torch.zeros(self.numel, dtype=self.payload.dtype, device=self.payload.device)
        return self.payload.add_to_(out, first=self.first)

    def add_to_(self, out: Tensor, alpha: float = 1.0) -> Tensor:
        return self.payload.add_to_(out, alpha, self.first)

    #: not claimed for per-block norms: error feedback reads the tensor itself
    vouches_finite = False

    def subtract_from(self, compensated: Tensor, out: Tensor) -> Tensor:
        return subtract_by_adding(self, compensated, out)

    def all_finite(self) -> Finite:
        """Whether the norms of the blocks this slice touches are finite (the levels are integers)."""
        if not self.numel:
            return True
        block = self.payload.block
        return finiteness(self.payload.norms[self.first // block : (self.first + self.numel - 1) // block + 1])

    def split(self, numels: Sequence[int]) -> list[LevelsEntries]:
        starts = accumulate(numels[:-1], initial=self.first)
        return [LevelsEntries(self.payload, start, n) for start, n in zip(starts, numels, strict=True)]


class QSGDCompressor(BlockQuantizer):
    """QSGD: per block, the 2-norm and stochastic levels in ``{-s..s}`` (unbiased; Alistarh et al. 2017).

    DIANA's 2-norm quantizer generalised to ``s`` levels: its blocks and norms, its own codes.

    Args:
        levels: ``s``, the quantisation levels per sign, 1 to 127 (4-bit codes up to 7).
        block_size: elements per block (the paper's bucket), or ``None`` for one block per tensor.

    Every rank sends its own norms, so payloads are averaged by the allgather aggregator.
    """

    name = "qsgd"

    def __init__(self, levels: int = DEFAULT_LEVELS, block_size: int | None = DEFAULT_QSGD_BLOCK) -> None:
        levels = check_int("levels", levels, 1, 127, note="QSGD's s")
        super().__init__(p=2, block_size=block_size)
        self.levels = levels

    def omega(self, numel: int) -> float:
        """Variance bound ``min(d / s^2, sqrt(d) / s)`` of Lemma 3.1, ``d`` the largest block; for ``s = 1`` the
        exact ``sqrt(d) - 1`` (the quantizer's derivation: with ``u_j <= 1`` the variance is ``N^2 (||u||_1 - 1)``)."""
        if numel <= 0:
            return 0.0
        d = min(self._block(numel), numel)
        if self.levels == 1:  # every u_j <= 1: sum u_j (1 - u_j) = ||u||_1 - 1 <= sqrt(d) - 1, attained
            return math.sqrt(d) - 1.0
        return min(d / self.levels**2, math.sqrt(d) / self.levels)

    def compress(
        self,
        x: Tensor,
        generator: Draws = None,
        scale: Tensor | None = None,
        scratch: Scratch | None = None,
    ) -> Payload:
        g = x.detach().reshape(-1).to(working_dtype(x.dtype))
        block = self._block(g.numel())
        norms = self.norms(g)
        inverse = torch.where(norms > 0, self.levels / norms, torch.zeros_like(norms))
        # one level up with probability frac(u_j), u_j = |g_j| s / norm: the ternary draw of the fraction (8 random
        # bits per element, exact in fp32), chunk by chunk with the floor (stochastic_levels), packed behind the
        # norms as it is drawn, in the unit's kept buffer when the hook hands it over
        packing = level_packing(self.levels)
        wire, kept_norms, packed = own_wire(scratch, norms.to(torch.float32), packing, g.numel())
        stochastic_levels(g, inverse, block, generator, packing, packed, levels=self.levels)
        return LevelsPayload(None, kept_norms, x.shape, x.dtype, block, self.levels, packed=packed, wire=wire)

    def unpack(self, buffer: Tensor, shape: torch.Size, dtype: torch.dtype) -> Payload:
        return LevelsPayload.from_bytes(buffer, shape, dtype, self._block(shape.numel()), self.levels)

    def payload_nbytes(self, shape: torch.Size, dtype: torch.dtype) -> int:
        numel = shape.numel()
        return 4 * num_blocks(numel, self._block(numel)) + codes_nbytes(numel, self.levels)

    def accumulate(self, payload: Payload, out: Tensor) -> Tensor:
        assert isinstance(payload, LevelsPayload)
        return payload.add_to_(out)

    def average_all(self, payloads: Sequence[Payload], out: Tensor, world: int) -> Tensor:
        """The mean of the ranks' levels times their norms: whole blocks in one compiled pass where kernels run
        compiled (:func:`~.ternary.average_packed_`), the rest as :meth:`accumulate_all` then a division."""
        levels = [p for p in payloads if isinstance(p, LevelsPayload)]
        if len(levels) < len(payloads) or not levels:
            return super().average_all(payloads, out, world)
        work = working_dtype(levels[0].dtype)
        scales = [p.norms.to(work) / p.levels for p in levels]
        return average_packed_(out, levels, scales, levels[0].block, level_packing(self.levels), world)

    def decompress(self, payload: Payload) -> Tensor:
        assert isinstance(payload, LevelsPayload)
        return payload.dense().to(payload.dtype)
