"""TernGrad: stochastic ternary gradients with layer-wise scalers and gradient clipping.

Wen et al., "TernGrad: Ternary Gradients to Reduce Communication in Distributed Deep Learning",
NIPS 2017, Sec. 3 (stochastic ternarization, scaler sharing, gradient clipping). Each tensor is replaced by

    t = s * sign(g) * b,    b_j ~ Bernoulli(|g_j| / s),    s = max_j |g_j|,

which is unbiased, ``E[t] = g`` (the paper's stochastic ternarization). Two "gradient bounding"
techniques of the paper shrink ``s`` and with it the variance ``s |g_j| - g_j^2``: one scaler per
layer (each tensor is compressed on its own), and clipping each element to ``+-c * sigma`` with
``sigma`` the standard deviation of the layer's gradient and ``c = 2.5`` before ternarizing, which
makes ``t`` unbiased for the *clipped* gradient. Scaler sharing (in the paper's distributed
algorithm): every worker uses the MAX over workers of its scaler, so the average of the ``P``
ternary tensors is ``s * sum(codes) / P`` and the integer codes can be summed by an allreduce.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from lightning_gradcomp.core.compressors.base import Compressor, Payload, chunk_for
from lightning_gradcomp.core.compressors.draws import Draws
from lightning_gradcomp.core.compressors.kernels import clipped_scale, mean_of_summed_fields_
from lightning_gradcomp.core.compressors.planar import word_aligned
from lightning_gradcomp.core.compressors.ternary import (
    ENCODE_CHUNK,
    TERNARY_PACKING,
    TernaryPayload,
    own_wire,
    packed_nbytes,
    stochastic_ternary,
    working_dtype,
)
from lightning_gradcomp.core.fused import compiles_on
from lightning_gradcomp.core.validation import check_bool, check_number
from lightning_gradcomp.core.workspace import Scratch

#: Largest world size whose code sums fit in int8; above it the summable form is int32 (gloo has no int16).
INT8_WORLD_LIMIT = 127


def _summed_codes(payloads: Sequence[Payload], start: int, count: int) -> Tensor:
    """Every rank's codes ``[start, start + count)`` summed as integers (int8 holds up to 127 ranks' codes in
    ``{-1, 0, 1}``; int32 beyond)."""
    dtype = torch.int8 if len(payloads) <= INT8_WORLD_LIMIT else torch.int32
    total = payloads[0].code_range(start, count).to(dtype, copy=True)  # type: ignore[attr-defined]
    for payload in payloads[1:]:
        total += payload.code_range(start, count)  # type: ignore[attr-defined]
    return total


def one_scaler(payloads: Sequence[Payload]) -> Tensor | None:
    """The scaler (0-dim) every ternary payload of ``payloads`` was drawn with, or ``None`` when they do not share one.

    A payload drawn under the hook's shared scaler (Wen et al., 2017, Sec. 3.2: the MAX over ranks, the same number on
    every rank, which every rank's payload was drawn with) says so without a comparison, which on a GPU would wait for
    the device. Its scaler then absorbs ``0 * sum(scalers)``: the same number, unless some rank's scaler is not finite,
    and then a NaN, so that the mean is not finite either (as decoding each payload with its own scaler makes it).
    Without a shared scaler, the scalers are compared.
    """
    if not all(isinstance(p, TernaryPayload) for p in payloads):
        return None
    first = payloads[0]
    assert isinstance(first, TernaryPayload)
    if any(p.shared for p in payloads):  # type: ignore[attr-defined]
        scalers = torch.cat([p.scales.reshape(-1) for p in payloads])  # type: ignore[attr-defined]
        return first.scales[0] + 0 * scalers.sum()
    if all(torch.equal(p.scales, first.scales) for p in payloads[1:]):  # type: ignore[attr-defined]
        return first.scales[0]
    return None


class TernGradCompressor(Compressor):
    """TernGrad's stochastic ternarization: 2 bits per element plus one fp32 scaler per tensor.

    Per tensor ``g`` (in fp32 whatever the gradient's dtype):

    1. ``sigma = std(g)`` (population standard deviation); the clipping bound is ``c * sigma``.
    2. ``s = max |clip(g, -c*sigma, c*sigma)| = min(max|g|, c*sigma)``, this rank's scaler
       (:meth:`local_scale`); with scaler sharing the hook passes ``S = max over ranks of s``.
    3. element ``j`` is kept with probability ``|clip(g_j)| / S``: ``t_j = S * sign(g_j)`` if kept,
       else 0. So ``E[t] = clip(g)``, and ``E[t] = g`` when nothing is clipped.

    The draw keeps element ``j`` when ``U_j < |clip(g_j)| / S`` (the uniform *below* the
    probability), with ``U_j ~ U[0, 1)`` built exactly from one random byte and, for one element in
    256, a second uniform (:func:`~lightning_gradcomp.core.compressors.ternary.stochastic_ternary`).
    An all-zero gradient (``s = 0``) gives all-zero codes and no NaN. Elements beyond the bound have
    probability 1, so the clipped tensor is never built.

    Args:
        clip_sigma: ``c``, the clipping bound in standard deviations (paper: 2.5 for every model).
            0 disables clipping (then ``s = max|g|``). When ``sigma = 0`` (all elements equal,
            including one-element tensors) clipping is skipped, since it would erase the gradient.
        share_scale: the paper's scaler sharing. Required by the allreduce aggregator (integer
            codes are summed); with the allgather aggregator each rank may keep its own scaler
            (``False``), which avoids the extra variance a larger shared scaler brings.

    The payload is ``4 * ceil(d / 16) + 4`` bytes for ``d`` elements: 2-bit codes and the fp32 scaler.
    fp16/bf16 gradients are ternarized in fp32 and decoded back to their dtype; fp64 gradients are
    ternarized from their fp32 rounding (the scaler travels as fp32) and decoded in fp64.
    """

    name = "terngrad"
    takes_scratch = True

    def __init__(self, clip_sigma: float = 2.5, share_scale: bool = True) -> None:
        self.clip_sigma = check_number("clip_sigma", clip_sigma, 0, note="0 disables clipping")
        check_bool("share_scale", share_scale)
        self.share_scale = share_scale

    @property
    def unbiased(self) -> bool:  # type: ignore[override]
        """Only without clipping: with ``clip_sigma > 0``, ``E[t] = clip(g)``, not ``g`` (an element at
        12 sigma averages to 2.5 sigma), which is what the paper trades for a smaller variance."""
        return self.clip_sigma == 0

    @property
    def bias_reason(self) -> str | None:
        if self.unbiased:
            return None
        return "its clipping makes it unbiased only for the clipped gradient (use clip_sigma=0)"

    @property
    def shares_scale(self) -> bool:
        return self.share_scale

    def _prepare(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """The flat fp32 gradient and this rank's scaler ``min(max|g|, c * sigma)`` (0-dim fp32)."""
        g = x.detach().reshape(-1).to(torch.float32)
        if g.numel() == 0:
            return g, torch.zeros((), dtype=torch.float32, device=g.device)
        return g, clipped_scale(g, float(self.clip_sigma))

    def local_scale(self, x: Tensor) -> Tensor:
        """This rank's scaler ``max|clipped g|`` as a 0-dim float32 tensor."""
        return self._prepare(x)[1]

    def compress(
        self,
        x: Tensor,
        generator: Draws = None,
        scale: Tensor | None = None,
        local_scale: Tensor | None = None,
        scratch: Scratch | None = None,
    ) -> TernaryPayload:
        """Ternarize ``x`` with its own scaler, or with the shared ``scale`` (never below its own).

        ``local_scale``, when given, is this rank's :meth:`local_scale` of ``x`` (the hook computed it
        to agree on ``scale``), so its reductions do not run twice; the codes are drawn straight into their
        packed bytes behind the scaler, in the unit's kept buffer when there is ``scratch``.
        """
        if local_scale is None:
            g, local = self._prepare(x)
        else:
            g, local = x.detach().reshape(-1).to(torch.float32), local_scale.to(torch.float32).reshape(())
        if scale is None:
            used = local
        else:
            used = torch.maximum(scale.detach().to(device=g.device, dtype=torch.float32).reshape(()), local)
        # A shared scaler above this rank's own: clipped elements keep probability s / S, not |g| / S.
        cap = local if scale is not None and self.clip_sigma > 0 else None
        wire, scales, packed = own_wire(scratch, used.reshape(1), TERNARY_PACKING, g.numel())
        stochastic_ternary(g, used.reshape(1), max(1, g.numel()), generator, cap=cap, packed=packed)
        shared = scale is not None
        return TernaryPayload(None, scales, x.shape, x.dtype, max(1, g.numel()), shared, packed=packed, wire=wire)

    def unpack(self, buffer: Tensor, shape: torch.Size, dtype: torch.dtype) -> TernaryPayload:
        return TernaryPayload.from_bytes(buffer, shape, dtype, max(1, shape.numel()), 1)

    def payload_nbytes(self, shape: torch.Size, dtype: torch.dtype) -> int:
        return 4 + packed_nbytes(shape.numel())

    def decompress(self, payload: Payload) -> Tensor:
        assert isinstance(payload, TernaryPayload)
        return payload.dense(working_dtype(payload.dtype)).to(payload.dtype)

    def accumulate(self, payload: Payload, out: Tensor) -> Tensor:
        """Add ``codes * s`` into ``out``, computed in fp32 (fp64 for fp64) and rounded once."""
        assert isinstance(payload, TernaryPayload)
        return payload.add_to_(out)

    def accumulate_all(self, payloads: Sequence[Payload], out: Tensor) -> Tensor:
        """Every rank's codes summed as integers, times the shared scaler, rounded once.

        Under one shared scaler ``S`` this is ``round(sum(codes) * S)``, the same arithmetic as
        :meth:`from_sum` on the allreduced codes, so both aggregation paths give identical averages (compiled on
        CUDA, :meth:`average_all` may divide as a product with the reciprocal: one rounding apart);
        it also costs one integer add per rank instead of a floating-point pass. With per-rank
        scalers each payload is added on its own.
        """
        first = payloads[0]
        assert isinstance(first, TernaryPayload)
        shared = one_scaler(payloads)
        if shared is None:
            return super().accumulate_all(payloads, out)
        work = working_dtype(out.dtype)
        if out.dtype != work:  # half precision: the sum decoded whole, rounded to the gradient's dtype, then added
            total = _summed_codes(payloads, 0, first.numel)
            return TernaryPayload(total, shared.reshape(1), first.shape, first.dtype, first.block_size).add_to_(out)
        # chunk by chunk (received codes stay packed): the integer sum, times S (one rounding), added to out
        scale = shared.to(work)
        span = chunk_for(out.device, ENCODE_CHUNK)
        values = torch.empty(min(out.numel(), span), dtype=work, device=out.device)
        for start in range(0, out.numel(), span):
            n = min(span, out.numel() - start)
            total = values[:n].copy_(_summed_codes(payloads, start, n))
            out[start : start + n].addcmul_(total, scale)
        return out

    def average_all(self, payloads: Sequence[Payload], out: Tensor, world: int) -> Tensor:
        """The mean under one shared scaler: the codes' whole planar rows in one compiled pass where kernels run
        compiled (the codes summed as integers, scaled once, divided: :meth:`accumulate_all`'s roundings), the last,
        partial row eagerly; per-rank scalers as :meth:`accumulate_all` then a division."""
        packed = [p.packed for p in payloads if isinstance(p, TernaryPayload) and p.packed is not None]
        done = out.numel() // TERNARY_PACKING.row * TERNARY_PACKING.row
        fusable = done and len(packed) == len(payloads) and out.dtype == torch.float32 and compiles_on(out.device)
        shared = one_scaler(payloads) if fusable else None
        if shared is None:
            return super().average_all(payloads, out, world)
        scale, per_byte = shared.to(torch.float32), TERNARY_PACKING.per_byte
        codes = [word_aligned(c[: done // per_byte]) for c in packed]
        mean_of_summed_fields_(out[:done], codes, scale, per_byte, TERNARY_PACKING.bias)
        if done < out.numel():
            out[done:].copy_(_summed_codes(payloads, done, out.numel() - done)).mul_(scale).div_(world)
        return out

    @property
    def summable_across_ranks(self) -> bool:
        """Codes add up across ranks only under one shared scaler."""
        return self.share_scale

    def summable(self, payload: Payload, world_size: int, scratch: Scratch | None = None) -> Tensor:
        """The codes themselves (int8; int32 above 127 ranks): their sum times ``S / P`` is the average."""
        assert isinstance(payload, TernaryPayload)
        if not payload.shared:
            raise ValueError(
                "TernGrad codes can only be summed across ranks when every rank used the same scaler: "
                "use share_scale=True (the hook then passes the MAX over ranks as `scale`) or aggregator='allgather'"
            )
        # the allreduce sums in place: the codes unpacked into a buffer of their own (the unit's kept one)
        dtype = torch.int8 if world_size <= INT8_WORLD_LIMIT else torch.int32
        numel, device = payload.numel, payload.device
        if scratch is None:
            return payload.codes_into(torch.empty(numel, dtype=dtype, device=device))
        return payload.codes_into(scratch("codes", numel, dtype, device))

    def from_sum(self, total: Tensor, payload: Payload, world_size: int, out: Tensor | None = None) -> Tensor:
        """``round(sum(codes) * S) / P`` in the gradient's dtype (the same rounding as :meth:`accumulate`)."""
        assert isinstance(payload, TernaryPayload)
        work = working_dtype(payload.dtype)
        scale = payload.scales[0].to(work)
        if out is not None and work == payload.dtype:  # in the kept buffer: the same two roundings, no allocation
            return out.copy_(total).mul_(scale).div_(world_size)
        return (total.to(work) * scale).to(payload.dtype).div_(world_size)

    def preferred_aggregator(self, world_size: int) -> str:
        """The path moving fewer bytes: allgather hands ``(P-1) d / 4`` bytes, ring allreduce of int8 ~``2 d``.

        Allgather while ``(P - 1) / 4 < 2`` (up to 8 ranks), allreduce beyond (it needs a shared
        scaler: without ``share_scale`` it is always allgather).
        """
        if not self.share_scale or (world_size - 1) / 4 < 2:
            return "allgather"
        return "allreduce"
