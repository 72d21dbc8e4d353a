"""The 2-bit wire format of ternary codes, and the payload shared by TernGrad and DIANA's quantizer.

Both methods send, per block of a tensor, one fp32 scale ``s_l`` and one code ``c_j`` in
``{-1, 0, 1}`` per element; the receiver reads ``s_l * c_j``. TernGrad (Wen et al., NIPS 2017,
Sec. 3) has one block per layer; DIANA's block p-norm quantizer (Mishchenko et al. 2019, Sec. 2,
"p-quantization") splits a tensor into blocks of ``d_l`` elements. Codes travel at 2
bits each, sixteen per 32-bit word, which is 16x smaller than fp32 (the information limit is ``log2(3) =
1.58`` bits).

Encoding: code ``c`` is stored as the 2-bit value ``c + 1`` (``-1 -> 0``, ``0 -> 1``, ``1 -> 2``), in planar rows
of 8192 codes in 512 little-endian words (:mod:`~lightning_gradcomp.core.compressors.planar`): field ``k`` (bits
``2k, 2k+1``) of a row's word ``v`` holds its code ``v + 512 k``; the last, partial row is cut into sixteen stripes
of a sixteenth of its length, rounded up, and its padding fields hold code 0.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from itertools import accumulate

import torch
from torch import Tensor

from lightning_gradcomp.core.compressors.base import STREAM_CHUNK, Payload, chunk_for, subtract_by_adding
from lightning_gradcomp.core.compressors.blocks import sparse_nonzero
from lightning_gradcomp.core.compressors.draws import Draws, random_bytes, uniform
from lightning_gradcomp.core.compressors.finiteness import Finite, finiteness
from lightning_gradcomp.core.compressors.kernels import (
    add_fields_,
    aligned_blocks,
    draw_codes,
    draw_packed_codes,
    drawn_whole,
    mean_of_fields_,
)
from lightning_gradcomp.core.compressors.planar import (
    field_positions,
    pack_codes,
    planar_nbytes,
    row_codes,
    unpack_codes,
    word_aligned,
)
from lightning_gradcomp.core.compressors.wire import ByteReader, own_payload, to_bytes
from lightning_gradcomp.core.fused import compiles_on
from lightning_gradcomp.core.randomness import CounterStream
from lightning_gradcomp.core.workspace import Scratch

CODES_PER_BYTE = 4
#: A ternary code's field holds ``c + 1``.
TERNARY_BIAS = 1


def packed_nbytes(numel: int) -> int:
    """Bytes that :func:`pack_2bit` produces for ``numel`` codes: ``4 ceil(numel / 16)``, whole words."""
    return planar_nbytes(numel, CODES_PER_BYTE)


def pack_2bit(codes: Tensor, out: Tensor | None = None) -> Tensor:
    """Pack int8 codes in ``{-1, 0, 1}`` (any shape, read in flat order) into ``4 ceil(n / 16)`` uint8 bytes, planar
    rows of words (into ``out`` when given).

    Values outside ``{-1, 0, 1}`` are not checked (that would cost a pass over the codes on the hot
    path) and do not round-trip.
    """
    return pack_codes(codes, CODES_PER_BYTE, TERNARY_BIAS, TERNARY_BIAS, out)


def unpack_2bit(packed: Tensor, numel: int) -> Tensor:
    """The first ``numel`` int8 codes (1-D) stored in the uint8 tensor ``packed`` by :func:`pack_2bit`."""
    if packed.dtype != torch.uint8 or packed.dim() != 1:
        raise ValueError(f"packed must be a 1-D uint8 tensor, got {packed.dtype} with shape {tuple(packed.shape)}")
    if packed.numel() != packed_nbytes(numel):
        raise ValueError(f"{numel} codes take {packed_nbytes(numel)} bytes, got {packed.numel()}")
    return unpack_2bit_range(packed, numel, 0, numel)


def unpack_2bit_range(packed: Tensor, numel: int, start: int, count: int) -> Tensor:
    """Codes ``[start, start + count)`` (int8) of :func:`pack_2bit`'s bytes of ``numel`` codes, unpacked alone."""
    return unpack_codes(packed, numel, start, count, CODES_PER_BYTE, TERNARY_BIAS)


