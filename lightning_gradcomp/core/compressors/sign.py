"""Scaled sign: one bit per element and one scale per tensor, for error feedback.

Karimireddy, Rebjock, Stich, Jaggi, "Error Feedback Fixes SignSGD and other Gradient Compression
Schemes", ICML 2019, Algorithm 1 (EF-SignSGD): each worker sends

    C(p) = (||p||_1 / d) * sign(p),     p = gamma * g + e   (here: the gradient plus the residual)

and keeps ``e = p - C(p)`` (``memory="ef"``). ``C`` is a contraction,
``||C(p) - p||^2 = ||p||^2 - ||p||_1^2 / d <= (1 - 1/d) ||p||^2`` (the paper's Lemma 8 with
``delta = ||p||_1^2 / (d ||p||^2)``), which is what error feedback needs; it is biased, so it is
never unbiased for DIANA. Ranks gather each other's bits and scales and *average* the scaled signs
(not signSGD's majority vote, which loses the scales and with them the contraction).

Wire form: the scale (float32), then the signs packed 32 per little-endian 32-bit word (a set bit is ``+``;
``sign(0)`` is sent as ``+``, error feedback keeps the difference): ``4 + 4 ceil(d / 32)`` bytes, 32x below fp32 for
large tensors. The words are planar rows (:mod:`~lightning_gradcomp.core.compressors.planar`, one bit per field): the
signs are cut into rows of ``32 * 512`` (:data:`~lightning_gradcomp.core.compressors.kernels.SIGN_ROW`), each in 512
words, bit ``k`` of word ``v`` holding the row's sign ``v + 512 k``; the last, partial row of ``m`` signs is cut the
same way into stripes of ``ceil(m / 32)`` words. So each of a row's 32 bit planes is a contiguous run of elements,
which compiled loops read and write as whole vectors (the planar module gives what that saves).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate
from typing import Literal

import torch
from torch import Tensor

from lightning_gradcomp.core.compressors.base import STREAM_CHUNK, Compressor, Payload, chunk_for, subtract_by_adding
from lightning_gradcomp.core.compressors.draws import Draws
from lightning_gradcomp.core.compressors.finiteness import Finite, finiteness
from lightning_gradcomp.core.compressors.kernels import (
    SIGN_ROW,
    SIGN_STRIPE,
    encode_signs,
    mean_of_signs_,
    sign_row_split,
    subtract_signs_,
)
from lightning_gradcomp.core.compressors.planar import WORD, byte_planes, planar_nbytes, word_aligned
from lightning_gradcomp.core.compressors.wire import ByteReader, own_payload, to_bytes
from lightning_gradcomp.core.fused import compiles_on
from lightning_gradcomp.core.validation import check_choice
from lightning_gradcomp.core.workspace import Scratch

#: Signs decoded at a time by :func:`add_signs_` on the CPU: a quarter of the streamed chunk, its spread signs 1 MiB of
#: float32 instead of 4 (an eager EF-sign step on the 25.2M MLP: +116 / +110 MiB of peak RSS over plain DDP's, against
#: +120 / +110 with the whole chunk; benchmarks/overhead.py --isolate).
SPREAD_CHUNK = STREAM_CHUNK // 4

_BIT_WEIGHTS = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8).view(1, 1, 8, 1)


def sign_nbytes(numel: int) -> int:
    """Bytes of ``numel`` packed signs: ``4 ceil(numel / 32)``, whole words."""
    return planar_nbytes(numel, 8)


def _pack_rows_(out: Tensor, flat: Tensor, stripe: int) -> None:
    """Eagerly, :func:`~lightning_gradcomp.core.compressors.kernels.sign_rows` into the bytes ``out``: byte ``j``
    of a word is the bits of the row's stripes ``8 j .. 8 j + 7`` weighted by ``2^i`` and summed (distinct bits:
    the sum is their union), in bytes throughout (eight times faster here than the kernel's shifts of int32, run
    eagerly)."""
    bits = torch.ge(flat, 0).view(-1, WORD, 8, stripe).view(torch.uint8)
    summed = (bits * _BIT_WEIGHTS.to(flat.device)).sum(2, dtype=torch.uint8)
    byte_planes(out, stripe).copy_(summed)


def pack_signs(flat: Tensor, out: Tensor | None = None) -> Tensor:
    """The planar bytes of ``flat >= 0`` (see the module), eagerly, a chunk of whole rows at a time (into ``out``, of
    :func:`sign_nbytes` bytes, when given)."""
    numel = flat.numel()
    whole, stripe = sign_row_split(numel)
    packed = torch.empty(sign_nbytes(numel), dtype=torch.uint8, device=flat.device) if out is None else out
    span = max(1, chunk_for(flat.device, STREAM_CHUNK) // SIGN_ROW) * SIGN_ROW
    for start in range(0, whole, span):
        part = flat[start : min(start + span, whole)]
        _pack_rows_(packed[start // 8 : (start + part.numel()) // 8], part, SIGN_STRIPE)
    if stripe:
        padded = torch.full((8 * WORD * stripe,), -1.0, dtype=flat.dtype, device=flat.device)
        padded[: numel - whole] = flat[whole:]
        _pack_rows_(packed[whole // 8 :], padded, stripe)
    return packed


@functools.cache
def _sign_table(dtype: torch.dtype, device: torch.device) -> Tensor:
    """Row ``b``: the 8 signs (+1 for a set bit, -1 else) that byte ``b`` holds, bit 0 first."""
    bits = (torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1
    return (2 * bits - 1).to(dtype=dtype, device=device)


def _spread_rows(packed: Tensor, stripe: int, dtype: torch.dtype, out: Tensor | None = None) -> Tensor:
    """Eagerly, the signs of whole planar rows as a ``(rows, 32, stripe)`` view in element order: each byte's eight
    signs from a table (into ``out``, ``(bytes, 8)``, when given), each row's ``(stripe, 4, 8)`` (word, byte, bit)
    read as ``(32, stripe)``."""
    spread = torch.index_select(_sign_table(dtype, packed.device), 0, packed.to(torch.int32), out=out)
    return spread.view(-1, stripe, 8 * WORD).transpose(1, 2)


def _signs_of_rows(packed: Tensor, stripe: int, dtype: torch.dtype) -> Tensor:
    """Eagerly, the signs of whole planar rows in element order (:func:`_spread_rows`, copied flat)."""
    return _spread_rows(packed, stripe, dtype).reshape(-1)


def signs_at(packed: Tensor, numel: int, first: int, count: int, dtype: torch.dtype) -> Tensor:
    """Signs ``first .. first + count`` (+1 or -1 in ``dtype``) of the planar bytes of a tensor of ``numel`` signs:
    the rows that hold them decoded whole, then cut."""
    if count <= 0:
        return torch.empty(0, dtype=dtype, device=packed.device)
    whole, stripe = sign_row_split(numel)
    low, high = first // SIGN_ROW * SIGN_ROW, min(whole, -(-(first + count) // SIGN_ROW) * SIGN_ROW)
    parts = [_signs_of_rows(packed[low // 8 : high // 8], SIGN_STRIPE, dtype)] if high > low else []
    if first + count > whole:
        parts.append(_signs_of_rows(packed[whole // 8 :], stripe, dtype)[: numel - whole])
    start = min(low, whole)
    signs = parts[0] if len(parts) == 1 else torch.cat(parts)
    return signs[first - start : first - start + count]


def l1_norm(flat: Tensor) -> Tensor:
    """``||flat||_1`` as a 0-dim float32 tensor: float32 sums of chunks (``flat.abs().sum()`` for a tensor of one
    chunk), added in float64; no ``|flat|`` of the tensor's size is allocated."""
    span = chunk_for(flat.device, STREAM_CHUNK)
    magnitudes = torch.empty(min(flat.numel(), span), dtype=flat.dtype, device=flat.device)
    partials = [torch.abs(part, out=magnitudes[: part.numel()]).sum(dtype=torch.float32) for part in flat.split(span)]
    if len(partials) <= 1:
        return partials[0] if partials else flat.new_zeros((), dtype=torch.float32)
    return torch.stack(partials).sum(dtype=torch.float64).to(torch.float32)


