"""The codecs' per-element math as pure functions over flat tensors, for :mod:`lightning_gradcomp.core.fused`.

Each kernel reads its input once and writes only its wire bytes: compiled, it is one or two fused passes; eager, it is
the oracle the compiled form is tested against, and the codecs run it a cache-sized chunk at a time
(:func:`draw_packed_codes`), which its counter-based draws make exact: element ``j``'s random bits are a hash of the
stream's key and ``j`` (:func:`~lightning_gradcomp.core.randomness.hash_counters`), whichever piece it is drawn in.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_gradcomp.core.fused import fused
from lightning_gradcomp.core.randomness import hash_counters

__all__ = [
    "clipped_scale",
    "draw_codes",
    "draw_packed_codes",
    "encode_signs",
    "pack_fields",
    "stochastic_codes",
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
    bits = hash_counters(block, n)
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
    (:func:`pack_fields`) in one kernel: the codes are never written out as int8."""
    codes = stochastic_codes(g, multipliers, block, cap, first, block_size, fractional)
    return pack_fields((codes.to(torch.int32) + bias).to(torch.uint8), per_byte, pad)


@fused
def encode_signs(flat: Tensor, rms: bool) -> tuple[Tensor, Tensor]:
    """EF-SignSGD's payload of a flat tensor (Karimireddy et al., ICML 2019, Algorithm 1): the magnitude (float32
    ``||x||_1 / d``, or with ``rms`` 1-bit Adam's ``||x||_2 / sqrt(d)``) and the bits ``x >= 0`` packed 8 to a byte,
    least significant first."""
    d = max(1, flat.numel())
    work = flat.to(torch.float32)
    magnitude = (torch.linalg.vector_norm(work) if rms else work.abs().sum()) / (d**0.5 if rms else d)
    return magnitude, pack_fields((flat >= 0).to(torch.uint8), 8, 0)


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