class PackedCodes:
    """One small integer code per element, held as int8 (``stored_codes``) or packed as it travels (``packed``:
    decoded a chunk at a time where it is added, so it costs its wire bits per element, never an int8). For the
    payloads of ternary codes and of QSGD's levels. A compressor draws its codes straight into their packed
    bytes behind the scales (:func:`own_wire`), and a received payload keeps the bytes it arrived in: either way
    the whole wire form is ``wire``, sent as it is."""

    stored_codes: Tensor | None
    packed: Tensor | None
    wire: Tensor | None
    numel: int  # the payload's element count (:class:`~lightning_gradcomp.core.compressors.base.Payload`'s)

    @property
    def packing(self) -> CodePacking:
        """How the codes lie in their bytes."""
        raise NotImplementedError

    def add_to_(self, out: Tensor, alpha: float = 1.0, start: int = 0) -> Tensor:
        """``out += alpha * decoded[start : start + out.numel()]`` (flat ``out``)."""
        raise NotImplementedError

    @cached_property
    def codes(self) -> Tensor:
        """The int8 codes, flat (decoded whole from :attr:`packed` when they are held packed)."""
        if self.stored_codes is not None:
            return self.stored_codes
        assert self.packed is not None
        return self.packing.unpack(self.packed, self.numel, 0, self.numel)

    def code_range(self, start: int, count: int) -> Tensor:
        """Codes ``[start, start + count)`` (int8): a view of the stored codes, or that range unpacked alone."""
        if self.stored_codes is not None:
            return self.stored_codes[start : start + count]
        assert self.packed is not None
        return self.packing.unpack(self.packed, self.numel, start, count)

    def wire_codes(self) -> Tensor:
        """The codes as they travel: the packed bytes, or the stored codes packed."""
        if self.stored_codes is None:
            assert self.packed is not None
            return self.packed
        return self.packing.pack(self.stored_codes)

    def wire_form(self, header: Tensor) -> Tensor:
        """The payload as it travels: :attr:`wire` when the bytes already lie together, else ``header`` (the fp32
        scales) and the packed codes joined."""
        return self.wire if self.wire is not None else to_bytes([header.to(torch.float32), self.wire_codes()])

    def codes_into(self, out: Tensor) -> Tensor:
        """Every code written into the flat integer tensor ``out``, a chunk at a time (no int8 copy of them all)."""
        span = chunk_for(out.device, STREAM_CHUNK)
        for start in range(0, out.numel(), span):
            n = min(span, out.numel() - start)
            out[start : start + n].copy_(self.code_range(start, n))
        return out


@dataclass(frozen=True)
class CodePacking:
    """How a compressor's int8 codes become wire bytes (:mod:`~lightning_gradcomp.core.compressors.planar`'s rows), so
    that they can be drawn straight into them: ``per_byte`` codes share a byte, each field holding ``c`` plus
    ``bias``; the last row's unused fields hold ``pad``."""

    per_byte: int
    bias: int
    pad: int

    @property
    def row(self) -> int:
        """Codes per whole row."""
        return row_codes(self.per_byte)

    def nbytes(self, numel: int) -> int:
        """Bytes of ``numel`` packed codes."""
        return planar_nbytes(numel, self.per_byte)

    def pack(self, codes: Tensor, out: Tensor | None = None) -> Tensor:
        """The bytes of the int8 ``codes`` as a tensor of their own (into ``out`` when given): a run of codes that
        starts on a row, packed into its bytes."""
        return pack_codes(codes, self.per_byte, self.bias, self.pad, out)

    def unpack(self, packed: Tensor, numel: int, start: int, count: int) -> Tensor:
        """Codes ``[start, start + count)`` (int8) of the bytes ``packed`` of ``numel`` codes."""
        return unpack_codes(packed, numel, start, count, self.per_byte, self.bias)

    def step_(self, packed: Tensor, numel: int, positions: Tensor, steps: Tensor) -> Tensor:
        """Add the small int8 ``steps`` to codes ``positions`` (int64) of the bytes ``packed`` of ``numel`` codes, in
        place.

        A field holds ``c`` plus an offset, so a step that keeps the code in its range never carries into the next
        field: adding ``step << shift`` to the byte (uint8 arithmetic wraps) is exact, and steps into one byte add up.
        """
        byte, shift = field_positions(positions, numel, self.per_byte)
        return packed.index_add_(0, byte, (steps.to(torch.int32) << shift).to(torch.uint8))


