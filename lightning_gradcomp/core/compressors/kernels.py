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

from lightning_gradcomp.core.fused import fused
from lightning_gradcomp.core.randomness import hash_at, hash_counters

__all__ = [
    "add_fields_",
    "clipped_scale",
    "draw_codes",
    "draw_packed_codes",
    "encode_signs",
    "field_values",
    "mean_of_fields_",
    "mean_of_signs_",
    "mean_of_summed_fields_",
    "pack_fields",
    "packed_fields",
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


def pack_fields(fields: Tensor, per_byte: int, pad: int) -> Tensor:
    """Pack the uint8 ``fields`` (each below ``2 ** (8 // per_byte)``) ``per_byte`` to a byte, the first in the lowest
    bits; the last byte is padded with the field value ``pad``."""
    short = (-fields.numel()) % per_byte
    if short:
        fields = torch.cat([fields, fields.new_full((short,), pad)])
    if per_byte == 1:
        return fields
    # an OR of shifted columns: compiled, one loop over the bytes (a sum over each row of fields does not vectorise)
    width = 8 // per_byte
    rows = fields.view(-1, per_byte)
    packed = rows[:, 0]
    for k in range(1, per_byte):
        packed = packed | (rows[:, k] << (width * k))
    return packed


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
    """:func:`stochastic_codes` biased by ``bias`` (in int32: int16 arithmetic does not vectorise) and packed
    (:func:`pack_fields`) in one kernel: the codes are never written out as int8. Where a byte's fields share a
    multiplier (one for the tensor, or blocks a multiple of ``per_byte`` long), each byte's ``per_byte`` codes are
    drawn side by side in one loop over the bytes: the same codes as drawing them all
    and then packing them in a second loop, which inductor left scalar on the CPU (QSGD's 4-bit levels of 16.7M
    elements: 35 against 43 ms, one thread)."""
    if per_byte == 1 or (multipliers.numel() > 1 and block_size % per_byte):
        codes = stochastic_codes(g, multipliers, block, cap, first, block_size, fractional)
        return pack_fields((codes.to(torch.int32) + bias).to(torch.uint8), per_byte, pad)
    # field p of every byte as one strided column: element per_byte * i + p with the bits of its own counter
    # (hash_at); past g's end the elements are zeros, code 0, field ``bias`` (the caller writes ``pad`` in their place)
    numel, width = g.numel(), 8 // per_byte
    if multipliers.numel() == 1:
        n = -(-numel // per_byte) * per_byte
        columns = torch.nn.functional.pad(g, (0, n - numel)).view(-1, per_byte)
        m = multipliers.reshape(())
        rows = per_byte * torch.arange(n // per_byte, dtype=torch.int32, device=g.device)

        def scaled(values: Tensor) -> Tensor:
            return values * m.to(values.dtype)

    else:
        n = whole_blocks(numel, multipliers, block_size)
        blocks, per_row = n // block_size, block_size // per_byte
        columns = torch.nn.functional.pad(g, (0, n - numel)).view(blocks, per_row, per_byte)
        low = first // block_size
        column = multipliers[low : low + blocks, None]
        starts = block_size * torch.arange(blocks, dtype=torch.int32, device=g.device)
        rows = starts[:, None] + per_byte * torch.arange(per_row, dtype=torch.int32, device=g.device)

        def scaled(values: Tensor) -> Tensor:
            return values * column.to(values.dtype)

    packed = None
    for p in range(per_byte):
        codes = _codes_of(columns[..., p], scaled, hash_at(block, rows + p), cap, fractional)
        field = (codes.to(torch.int32) + bias) << (width * p)
        packed = field if packed is None else packed | field
    assert packed is not None
    return packed.to(torch.uint8).reshape(-1)


#: Signs per stripe of the scaled signs' wire (:mod:`~lightning_gradcomp.core.compressors.sign`): a row of ``8 *
#: SIGN_STRIPE`` signs lies in ``SIGN_STRIPE`` bytes, bit ``k`` of byte ``b`` holding sign ``b + k * SIGN_STRIPE``.
SIGN_STRIPE = 512
#: Signs per whole row.
SIGN_ROW = 8 * SIGN_STRIPE


def sign_row_split(numel: int) -> tuple[int, int]:
    """``(whole, stripe)``: how many of ``numel`` signs lie in whole rows, and the stripe of the last, partial row
    (``ceil(m / 8)`` for its ``m`` signs; 0 when there is none)."""
    whole = numel // SIGN_ROW * SIGN_ROW
    return whole, -(-(numel - whole) // 8)


def sign_rows(flat: Tensor, stripe: int) -> Tensor:
    """The planar bytes of whole rows of ``8 * stripe`` elements of ``flat``: bit ``k`` of byte ``b`` of a row is
    ``x >= 0`` of its element ``b + k * stripe``. Each stripe is read contiguously: compiled, whole vectors."""
    rows = flat.view(-1, 8, stripe)
    packed = None
    for k in range(8):
        bit = torch.where(rows[:, k] >= 0, 1, 0).to(torch.int32) << k
        packed = bit if packed is None else packed | bit
    assert packed is not None
    return packed.to(torch.uint8).reshape(-1)


def signs_of_rows(packed: Tensor, stripe: int) -> Tensor:
    """The signs (+1 for a set bit, -1 else; float32) of whole rows of :func:`sign_rows`' bytes, shaped ``(rows, 8,
    stripe)``: each row's eight stripes in element order."""
    shifts = torch.arange(8, dtype=torch.int32, device=packed.device).view(1, 8, 1)
    bits = (packed.view(-1, 1, stripe).to(torch.int32) >> shifts) & 1
    return (bits * 2 - 1).to(torch.float32)


@fused
def encode_signs(flat: Tensor, rms: bool) -> tuple[Tensor, Tensor]:
    """EF-SignSGD's payload of a flat tensor (Karimireddy et al., ICML 2019, Algorithm 1): the magnitude (float32
    ``||x||_1 / d``, or with ``rms`` 1-bit Adam's ``||x||_2 / sqrt(d)``) and the bits ``x >= 0`` in planar rows
    (:func:`sign_rows`; the last, partial row of ``m`` elements in stripes of ``ceil(m / 8)``, its padding 0)."""
    d = max(1, flat.numel())
    work = flat.to(torch.float32)
    magnitude = (torch.linalg.vector_norm(work) if rms else work.abs().sum()) / (d**0.5 if rms else d)
    whole, stripe = sign_row_split(flat.numel())
    parts = [sign_rows(flat[:whole], SIGN_STRIPE)] if whole else []
    if stripe:
        padded = torch.nn.functional.pad(flat[whole:], (0, 8 * stripe - (flat.numel() - whole)), value=-1.0)
        parts.append(sign_rows(padded, stripe))
    bits = parts[0] if len(parts) == 1 else torch.cat(parts) if parts else flat.new_zeros(0, dtype=torch.uint8)
    return magnitude, bits


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


def packed_fields(packed: Tensor, rows: int, row: int, per_byte: int, bias: int) -> Tensor:
    """The int32 codes of :func:`pack_fields`' bytes, shaped ``(rows, row)``: code ``j`` of a row is its field minus
    ``bias`` (``row`` a multiple of ``per_byte``, a power of two; ``packed`` exactly the rows' bytes). Compiled, each
    row reads its bytes where it writes its values: no int8 codes in between. (A field's position is masked out of
    ``j``, not taken modulo: the modulo kept inductor's CPU loop from vectorising, 2.7x slower.)"""
    width = 8 // per_byte
    j = torch.arange(row, dtype=torch.int32, device=packed.device)
    words = packed.view(rows, row // per_byte)[:, j // per_byte].to(torch.int32)
    return ((words >> ((j & (per_byte - 1)) * width)) & ((1 << width) - 1)) - bias


def field_values(packed: Tensor, scales: Tensor, block_size: int, per_byte: int, bias: int) -> Tensor:
    """The values of whole blocks of packed codes, shaped ``(blocks, block_size)``: code ``j`` of block ``l`` times
    ``scales[l]``."""
    return packed_fields(packed, scales.numel(), block_size, per_byte, bias).to(scales.dtype) * scales[:, None]


@fused
def mean_of_fields_(
    out: Tensor, packs: list[Tensor], scales: list[Tensor], block_size: int, per_byte: int, bias: int
) -> None:
    """``out`` (flat, whole blocks) becomes the mean of the ranks' decoded codes (:func:`field_values`), summed in
    rank order then divided by their number: the eager zeroing, adding and dividing in one pass, the same roundings
    on the CPU (on CUDA, inductor divides by the constant as a product with its reciprocal, and Triton may fuse a
    multiply-add: a few roundings apart)."""
    total = field_values(packs[0], scales[0], block_size, per_byte, bias)
    for rank in range(1, len(packs)):
        total = total + field_values(packs[rank], scales[rank], block_size, per_byte, bias)
    out.view(total.shape).copy_(total / len(packs))


@fused
def mean_of_summed_fields_(out: Tensor, packs: list[Tensor], scale: Tensor, row: int, per_byte: int, bias: int) -> None:
    """``out`` (flat, whole rows of ``row`` codes) becomes ``sum(codes) * S / P`` under one shared scale ``S``
    (TernGrad's shared scaler, Wen et al., 2017, Sec. 3.2): the ranks' codes summed as integers, scaled once, then
    divided."""
    rows = out.numel() // row
    total = packed_fields(packs[0], rows, row, per_byte, bias)
    for rank in range(1, len(packs)):
        total = total + packed_fields(packs[rank], rows, row, per_byte, bias)
    out.view(rows, row).copy_(total.to(scale.dtype) * scale / len(packs))


@fused
def add_fields_(
    out: Tensor, packed: Tensor, scales: Tensor, alpha: Tensor, block_size: int, per_byte: int, bias: int
) -> None:
    """``out += alpha * decoded`` over whole blocks (DIANA's ``h_i += alpha * delta_i``, Mishchenko et al., 2019,
    Algorithm 1) in one pass; ``alpha`` a 0-dim tensor, so that a new step size compiles nothing new."""
    values = field_values(packed, scales, block_size, per_byte, bias)
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