def fused_signs(out: Tensor, first: int) -> int:
    """How many leading signs of the flat ``out`` (signs ``first`` on) a compiled kernel takes in one pass: its whole
    rows, where kernels run compiled, ``out`` is float32 and ``first`` starts a row; else 0 (eager chunks)."""
    if out.dtype != torch.float32 or first % SIGN_ROW or not compiles_on(out.device):
        return 0
    return out.numel() // SIGN_ROW * SIGN_ROW


def add_signs_(out: Tensor, packed: Tensor, scale: Tensor, numel: int, first: int = 0) -> Tensor:
    """``out += scale * sign`` for the ``out.numel()`` signs from sign number ``first`` on of the planar bytes
    ``packed`` of ``numel`` signs, decoded a chunk at a time (``+-scale`` is exact, so each element is rounded once, as
    one dense pass would). The mean of several payloads is one compiled pass
    (:meth:`ScaledSignCompressor.average_all`)."""
    span = max(1, chunk_for(out.device, SPREAD_CHUNK) // SIGN_ROW) * SIGN_ROW
    whole, _ = sign_row_split(numel)
    spread = None  # one chunk's bytes spread to signs, kept across the chunks: no allocation per chunk
    for start in range(0, out.numel(), span):
        target = out[start : start + span]
        at, count = first + start, target.numel()
        if at % SIGN_ROW or count % SIGN_ROW or at + count > whole:  # a row cut, or the partial last row
            target.addcmul_(signs_at(packed, numel, at, count, out.dtype), scale)
            continue
        if spread is None:
            spread = torch.empty(span // 8, 8, dtype=out.dtype, device=out.device)
        signs = _spread_rows(packed[at // 8 : (at + count) // 8], SIGN_STRIPE, out.dtype, spread[: count // 8])
        target.view(-1, 8 * WORD, SIGN_STRIPE).addcmul_(signs, scale)  # read in element order: no reordered copy
    return out


@dataclass(frozen=True)
class SignPayload(Payload):
    """``scale * (+1 where the bit is set else -1)`` for a tensor of ``shape``; ``bits`` packed 32 per word, in planar
    rows (see the module)."""

    scale: Tensor
    bits: Tensor
    shape: torch.Size
    dtype: torch.dtype
    #: the whole wire form, when the scale and the bits lie in it (written or received so)
    wire: Tensor | None = None

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return self.bits.device

    @property
    def nbytes(self) -> int:
        return 4 + sign_nbytes(self.numel)

    def to_bytes(self) -> Tensor:
        if self.wire is not None:
            return self.wire
        return to_bytes([self.scale.reshape(1).to(torch.float32), self.bits])

    def add_to_(self, out: Tensor) -> Tensor:
        """``out += scale * sign`` (flat ``out``), each element rounded once (``+-scale`` is exact)."""
        return add_signs_(out, self.bits, self.scale.to(out.dtype), self.numel)

    def entries(self) -> SignEntries:
        """The signs with their scale, added into error feedback's residual without a dense decoded copy."""
        return SignEntries(self.bits, self.scale, 0, self.numel, self.dtype, self.numel)


@dataclass(frozen=True)
class SignEntries:
    """Signs ``first .. first + numel`` of a packed payload of ``total`` signs with its scale: what error feedback takes
    from it."""

    bits: Tensor
    scale: Tensor
    first: int
    numel: int
    dtype: torch.dtype
    total: int

    def to_dense(self) -> Tensor:
        return self.add_to_(torch.zeros(self.numel, dtype=self.dtype, device=self.bits.device))

    def add_to_(self, out: Tensor, alpha: float = 1.0) -> Tensor:
        """``out += alpha * scale * sign``: for ``alpha = -1`` the residual ``p - C(p)``, one rounding per element."""
        return add_signs_(out, self.bits, self.scale.to(out.dtype) * alpha, self.total, self.first)

    #: the scale is ``||x||_1 / d`` (or ``||x||_2 / sqrt(d)``) of the whole unit: non-finite wherever an element is (and
    #: where a sum of finite elements overflows, which then skips the update as ``all_finite``'s own sum would)
    vouches_finite = True

    def subtract_from(self, compensated: Tensor, out: Tensor) -> Tensor:
        """``out = compensated - scale * sign``, EF-SignSGD's residual (Karimireddy et al., 2019, Algorithm 1): whole
        rows of fp32 in one compiled pass where kernels run compiled (the eager copy-then-add roundings: ``scale *
        +-1`` is exact), the rest as a copy and :meth:`add_to_`."""
        done = fused_signs(out, self.first)
        if done:
            bits = word_aligned(self.bits[self.first // 8 : (self.first + done) // 8])
            subtract_signs_(out[:done], compensated[:done], bits, self.scale.to(out.dtype))
            if done < out.numel():
                tail = SignEntries(self.bits, self.scale, self.first + done, out.numel() - done, self.dtype, self.total)
                subtract_by_adding(tail, compensated[done:], out[done:])
            return out
        return subtract_by_adding(self, compensated, out)

    def all_finite(self) -> Finite:
        return finiteness(self.scale)

    def split(self, numels: Sequence[int]) -> list[SignEntries]:
        starts = accumulate(numels[:-1], initial=self.first)
        return [
            SignEntries(self.bits, self.scale, start, n, self.dtype, self.total)
            for start, n in zip(starts, numels, strict=True)
        ]


class ScaledSignCompressor(Compressor):
    """EF-SignSGD's compressor: ``(||x||_1 / d) * sign(x)``, 1 bit per element plus one float32 scale.

    A contraction (``||C(x) - x||^2 = ||x||^2 - ||x||_1^2 / d``) for ``memory="ef"``; biased.
    Computed in float32 and decoded to the gradient's dtype.

    Args:
        magnitude: the scale: ``"mean"``, the mean magnitude ``||x||_1 / d`` (EF-SignSGD, the contraction above), or
            ``"rms"``, the root mean square ``||x||_2 / sqrt(d)`` (1-bit Adam, Tang et al., 2021, Algorithm 1, for its
            momentum; a contraction only where ``||x||_1 > sqrt(d) ||x||_2 / 2``: error feedback keeps the rest).
    """

    name = "sign"
    unbiased = False
    takes_scratch = True

    def __init__(self, magnitude: Literal["mean", "rms"] = "mean") -> None:
        self.magnitude = check_choice("magnitude", magnitude, ("mean", "rms"))

    @property
    def bias_reason(self) -> str | None:
        return "a scaled sign keeps only the mean magnitude (a contraction, for error feedback)"

    def compress(
        self, x: Tensor, generator: Draws = None, scale: Tensor | None = None, scratch: Scratch | None = None
    ) -> SignPayload:
        """The scale and the packed signs, written as they travel into the unit's kept buffer when there is
        ``scratch`` (:func:`~lightning_gradcomp.core.compressors.wire.own_payload`): no copy to send them."""
        flat = x.detach().reshape(-1)
        nbytes = sign_nbytes(flat.numel())
        if compiles_on(flat.device):  # one fused pass for the norm and the bits, then copied where they travel
            # (with the bits in bytes, a kernel storing them there itself wrote int32 first and converted them after;
            # not measured again since the bits became words)
            magnitude, bits = encode_signs(flat, self.magnitude == "rms")
            wire, header, region = own_payload(scratch, magnitude.reshape(1), nbytes)
            return SignPayload(header[0], region.copy_(bits.view(torch.uint8)), x.shape, x.dtype, wire)
        if self.magnitude == "rms":
            magnitude = flat.float().norm() / max(1, flat.numel()) ** 0.5
        else:
            magnitude = l1_norm(flat) / max(1, flat.numel())
        wire, header, region = own_payload(scratch, magnitude.reshape(1), nbytes)
        return SignPayload(header[0], pack_signs(flat, region), x.shape, x.dtype, wire)

    def unpack(self, buffer: Tensor, shape: torch.Size, dtype: torch.dtype) -> SignPayload:
        numel = shape.numel()
        if buffer.numel() != self.payload_nbytes(shape, dtype):
            raise ValueError(f"sign payload of {buffer.numel()} bytes, expected {self.payload_nbytes(shape, dtype)}")
        reader = ByteReader(buffer)
        scale = reader.take(1, torch.float32)[0]
        return SignPayload(scale, reader.take(sign_nbytes(numel), torch.uint8), shape, dtype, buffer)

    def payload_nbytes(self, shape: torch.Size, dtype: torch.dtype) -> int:
        return 4 + sign_nbytes(shape.numel())

    def accumulate(self, payload: Payload, out: Tensor) -> Tensor:
        assert isinstance(payload, SignPayload)
        return payload.add_to_(out)

    def average_all(self, payloads: Sequence[Payload], out: Tensor, world: int) -> Tensor:
        """The mean of the ranks' scaled signs: whole rows in one compiled pass where kernels run compiled (summed
        in rank order, then divided: the eager roundings on the CPU; on CUDA the division may be a product with the
        reciprocal), the rest as :meth:`accumulate_all` then a division."""
        signs = [p for p in payloads if isinstance(p, SignPayload)]
        if len(signs) < len(payloads) or not signs:
            return super().average_all(payloads, out, world)
        done = fused_signs(out, 0)
        if done:
            scales = [p.scale.to(out.dtype) for p in signs]
            mean_of_signs_(out[:done], [word_aligned(p.bits[: done // 8]) for p in signs], scales)
        if done < out.numel():
            rest = out[done:].zero_()
            for payload in signs:
                add_signs_(rest, payload.bits, payload.scale.to(out.dtype), payload.numel, first=done)
            rest.div_(world)
        return out

    def preferred_aggregator(self, world_size: int) -> str:
        """``"allgather"``: scales differ per rank, so there is no integer form to allreduce."""
        return "allgather"