#: Ternary codes at 2 bits each (:func:`pack_2bit`).
TERNARY_PACKING = CodePacking(CODES_PER_BYTE, bias=TERNARY_BIAS, pad=TERNARY_BIAS)


def fused_span(
    out: Tensor, packed: Tensor | None, start: int, numel: int, block_size: int, packing: CodePacking
) -> tuple[int, int]:
    """``(low, high)``: the elements of the flat ``out`` (codes ``start`` on, of a tensor of ``numel`` codes) that a
    compiled kernel decodes in one pass: the whole rows of whole blocks inside it (a tensor of one block: whole rows),
    where kernels run compiled, ``out`` is float32, the codes are packed and the blocks line up with the rows
    (:func:`~lightning_gradcomp.core.compressors.kernels.aligned_blocks`); else ``(0, 0)``. The eager chunks decode
    the rest, before and after."""
    single = block_size >= numel
    if packed is None or out.dtype != torch.float32 or not compiles_on(out.device):
        return 0, 0
    if not (single or aligned_blocks(block_size, packing.per_byte)):
        return 0, 0
    unit = packing.row if single else max(packing.row, block_size)
    stop = min(start + out.numel(), numel // packing.row * packing.row)
    low, high = -(-start // unit) * unit, stop // unit * unit
    return (low - start, high - start) if high > low else (0, 0)


def add_blocks_fused_(
    out: Tensor,
    packed: Tensor,
    scales: Tensor,
    alpha: float,
    start: int,
    numel: int,
    block_size: int,
    packing: CodePacking,
) -> tuple[int, int]:
    """``out += alpha * decoded`` over the :func:`fused_span` of ``out`` in one compiled pass (fp32 scales); returns
    that span (the caller decodes the rest)."""
    low, high = fused_span(out, packed, start, numel, block_size, packing) if scales.dtype == torch.float32 else (0, 0)
    if high > low:
        first, last = start + low, start + high
        codes = word_aligned(packed[first // packing.per_byte : last // packing.per_byte])
        step = torch.full((), alpha, dtype=torch.float32, device=out.device)
        blocks = scales[:1] if block_size >= numel else scales[first // block_size : last // block_size]
        add_fields_(out[low:high], codes, blocks, step, packing.per_byte, packing.bias)
    return low, high


def mean_of_blocks_fused_(
    out: Tensor, packs: Sequence[Tensor | None], scales: Sequence[Tensor], block_size: int, packing: CodePacking
) -> int:
    """``out`` becomes the mean of the ranks' decoded codes over the leading :func:`fused_span` of it, in one compiled
    pass (summed in rank order, then divided: the eager roundings on the CPU, a few roundings apart on CUDA); returns
    how many elements that took."""
    numel = out.numel()
    done = min(fused_span(out, codes, 0, numel, block_size, packing)[1] for codes in packs)
    if done and all(s.dtype == torch.float32 for s in scales):
        blocks = 1 if block_size >= numel else done // block_size
        codes = [word_aligned(c[: done // packing.per_byte]) for c in packs if c is not None]
        mean_of_fields_(out[:done], codes, [s[:blocks] for s in scales], packing.per_byte, packing.bias)
        return done
    return 0


def average_packed_(
    out: Tensor,
    payloads: Sequence[PackedCodes],
    scales: Sequence[Tensor],
    block_size: int,
    packing: CodePacking,
    world: int,
) -> Tensor:
    """``out`` becomes the mean of the ranks' packed payloads (their codes times ``scales``, per block): the leading
    whole rows in one compiled pass (:func:`mean_of_blocks_fused_`), the rest zeroed, each payload added, divided:
    the eager roundings either way on the CPU."""
    done = mean_of_blocks_fused_(out, [p.packed for p in payloads], scales, block_size, packing)
    if done < out.numel():
        rest = out[done:].zero_()
        for payload in payloads:
            payload.add_to_(rest, 1.0, done)
        rest.div_(world)
    return out


def own_wire(
    scratch: Scratch | None, header: Tensor, packing: CodePacking, numel: int
) -> tuple[Tensor, Tensor, Tensor]:
    """This rank's payload laid out as it travels (:func:`~lightning_gradcomp.core.compressors.wire.own_payload`): the
    fp32 ``header`` in front, the region its ``numel`` packed codes are drawn into behind it."""
    return own_payload(scratch, header, packing.nbytes(numel))


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


def scale_run_(values: Tensor, scales: Tensor, block_size: int, start: int) -> Tensor:
    """Multiply the flat ``values``, elements ``start ..`` of a tensor cut into blocks of ``block_size``, in place by
    their block's entry of ``scales`` (a partial first block, then :func:`scale_blocks_`) and return them."""
    head = min(values.numel(), -start % block_size)
    if head:
        values[:head].mul_(scales[start // block_size])
    scale_blocks_(values[head:], scales[(start + head) // block_size :], block_size)
    return values


#: Random bits drawn per element up front; the rest of a uniform is drawn only where they cannot decide.
DRAW_BITS = 8
#: ``q`` is the keep probability times this: the range of one random byte.
DRAW_LEVELS = 1 << DRAW_BITS


#: Elements encoded at a time: the encoder's temporaries stay this small (about 1 MiB), so they sit in
#: cache and no model-sized tensor is allocated (and page-faulted) per call besides the codes.
ENCODE_CHUNK = 1 << 18


def keep_levels(probability_scale: Tensor) -> Tensor:
    """``DRAW_LEVELS / s`` elementwise, and 0 where ``s`` is 0 (an all-zero block keeps nothing, no NaN)."""
    return torch.where(probability_scale > 0, DRAW_LEVELS / probability_scale, 0.0)


def stochastic_ternary(
    g: Tensor,
    scales: Tensor,
    block_size: int,
    generator: Draws = None,
    cap: Tensor | None = None,
    packed: Tensor | None = None,
) -> Tensor:
    """Codes ``sign(g_j) * xi_j`` (int8), ``xi_j ~ Bernoulli(min(|g_j|, cap) / s_l)``, exact from 8 random bits.

    ``g`` is flat fp32, cut into blocks of ``block_size`` elements with one ``s_l`` each in
    ``scales`` (TernGrad's scaler, one block; DIANA's block norms): Wen et al., 2017, Eq. 2;
    Mishchenko et al., 2019, Sec. 2. With ``q_j = 256 min(|g_j|, cap) / s_l``, the uniform ``U_j`` of
    the Bernoulli draw ``U_j < q_j / 256`` is written ``U_j = (B_j + V_j) / 256`` with ``B_j`` a
    uniform byte and ``V_j ~ U[0, 1)`` independent of it, which makes ``U_j`` exactly uniform on
    ``[0, 1)``. With ``n_j = floor(q_j)``: ``B_j < n_j`` keeps for sure (``B + V < n <= q``),
    ``B_j > n_j`` drops for sure (``B + V >= n + 1 > q``), and only ``B_j = n_j`` (probability
    1/256) needs ``V_j``: keep iff ``V_j < q_j - n_j``. So ``P(xi_j = 1) = q_j / 256`` exactly, with
    8 random bits per element plus one fp32 uniform per 256 elements, instead of a 32-bit draw for
    every element (random bytes cost a tenth of ``torch.rand`` on a CPU). The second-stage
    uniform resolves the probability to ``2^-32``, finer than one fp32 uniform.

    Draw order (what a reference needs to reproduce the codes), from a ``torch.Generator``: every byte first
    (``ceil(d / 8)`` uniform int64 words read as bytes), then one uniform for each tied element, in index order. From
    a counter stream (the hook's) the same two-stage test reads one 32-bit draw per element, ``B`` its top byte and
    ``V`` the rest (:func:`~lightning_gradcomp.core.compressors.kernels.stochastic_codes`): no second pass for the
    ties, and one fused kernel where kernels are compiled.
    The work runs in chunks of about :data:`ENCODE_CHUNK` elements through small scratch tensors; the
    words are drawn chunk by chunk (whole words per chunk), which is the same stream as one draw of all.
    With ``packed`` (:func:`packed_nbytes` bytes) the codes are packed into it as they are drawn
    (:func:`pack_2bit`'s bytes, the tied elements' steps added in place) and it is returned: no int8 tensor of
    ``g``'s size.
    """
    multipliers = keep_levels(scales.to(torch.float32))
    return _stochastic_codes(g, multipliers, block_size, generator, cap, packing=TERNARY_PACKING, packed=packed)


def stochastic_levels(
    g: Tensor,
    multipliers: Tensor,
    block_size: int,
    generator: Draws = None,
    packing: CodePacking | None = None,
    packed: Tensor | None = None,
    levels: float | None = None,
) -> Tensor:
    """QSGD's codes ``sign(g_j) (floor(u_j) + xi_j)`` (int8), ``u_j = |g_j| m_l``, ``xi_j ~ Bernoulli(frac(u_j))``.

    ``m_l`` (in ``multipliers``, one per block) is ``levels / norm`` (Alistarh et al., 2017, Sec. 3.1):
    the level below ``u_j``, one up with the probability of its fractional part. The draw is
    :func:`stochastic_ternary`'s, of ``sign(g_j) frac(u_j)`` against a scale of 1 (exact in fp32: the
    fraction times 256), in the same draw order, computed chunk by chunk with the floor: no tensor of the
    gradient's size besides the codes, packed by ``packing`` into ``packed`` as they are drawn when
    ``packed`` is given (then returned). ``levels``, when given, is ``s``: ``u_j`` is clamped to it, since
    ``|g_j| (s / N)`` can round above ``s`` where one element holds its block's whole norm.
    """
    top = None if levels is None else torch.full((), float(levels), dtype=g.dtype, device=g.device)  # no copy
    return _stochastic_codes(g, multipliers, block_size, generator, top, True, packing, packed)


def _stochastic_codes(
    g: Tensor,
    multipliers: Tensor,
    block_size: int,
    generator: Draws,
    cap: Tensor | None,
    fractional: bool = False,
    packing: CodePacking | None = None,
    packed: Tensor | None = None,
) -> Tensor:
    """The chunked two-stage draw behind :func:`stochastic_ternary` (``q = min(|g|, cap) m``) and
    :func:`stochastic_levels` (``fractional``: ``u = min(|g| m, cap)``, ``q = 256 frac(u)``, codes from
    ``floor(u)`` up): int8 codes of ``g``'s size, or with ``packed`` each chunk's codes packed into it."""
    if isinstance(generator, CounterStream):
        return _counter_codes(g, multipliers, block_size, generator, cap, fractional, packing, packed)
    numel = g.numel()
    # whole random words per chunk; whole rows when packed (a chunk may start inside a block), else whole blocks
    step = 8 if block_size >= numel else math.lcm(block_size, 8)
    step = step if packing is None else packing.row
    chunk = step * max(1, chunk_for(g.device, ENCODE_CHUNK) // step)
    size = min(chunk, numel)
    if packed is None:
        codes = torch.empty(numel, dtype=torch.int8, device=g.device)
    else:
        assert packing is not None and packed.numel() == packing.nbytes(numel)
        codes = torch.empty(size, dtype=torch.int8, device=g.device)  # one chunk's, packed before the next
    level = torch.empty(size, dtype=torch.float32, device=g.device)
    # u and its floor in the gradient's precision (fp64 stays fp64), the fraction then rounded to fp32
    wide = torch.empty(size if fractional else 0, dtype=g.dtype, device=g.device)
    below = torch.empty(size if fractional else 0, dtype=g.dtype, device=g.device)
    floors16 = torch.empty(size, dtype=torch.int16, device=g.device)
    floors = torch.empty(size, dtype=torch.uint8, device=g.device)
    keep = torch.empty(size, dtype=torch.bool, device=g.device)
    # the level's increment as a float: a bool operand would send the add down a slow casting path
    step_up = torch.empty(size if fractional else 0, dtype=g.dtype, device=g.device)
    tied = torch.empty(size, dtype=torch.bool, device=g.device)
    tie_indices, tie_fractions = [], []
    for start in range(0, numel, chunk):
        stop = min(start + chunk, numel)
        n = stop - start
        q, n16, n8, kept, tie = level[:n], floors16[:n], floors[:n], keep[:n], tied[:n]
        draws = random_bytes(generator, n, g.device)
        if fractional:  # the level below u, and the fraction above it as a probability out of 256 (exact)
            u = scale_run_(torch.abs(g[start:stop], out=wide[:n]), multipliers, block_size, start)
            if cap is not None:
                u.clamp_(max=cap)
            q.copy_(u.sub_(torch.floor(u, out=below[:n]))).mul_(DRAW_LEVELS)
        else:
            torch.abs(g[start:stop], out=q)
            if cap is not None:
                q.clamp_(max=cap)
            scale_run_(q, multipliers, block_size, start)
        # n_j as a byte: q >= 256 (probability 1) becomes 256 and then n = 255, whose tie V < q - n = 1 is
        # sure. (float -> int16 -> uint8 is four times faster than float -> uint8 here.)
        n16.copy_(q.clamp_(max=DRAW_LEVELS)).clamp_(max=DRAW_LEVELS - 1)
        n8.copy_(n16)
        if fractional:
            torch.lt(draws, n8, out=step_up[:n])
        else:
            torch.lt(draws, n8, out=kept)
        ties = sparse_nonzero(torch.eq(draws, n8, out=tie))
        if ties.numel():
            tie_indices.append(ties + start)
            tie_fractions.append(q[ties].sub_(n8[ties]))
        out = codes[start:stop] if packed is None else codes[:n]
        if fractional:  # sign(g) (floor(u) + xi), small integers: exact
            out.copy_(torch.sign(g[start:stop], out=wide[:n]).mul_(below[:n].add_(step_up[:n])))
        else:
            out.copy_(torch.sign(g[start:stop], out=q)).mul_(kept.view(torch.int8))  # q is free: ties are taken
        if packed is not None:
            assert packing is not None
            packing.pack(out, packed[start // packing.per_byte : packing.nbytes(stop)])  # a chunk of whole rows
    if tie_indices:  # a tie steps one level away from zero where its second uniform wins
        ties = torch.cat(tie_indices)
        second = uniform(generator, ties.numel(), g.device)
        won = (second < torch.cat(tie_fractions)).to(torch.int8)
        steps = torch.sign(g.index_select(0, ties)).to(torch.int8) * won
        if packed is None:
            codes.index_add_(0, ties, steps)
        else:
            assert packing is not None
            packing.step_(packed, numel, ties, steps)
    return codes if packed is None else packed


def _counter_codes(
    g: Tensor,
    multipliers: Tensor,
    block_size: int,
    stream: CounterStream,
    cap: Tensor | None,
    fractional: bool,
    packing: CodePacking | None,
    packed: Tensor | None,
) -> Tensor:
    """:func:`_stochastic_codes` from a counter stream: one 32-bit draw per element
    (:func:`~lightning_gradcomp.core.compressors.kernels.stochastic_codes`), packed as drawn. One fused kernel over the
    whole tensor where kernels run compiled; else the same function eagerly, :data:`ENCODE_CHUNK` elements at a time
    (whole packed bytes each), which draws the same codes: an element's bits hash its own counter."""
    numel = g.numel()
    block = stream.block(numel)
    if packed is not None:
        assert packing is not None and packed.numel() == packing.nbytes(numel)
        layout = (packing.bias, packing.per_byte, packing.pad)
    several = multipliers.numel() > 1
    # blocks that do not line up with the rows run in eager chunks: no compiled kernel packs them
    aligned = packing is None or not several or aligned_blocks(block_size, packing.per_byte)
    if compiles_on(g.device) and aligned:
        if packed is None:
            return draw_codes(g, multipliers, block, cap, 0, block_size, fractional)[:numel]
        assert packing is not None
        done = drawn_whole(numel, multipliers.numel(), block_size, packing.per_byte)
        if done:
            # the kernel's own words, then copied into the wire: with the codes in bytes, a kernel storing them in the
            # wire itself (a mutated input) wrote int32 fields first and converted them in a second loop (45-51 ms a
            # 4096 x 4096 layer on an AMD EPYC against 40-42); not measured again since the codes became words
            drawn = draw_packed_codes(g[:done], multipliers, block, cap, 0, block_size, fractional, *layout)
            packed[: packing.nbytes(done)].copy_(drawn.view(torch.uint8))
        if done < numel:  # the last, partial row across several blocks, eagerly (drawn_whole says why)
            piece = block.clone()
            piece[2] += done
            rest = (g[done:], multipliers, piece, cap, done, block_size, fractional, *layout)
            packed[packing.nbytes(done) :] = draw_packed_codes.eager(*rest).view(torch.uint8)
        return packed
    codes = torch.empty(numel if packed is None else 0, dtype=torch.int8, device=g.device)
    # whole bytes (whole rows when packed), and whole blocks if several and they line up; else a chunk starts inside
    # a block and its draw begins at the block's start (``head`` codes drawn again, dropped)
    unit = 8 if packing is None else packing.row
    unit = math.lcm(block_size, unit) if several and aligned else unit
    # drawn packed, a quarter of a chunk at a time: the kernel draws all of a row's planes at once, so each of its
    # temporaries is the piece's size (drawn a plane at a time, they were a plane's)
    span = chunk_for(g.device, ENCODE_CHUNK) // (1 if packing is None else 4)
    chunk = max(1, span // unit) * unit
    for start in range(0, numel, chunk):
        stop = min(start + chunk, numel)
        head = start % block_size if several else 0
        piece = block.clone()
        piece[2] += start - head
        arguments = (g[start - head : stop], multipliers, piece, cap, start - head, block_size, fractional)
        if packed is None:
            codes[start:stop] = draw_codes.eager(*arguments)[head : head + stop - start]
        elif aligned:
            drawn = draw_packed_codes.eager(*arguments, *layout)
            packed[start // packing.per_byte : packing.nbytes(stop)] = drawn.view(torch.uint8)
        else:
            assert packing is not None
            drawn = draw_codes.eager(*arguments)[head : head + stop - start]
            packing.pack(drawn, packed[start // packing.per_byte : packing.nbytes(stop)])
    return codes if packed is None else packed


@dataclass(frozen=True, eq=False)
class TernaryPayload(PackedCodes, Payload):
    """Ternary codes of a tensor of ``shape`` with one fp32 scale per block of ``block_size`` elements.

    Wire form: the scales (fp32, one per block), then the codes packed 2 bits each:
    ``4 * blocks + 4 * ceil(numel / 16)`` bytes.

    A compressor's payload and one received off the wire keep their codes packed (:class:`PackedCodes`).

    Attributes:
        stored_codes: int8, flat, values in ``{-1, 0, 1}`` (``None`` when they are only ``packed``).
        scales: float32, one per block.
        shape: the tensor's shape.
        dtype: the gradient's dtype, which decoding returns.
        block_size: elements per scale (the last block may be shorter).
        shared: whether ``scales`` is a scale agreed on by every rank (TernGrad's scaler sharing).
        packed: the codes as they travel (:func:`pack_2bit`'s planar rows), when they were drawn or received packed.
        wire: the whole wire form, when the scales and packed codes lie in it (drawn or received so).
    """

    stored_codes: Tensor | None
    scales: Tensor
    shape: torch.Size
    dtype: torch.dtype
    block_size: int
    shared: bool = False
    packed: Tensor | None = None
    wire: Tensor | None = None

    @property
    def packing(self) -> CodePacking:
        return TERNARY_PACKING

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return self.scales.device

    @property
    def nbytes(self) -> int:
        return 4 * self.scales.numel() + packed_nbytes(self.numel)

    def to_bytes(self) -> Tensor:
        return self.wire_form(self.scales)

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
        packed = reader.take(packed_nbytes(numel), torch.uint8)
        return cls(None, scales, shape, dtype, block_size, packed=packed, wire=buffer)

    def entries(self) -> TernarySlice:
        return TernarySlice(self, 0, self.numel)

    def add_to_(self, out: Tensor, alpha: float = 1.0, start: int = 0) -> Tensor:
        """``out += alpha * codes * scale`` for elements ``[start, start + len(out))`` (flat ``out``).

        Each ``codes * scale`` is exact (codes are 0 or +-1). Where kernels run compiled, the whole rows of whole
        blocks of fp32 take one fused pass (:func:`add_blocks_fused_`). The rest, in ``out``'s own dtype when that is
        the working precision (fp32, fp64): the codes go through a cache-sized float scratch (an
        int8 operand would send ``addcmul_`` down a casting path four times slower), then one fused
        ``addcmul_`` per run of whole blocks. Otherwise (fp16, bf16) the decoded slice is rounded
        to the gradient's dtype first, as :meth:`dense` gives it, then added.
        """
        work = working_dtype(out.dtype)
        count, size = out.numel(), self.block_size
        if out.dtype != work:
            return out.add_(self.decode_range(start, count), alpha=alpha)
        scales = self.scales.to(work)
        low, high = add_blocks_fused_(out, self.packed, scales, alpha, start, self.numel, size, TERNARY_PACKING)
        limit = chunk_for(out.device, ENCODE_CHUNK)
        chunk = size * max(1, limit // size) if size <= limit else limit
        scratch = torch.empty(min(chunk, count - (high - low)), dtype=work, device=out.device)
        for first, last in ((0, low), (high, count)):
            for offset in range(first, last, chunk):
                n = min(chunk, last - offset)
                codes = scratch[:n].copy_(self.code_range(start + offset, n))
                _add_scaled_(out[offset : offset + n], codes, scales, size, start + offset, alpha)
        return out

    def decode_range(self, start: int, numel: int) -> Tensor:
        """Elements ``[start, start + numel)`` decoded in the gradient's dtype: that slice of :meth:`dense`."""
        work = working_dtype(self.dtype)
        return self.add_to_(torch.zeros(numel, dtype=work, device=self.device), start=start).to(self.dtype)

    def dense(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """``codes * scale`` per element, flat, in ``dtype`` (each product is exact: codes are 0 or +-1)."""
        return scale_blocks_(self.codes.to(dtype), self.scales.to(dtype), self.block_size)


def _add_scaled_(out: Tensor, codes: Tensor, scales: Tensor, size: int, start: int, alpha: float) -> None:
    """``out += alpha * codes * scales[block]`` for the run of elements starting at index ``start``, cut into
    blocks of ``size``: a partial first block, whole blocks as rows, a partial last block."""
    numel = out.numel()
    head = min(numel, -start % size)  # up to the first block boundary
    if head:
        out[:head].addcmul_(codes[:head], scales[start // size], value=alpha)
    full = (numel - head) // size
    if full:
        first = (start + head) // size
        rows = out[head : head + full * size].view(full, size)
        blocks = codes[head : head + full * size].view(full, size)
        rows.addcmul_(blocks, scales[first : first + full, None], value=alpha)
    tail = head + full * size
    if tail < numel:
        out[tail:].addcmul_(codes[tail:], scales[(start + tail) // size], value=alpha)


@dataclass(frozen=True, eq=False)
class TernarySlice:
    """Elements ``[start, start + numel)`` of a :class:`TernaryPayload`, decoded only where they are added.

    What memory takes from this rank's own ternary payload (DIANA's ``h_i += alpha * Q(g_i - h_i)``,
    error feedback's subtraction): one fused pass into the state, no dense decoded copy.
    """

    payload: TernaryPayload
    start: int
    numel: int

    def add_to_(self, out: Tensor, alpha: float = 1.0) -> Tensor:
        return self.payload.add_to_(out, alpha, self.start)

    #: not claimed for per-block scales: error feedback reads the tensor itself
    vouches_finite = False

    def subtract_from(self, compensated: Tensor, out: Tensor) -> Tensor:
        return subtract_by_adding(self, compensated, out)

    def to_dense(self) -> Tensor:
        return self.payload.decode_range(self.start, self.numel)

    def all_finite(self) -> Finite:
        """Whether the scales of the blocks this slice touches are finite (codes are 0 or +-1, and a
        code 0 times an infinite scale is NaN, so that is exactly when every decoded element is)."""
        if not self.numel:
            return True
        size = self.payload.block_size
        return finiteness(self.payload.scales[self.start // size : -(-(self.start + self.numel) // size)])

    def split(self, numels: Sequence[int]) -> list[TernarySlice]:
        if sum(numels) != self.numel:
            raise ValueError(f"slice sizes {list(numels)} do not add up to {self.numel}")
        starts = accumulate(numels[:-1], initial=self.start)
        return [TernarySlice(self.payload, start, n) for start, n in zip(starts, numels, strict=True)]


def working_dtype(dtype: torch.dtype) -> torch.dtype:
    """Precision of the arithmetic behind a gradient of ``dtype``: fp64 stays fp64, everything else fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32
