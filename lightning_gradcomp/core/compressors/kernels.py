"""The codecs' per-element math as pure functions over flat tensors, for :mod:`lightning_gradcomp.core.fused`.

Each kernel reads its input once and writes only its wire bytes: compiled, it is one or two fused passes; eager, it is
the oracle the compiled form is tested against, and the codecs run it a cache-sized chunk at a time
(:func:`draw_packed_codes`), which its counter-based draws make exact: element ``j``'s random bits are a hash of the
stream's key and ``j`` (:func:`~lightning_gradcomp.core.randomness.hash_counters`), whichever piece it is drawn in.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from lightning_gradcomp.core.compressors.planar import (
    STRIPE,
    WORD,
    fields_of_rows,
    pack_fields,
    pack_rows,
    row_codes,
    row_split,
)
from lightning_gradcomp.core.fused import fused
from lightning_gradcomp.core.randomness import hash_at, hash_counters

__all__ = [
    "add_fields_",
    "aligned_blocks",
    "clipped_scale",
    "draw_codes",
    "draw_packed_codes",
    "drawn_whole",
    "encode_signs",
    "field_values",
    "mean_of_fields_",
    "mean_of_signs_",
    "mean_of_summed_fields_",
    "shift_and_estimate_",
    "sign_row_split",
    "sign_rows",
    "signs_of_rows",
    "stochastic_codes",
    "subtract_signs_",
    "whole_blocks",
]

#: ``q`` (a keep probability times this) is resolved by the top 8 bits of a draw, its fraction by the other 24.
_LEVELS = 256.0


def whole_blocks(numel: int, multipliers: Tensor, block_size: int) -> int:
    """How many codes :func:`stochastic_codes` returns for ``numel`` elements: with one multiplier per block, whole
    blocks (inductor 2.13's CPU loops stop at the last whole block when a loop's length is not a multiple of an index's
    divisor, so a kernel never indexes by ``element // block_size`` over a partial block); else ``numel``."""
    return numel if multipliers.numel() == 1 else -(-numel // block_size) * block_size


def stochastic_codes(
    g: Tensor, multipliers: Tensor, block: Tensor, cap: Tensor | None, first: int, block_size: int, fractional: bool
) -> Tensor:
    """Int8 codes of ``g`` (elements ``first ..`` of a tensor cut into blocks of ``block_size``, one multiplier each;
    ``first`` a multiple of ``block_size`` where there are several), each from one 32-bit counter draw (``block``: the
    stream's key and this piece's first counter); :func:`whole_blocks` of them, zeros past ``g``'s end.

    Ternary (TernGrad, Wen et al., 2017, Eq. 2; DIANA's quantizer, Mishchenko et al., 2019, Sec. 2): code
    ``sign(g_j) xi_j``, ``xi_j ~ Bernoulli(q_j / 256)``, ``q_j = 256 min(|g_j|, cap) m_l`` (``m_l = 1 / s_l``).
    ``fractional`` (QSGD, Alistarh et al., 2017, Sec. 3.1): ``u_j = min(|g_j| m_l, cap)``, code
    ``sign(g_j) (floor(u_j) + xi_j)`` with ``q_j = 256 frac(u_j)``. The draw: with ``B`` the top 8 bits and ``V`` the
    other 24 as a uniform on ``[0, 1)``, keep iff ``B < n_j`` or ``B = n_j`` and ``V < q_j - n_j``
    (``n_j = min(floor(q_j), 255)``): ``P = q_j / 256`` to within ``2^-32`` (exactly, for ``q_j >= 1``).
    """
    n = whole_blocks(g.numel(), multipliers, block_size)
    if multipliers.numel() == 1:
        m = multipliers.reshape(())

        def scaled(values: Tensor) -> Tensor:
            return values * m.to(values.dtype)

    else:
        g = torch.nn.functional.pad(g, (0, n - g.numel()))
        low = first // block_size
        column = multipliers[low : low + n // block_size, None]

        def scaled(values: Tensor) -> Tensor:
            return (values.view(-1, block_size) * column.to(values.dtype)).view(-1)

    return _codes_of(g, scaled, hash_counters(block, n), cap, fractional)


def _codes_of(
    g: Tensor, scaled: Callable[[Tensor], Tensor], bits: Tensor, cap: Tensor | None, fractional: bool
) -> Tensor:
    """:func:`stochastic_codes`' decision for the elements ``g`` (any shape), each with its 32 random ``bits``;
    ``scaled`` multiplies magnitudes by their multipliers."""
    if fractional:
        u = scaled(g.abs())
        if cap is not None:
            u = torch.minimum(u, cap.to(g.dtype))
        below = torch.floor(u)
        q = (u - below).to(torch.float32) * _LEVELS
    else:
        q = g.abs().to(torch.float32)
        if cap is not None:
            q = torch.minimum(q, cap.to(torch.float32))
        q = scaled(q)
    q = torch.clamp(q, max=_LEVELS)
    whole = torch.clamp(q, max=_LEVELS - 1).to(torch.int32)  # floor: q >= 0
    top = (bits >> 24) & 0xFF
    rest = (bits & 0xFFFFFF).to(torch.float32) * 2.0**-24
    keep = (top < whole) | ((top == whole) & (rest < q - whole.to(torch.float32)))
    sign = torch.sign(g)
    if fractional:
        return (sign * (below + keep.to(g.dtype))).to(torch.int8)
    return (sign * keep.to(g.dtype)).to(torch.int8)


@fused
def draw_codes(
    g: Tensor, multipliers: Tensor, block: Tensor, cap: Tensor | None, first: int, block_size: int, fractional: bool
) -> Tensor:
    """:func:`stochastic_codes` as a kernel."""
    return stochastic_codes(g, multipliers, block, cap, first, block_size, fractional)


def aligned_blocks(block_size: int, per_byte: int) -> bool:
    """Whether blocks of ``block_size`` line up with the planar rows of ``4 * per_byte * STRIPE`` codes (one holds
    the other a whole number of times; rows are powers of two, so a block within a row also lies within a stripe or
    holds whole ones): then each stripe of a row, or each block within one, has one multiplier, and the compiled
    kernels draw and decode rows as whole vectors."""
    row = row_codes(per_byte)
    return block_size % row == 0 or row % block_size == 0


def _draw_rows(
    g: Tensor,
    multipliers: Tensor,
    block: Tensor,
    cap: Tensor | None,
    first: int,
    block_size: int,
    fractional: bool,
    bias: int,
    per_byte: int,
) -> Tensor:
    """The planar words (int32) of ``g``, whole rows (and whole blocks where there are several, aligned:
    :func:`aligned_blocks`): the rows' planes drawn as one ``(rows, per_word, runs, run)`` tensor, element
    ``r * per_word * STRIPE + k * STRIPE + v`` with the bits of its own counter (:func:`hash_at`), a run being the
    elements of a plane under one multiplier, then packed by :func:`pack_rows` (one expression over the planes, not
    one per plane: unrolled over 16 planes, TernGrad's first compress took 90.5 s to compile against 19.1, the docs'
    speed page, twelfth round)."""
    per_word = WORD * per_byte
    rows = g.numel() // row_codes(per_byte)
    single = multipliers.numel() == 1
    run = STRIPE if single else min(block_size, STRIPE)
    shape = (rows, per_word, STRIPE // run, run)
    offsets = torch.arange(g.numel(), dtype=torch.int32, device=g.device).view(shape)
    if single:
        column = multipliers.reshape(1, 1, 1, 1)
    else:  # one multiplier per run: a stripe (blocks of STRIPE or more) or a block within one
        low = first // block_size
        runs = multipliers[low : low + g.numel() // block_size, None].expand(-1, block_size // run)
        column = runs.reshape(*shape[:3], 1)

    def scaled(values: Tensor) -> Tensor:
        return values * column.to(values.dtype)

    codes = _codes_of(g.view(shape), scaled, hash_at(block, offsets), cap, fractional)
    return pack_rows(codes.to(torch.int32) + bias, per_byte, STRIPE)


def drawn_whole(numel: int, blocks: int, block_size: int, per_byte: int) -> int:
    """How many leading elements of a tensor of ``numel`` (``blocks`` multipliers) the compiled
    :func:`draw_packed_codes` may draw: all, unless there are several blocks no longer than a row, which line up with
    the rows; then its whole rows, and the caller draws the rest eagerly (inductor 2.13's CPU loop over the last row's
    stripes, indexed by ``element // block_size`` across a partial block, computed a wrong multiplier there: the
    case :func:`whole_blocks` guards)."""
    row = row_codes(per_byte)
    if blocks == 1 or block_size > row:
        return numel
    return numel // row * row


@fused
def draw_packed_codes(
    g: Tensor,
    multipliers: Tensor,
    block: Tensor,
    cap: Tensor | None,
    first: int,
    block_size: int,
    fractional: bool,
    bias: int,
    per_byte: int,
    pad: int,
) -> Tensor:
    """:func:`stochastic_codes` biased by ``bias`` (in int32: int16 arithmetic does not vectorise) and packed in
    planar rows (:mod:`~lightning_gradcomp.core.compressors.planar`; ``g`` as a tensor of its own, ``first`` a
    multiple of the rows and, with several multipliers, of the blocks) in one kernel, returned as int32 words: the
    codes are never written out as int8. Whole rows of whole blocks are drawn all planes at once (:func:`_draw_rows`);
    the rest (less than a row, or than a block where blocks are longer) in element order, then packed. Blocks must
    line up with the rows (:func:`aligned_blocks`; the codecs draw other blocks unpacked, :func:`draw_codes`, and
    pack them eagerly).
    Compiled, it is called on :func:`drawn_whole` elements."""
    parts = _packed_parts(g, multipliers, block, cap, first, block_size, fractional, bias, per_byte, pad)
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _packed_parts(
    g: Tensor,
    multipliers: Tensor,
    block: Tensor,
    cap: Tensor | None,
    first: int,
    block_size: int,
    fractional: bool,
    bias: int,
    per_byte: int,
    pad: int,
) -> list[Tensor]:
    """:func:`draw_packed_codes`'s words as the consecutive pieces drawn: whole rows, then the rest."""
    numel = g.numel()
    single = multipliers.numel() == 1
    row = row_codes(per_byte)
    if not (single or aligned_blocks(block_size, per_byte)):
        raise ValueError(f"block_size {block_size} does not line up with rows of {row} codes")
    unit = row if single else max(row, block_size)
    done = numel // unit * unit
    parts = []
    if done:
        parts.append(_draw_rows(g[:done], multipliers, block, cap, first, block_size, fractional, bias, per_byte))
    if done < numel:  # the rest: in one block (the tensor's, or a block longer than a row), or whole blocks
        rest = numel - done
        if single or block_size > row:
            m = multipliers.reshape(-1)[0 if single else (first + done) // block_size]
            values, count = g[done:], rest

            def scaled(magnitudes: Tensor) -> Tensor:
                return magnitudes * m.to(magnitudes.dtype)

        else:  # whole blocks, the last padded with zeros (code 0): no index by ``element // block_size``
            blocks = -(-rest // block_size)
            count = blocks * block_size
            values = torch.nn.functional.pad(g[done:], (0, count - rest)).view(blocks, block_size)
            low = (first + done) // block_size
            column = multipliers[low : low + blocks, None]

            def scaled(magnitudes: Tensor) -> Tensor:
                return magnitudes * column.to(magnitudes.dtype)

        offsets = done + torch.arange(count, dtype=torch.int32, device=g.device)
        codes = _codes_of(values, scaled, hash_at(block, offsets.view(values.shape)), cap, fractional)
        parts.append(pack_fields(codes.reshape(-1)[:rest].to(torch.int32) + bias, per_byte, pad))
    return parts


#: Signs per stripe of the scaled signs' wire (:mod:`~lightning_gradcomp.core.compressors.sign`): a row of ``32 *
#: SIGN_STRIPE`` signs lies in ``SIGN_STRIPE`` words, bit ``k`` of word ``v`` holding sign ``v + k * SIGN_STRIPE``
#: (the planar rows of :mod:`~lightning_gradcomp.core.compressors.planar`, one bit per field).
SIGN_STRIPE = STRIPE
#: Signs per whole row.
SIGN_ROW = row_codes(8)


def sign_row_split(numel: int) -> tuple[int, int]:
    """``(whole, stripe)``: how many of ``numel`` signs lie in whole rows, and the stripe (in words) of the last,
    partial row (``ceil(m / 32)`` for its ``m`` signs; 0 when there is none)."""
    return row_split(numel, 8)


def sign_rows(flat: Tensor, stripe: int) -> Tensor:
    """The planar words (int32) of whole rows of ``32 * stripe`` elements of ``flat``: bit ``k`` of word ``v`` of a
    row is ``x >= 0`` of its element ``v + k * stripe``. Each stripe is read contiguously: compiled, whole vectors."""
    return pack_rows(torch.where(flat >= 0, 1, 0).to(torch.int32), 8, stripe)


def signs_of_rows(packed: Tensor, stripe: int) -> Tensor:
    """The signs (+1 for a set bit, -1 else; float32) of whole rows of :func:`sign_rows`' bytes (uint8, starting on a
    word), shaped ``(rows, 32, stripe)``: each row's 32 stripes in element order."""
    return (fields_of_rows(packed, 8, stripe) * 2 - 1).to(torch.float32)


@fused
def encode_signs(flat: Tensor, rms: bool) -> tuple[Tensor, Tensor]:
    """EF-SignSGD's payload of a flat tensor (Karimireddy et al., ICML 2019, Algorithm 1): the magnitude (float32
    ``||x||_1 / d``, or with ``rms`` 1-bit Adam's ``||x||_2 / sqrt(d)``) and the bits ``x >= 0`` in planar rows as
    int32 words (:func:`sign_rows`; the last, partial row of ``m`` elements in stripes of ``ceil(m / 32)``, its
    padding 0)."""
    parts = _sign_parts(flat)
    bits = parts[0] if len(parts) == 1 else torch.cat(parts) if parts else flat.new_zeros(0, dtype=torch.int32)
    return _sign_magnitude(flat, rms), bits


def _sign_magnitude(flat: Tensor, rms: bool) -> Tensor:
    """:func:`encode_signs`'s magnitude: ``||x||_1 / d``, or ``||x||_2 / sqrt(d)`` with ``rms``, in float32. The whole
    rows' terms are summed over each row's planes first, as the bits are (:func:`sign_rows`), then those sums (one
    float32 per word): the compiled kernel reads each element once for both (summed at once, the two reductions took
    two passes)."""
    d = max(1, flat.numel())
    work = flat.to(torch.float32)
    terms = work * work if rms else work.abs()
    whole, _ = sign_row_split(flat.numel())
    total = terms[whole:].sum()
    if whole:
        total = terms[:whole].view(-1, 8 * WORD, SIGN_STRIPE).sum(1).sum() + total
    return (torch.sqrt(total) if rms else total) / (d**0.5 if rms else d)


def _sign_parts(flat: Tensor) -> list[Tensor]:
    """:func:`encode_signs`'s bits as the consecutive pieces packed: whole rows, then the last, partial row, its floats
    padded with -1 before the test (not :func:`~lightning_gradcomp.core.compressors.planar.pack_fields` of the bits
    padded after it: compiled, that took 12.5 ms against 11.2-11.3 for 16,777,293 elements in two of three runs of
    calls alternated in one process, on one AMD EPYC thread; timed by hand)."""
    whole, stripe = sign_row_split(flat.numel())
    parts = [sign_rows(flat[:whole], SIGN_STRIPE)] if whole else []
    if stripe:
        padding = 8 * WORD * stripe - (flat.numel() - whole)
        padded = torch.nn.functional.pad(flat[whole:], (0, padding), value=-1.0)
        parts.append(sign_rows(padded, stripe))
    return parts


@fused
def clipped_scale(g: Tensor, clip_sigma: float) -> Tensor:
    """TernGrad's scaler of the flat float32 ``g`` (Wen et al., 2017, Sec. 3.3): ``max|g|``, lowered to
    ``clip_sigma * std(g)`` (the population standard deviation) when that is smaller and positive, ``clip_sigma = 0``
    meaning no clipping. Compiled, the maximum and the variance come from one pass over ``g``; eagerly, two."""
    low, high = torch.aminmax(g)
    scale = torch.maximum(high, -low)
    if clip_sigma > 0:
        bound = clip_sigma * torch.std(g, correction=0)
        scale = torch.where(bound > 0, torch.minimum(scale, bound), scale)
    return scale


def field_values(packed: Tensor, scales: Tensor, per_byte: int, bias: int) -> Tensor:
    """The values of whole planar rows of codes (the field minus ``bias``) times their blocks' ``scales``: the rows'
    codes cut into ``scales.numel()`` equal blocks that line up with the rows (:func:`aligned_blocks`; one block for
    a tensor's one scale), shaped ``(blocks, runs, run)``, a run being a block's elements within one stripe."""
    codes = fields_of_rows(packed, per_byte, STRIPE) - bias
    blocks = scales.numel()
    run = min(codes.numel() // blocks, STRIPE)
    return codes.to(scales.dtype).view(blocks, -1, run) * scales[:, None, None]


@fused
def mean_of_fields_(out: Tensor, packs: list[Tensor], scales: list[Tensor], per_byte: int, bias: int) -> None:
    """``out`` (flat, whole rows of whole blocks) becomes the mean of the ranks' decoded codes (:func:`field_values`),
    summed in rank order then divided by their number: the eager zeroing, adding and dividing in one pass, the same
    roundings on the CPU (on CUDA, inductor divides by the constant as a product with its reciprocal, and Triton may
    fuse a multiply-add: a few roundings apart)."""
    total = field_values(packs[0], scales[0], per_byte, bias)
    for rank in range(1, len(packs)):
        total = total + field_values(packs[rank], scales[rank], per_byte, bias)
    out.view(total.shape).copy_(total / len(packs))


@fused
def mean_of_summed_fields_(out: Tensor, packs: list[Tensor], scale: Tensor, per_byte: int, bias: int) -> None:
    """``out`` (flat, whole planar rows) becomes ``sum(codes) * S / P`` under one shared scale ``S`` (TernGrad's shared
    scaler, Wen et al., 2017, Sec. 3.2): the ranks' codes summed as integers, scaled once, then divided."""
    total = fields_of_rows(packs[0], per_byte, STRIPE) - bias
    for rank in range(1, len(packs)):
        total = total + (fields_of_rows(packs[rank], per_byte, STRIPE) - bias)
    out.view(total.shape).copy_(total.to(scale.dtype) * scale / len(packs))


@fused
def add_fields_(out: Tensor, packed: Tensor, scales: Tensor, alpha: Tensor, per_byte: int, bias: int) -> None:
    """``out += alpha * decoded`` over whole planar rows of whole blocks (DIANA's ``h_i += alpha * delta_i``,
    Mishchenko et al., 2019, Algorithm 1) in one pass; ``alpha`` a 0-dim tensor, so that a new step size compiles
    nothing new."""
    values = field_values(packed, scales, per_byte, bias)
    out.view(values.shape).add_(values * alpha)


@fused
def mean_of_signs_(out: Tensor, bits: list[Tensor], scales: list[Tensor]) -> None:
    """``out`` (flat, whole rows of signs) becomes the mean of the ranks' scaled signs (:func:`signs_of_rows` times the
    rank's scale, exact), summed in rank order, divided by their number."""
    total = signs_of_rows(bits[0], SIGN_STRIPE) * scales[0]
    for rank in range(1, len(bits)):
        total = total + signs_of_rows(bits[rank], SIGN_STRIPE) * scales[rank]
    out.view(total.shape).copy_(total / len(bits))


@fused
def subtract_signs_(out: Tensor, compensated: Tensor, bits: Tensor, scale: Tensor) -> None:
    """``out = compensated - scale * sign`` over whole rows of signs in one pass: error feedback's residual of a scaled
    sign (``scale * +-1`` is exact: one rounding, as the eager copy-then-add)."""
    signs = signs_of_rows(bits, SIGN_STRIPE) * scale
    out.view(signs.shape).copy_(compensated.view(signs.shape) - signs)


@fused
def shift_and_estimate_(mean: Tensor, shift: Tensor, alpha: Tensor) -> None:
    """DIANA's reconstruction and global shift step (Mishchenko et al., 2019, Algorithm 1) in one pass over the flat
    ``mean``, in place: ``mean <- h + mean`` and ``h <- h + alpha * mean`` (the old mean)."""
    estimate = shift + mean
    shift.add_(mean * alpha)
    mean.copy_(estimate)
