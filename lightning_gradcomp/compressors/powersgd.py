"""PowerSGD: a rank-``r`` approximation of each gradient matrix by one warm-started power iteration.

Vogels, Karimireddy and Jaggi, "PowerSGD: Practical Low-Rank Gradient Compression for Distributed
Optimization", NeurIPS 2019, Algorithm 1. For a matrix ``M`` (``n x m``; a parameter's gradient
plus its error-feedback residual, viewed as ``(shape[0], -1)`` as PyTorch's ``powerSGD_hook``
does) and the warm start ``Q`` (``m x r``, the same on every rank):

1. ``P = M Q``, averaged over ranks (first round; PyTorch sums, and the orthogonalisation
   makes the two the same up to rounding);
2. ``P^ = orthogonalize(P)`` (Gram-Schmidt for ``r <= 2``, else QR, as PyTorch does);
3. ``Q_i = M^T P^``, averaged over ranks (second round): ``Q-``;
4. ``M^ = P^ Q-^T``, the estimate every rank applies; ``Q-`` is the next step's warm start
   (Sec. 3, "warm start"), orthogonalised again before use.

Both rounds are sums of float tensors, each share divided by the world size before the sum (so
that a half-precision wire, :mod:`~lightning_gradcomp.compressors.precision`, cannot overflow),
so the allreduce aggregator runs them
(:meth:`PowerSGDCompressor.next_summable`); the compressor never touches a process group. A
payload stands for ``M^`` once both rounds are done, so error feedback keeps ``e = M - M^``, the
residual against the shared estimate, as in Algorithm 2 with ``DECOMPRESS`` of the aggregate and
as PyTorch's hook does. Matrices the rank does not shrink enough (``(n + m) r *
min_compression_rate >= n m``, PyTorch's rule) and vectors go dense in one round. Deliberate
differences from PyTorch's hook are listed in :class:`PowerSGDCompressor`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

from lightning_gradcomp.compressors.base import Compressor, Payload, all_finite
from lightning_gradcomp.compressors.identity import DensePayload, IdentityCompressor


def orthogonalize_(matrix: Tensor, epsilon: float = 0.0) -> Tensor:
    """Orthonormalise the columns of the ``n x r`` ``matrix`` in place (Algorithm 1, ``ORTHOGONALIZE``).

    Gram-Schmidt for ``r <= 2`` or half precision, else a QR factorisation: PyTorch's choice, so that
    the two agree to float rounding. ``epsilon`` is added to each column's norm, as in PyTorch; with
    ``epsilon=0`` a zero column (a layer with no gradient) stays zero instead of becoming NaN.
    """
    rank = matrix.shape[1]
    if rank <= 2 or matrix.dtype in (torch.float16, torch.bfloat16):
        for i in range(rank):
            column = matrix[:, i : i + 1]
            norm = torch.linalg.vector_norm(column)
            column.div_(norm + epsilon if epsilon else norm.clamp_min(torch.finfo(matrix.dtype).tiny))
            if i + 1 < rank:
                rest = matrix[:, i + 1 :]
                rest.sub_((column * rest).sum(dim=0, keepdim=True) * column)
        return matrix
    return matrix.copy_(torch.linalg.qr(matrix).Q)


@dataclass(eq=False)
class LowRankPayload(Payload):
    """One rank's part in PowerSGD's two rounds for one matrix, and once they are done the estimate ``P^ Q-^T``.

    ``p`` is this rank's ``M Q`` (reduced in place by the first round), ``q`` the warm start that the
    second round's mean replaces. ``nbytes`` is what the two rounds send, ``(n + m) r`` values.
    """

    matrix: Tensor
    p: Tensor
    q: Tensor
    shape: torch.Size
    epsilon: float
    p_hat: Tensor | None = field(default=None)
    q_mean: Tensor | None = field(default=None)

    @property
    def dtype(self) -> torch.dtype:  # type: ignore[override]
        return self.matrix.dtype

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return self.matrix.device

    @property
    def nbytes(self) -> int:
        return self.wire_nbytes(self.matrix.element_size())

    def wire_nbytes(self, float_itemsize: int) -> int:
        return (self.p.numel() + self.q.numel()) * float_itemsize

    def to_bytes(self) -> Tensor:
        raise TypeError("PowerSGD's two messages are all-reduced one after the other; they have no single wire form")

    def estimate(self) -> Tensor:
        """``P^ Q-^T``, flat (after both rounds)."""
        if self.p_hat is None or self.q_mean is None:
            raise RuntimeError("the PowerSGD payload has not been aggregated yet (its rounds are not done)")
        return (self.p_hat @ self.q_mean.T).reshape(-1)


class PowerSGDCompressor(Compressor):
    """Low-rank approximation of each matrix by a warm-started power iteration (PowerSGD), two allreduces each.

    Use it with ``memory="ef"`` (the paper's error feedback) and the allreduce aggregator.

    Args:
        rank: the approximation rank ``r`` (PyTorch's ``matrix_approximation_rank``); a matrix gets
            ``min(n, m, rank)``.
        min_compression_rate: a matrix is compressed only if ``n m > (n + m) r *
            min_compression_rate`` (PyTorch's rule and default); others are sent dense.
        epsilon: added to each column's norm in the orthogonalisation (PyTorch's
            ``orthogonalization_epsilon``).

    Differences from PyTorch's ``powerSGD_hook`` (``warm_start=True``, ``use_error_feedback=True``),
    each deliberate:

    * state (``Q`` and the residual) is kept per parameter, not per DDP bucket, so it survives the
      bucket rebuild after the first step and a restart (PyTorch needs ``start_powerSGD_iter > 1``
      for that reason); the initial ``Q`` is drawn per parameter from the strategy's seed;
    * every matrix's ``P`` and ``Q`` is all-reduced on its own, not batched per bucket: over three or
      more ranks a float sum depends on where an element sits in the reduced tensor, which would
      tie the result to DDP's bucket layout;
    * matrices too small to gain are averaged densely without error feedback (PyTorch keeps a
      residual ``local - mean`` for them too, which the mean cancels);
    * with ``epsilon=0`` a zero column stays zero instead of turning the estimate into NaN.
    """

    name = "powersgd"
    unbiased = False
    needs_layer_shape = True
    gatherable = False
    warm_started = True
    float_wire = True

    def __init__(self, rank: int = 1, min_compression_rate: float = 2.0, epsilon: float = 0.0) -> None:
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            raise ValueError(f"rank must be a positive integer (the approximation rank r), got {rank!r}")
        if (
            isinstance(min_compression_rate, bool)
            or not isinstance(min_compression_rate, (int, float))
            or not math.isfinite(min_compression_rate)
            or min_compression_rate < 1
        ):
            raise ValueError(f"min_compression_rate must be a number >= 1, got {min_compression_rate!r}")
        if isinstance(epsilon, bool) or not isinstance(epsilon, (int, float)) or not 0 <= epsilon < math.inf:
            raise ValueError(f"epsilon must be a finite number >= 0, got {epsilon!r}")
        self.rank = rank
        self.min_compression_rate = float(min_compression_rate)
        self.epsilon = float(epsilon)
        self._dense = IdentityCompressor()

    @property
    def bias_reason(self) -> str:
        return "a rank-r approximation is deterministic given Q and drops the rest of the spectrum"

    def factor_rank(self, shape: torch.Size) -> int | None:
        """The rank a tensor of ``shape`` is approximated with, or ``None`` when it is sent dense."""
        if len(shape) < 2:
            return None
        n = shape[0]
        m = shape.numel() // n if n else 0
        r = min(n, m, self.rank)
        return r if (n + m) * r * self.min_compression_rate < n * m else None

    def initial_state(
        self, shape: torch.Size, dtype: torch.dtype, device: torch.device, generator: torch.Generator
    ) -> Tensor | None:
        """``Q`` (``m x r``) drawn from a standard normal with ``generator`` (seeded alike on every rank)."""
        r = self.factor_rank(shape)
        if r is None:
            return None
        m = shape.numel() // shape[0]
        q = torch.randn(m, r, generator=generator, device=generator.device, dtype=torch.float32)
        return q.to(device=device, dtype=dtype)

    def compress(
        self,
        x: Tensor,
        generator: torch.Generator | None = None,
        scale: Tensor | None = None,
        warm_start: Tensor | None = None,
    ) -> Payload:
        """``P = M Q`` with ``Q = orthogonalize(warm_start)`` (orthogonalised in place, as PyTorch does)."""
        if self.factor_rank(x.shape) is None:
            return self._dense.compress(x)
        if warm_start is None:
            raise ValueError(f"PowerSGD needs the unit's warm start Q for a tensor of shape {tuple(x.shape)}")
        matrix = x.reshape(x.shape[0], -1)
        q = orthogonalize_(warm_start, self.epsilon)
        return LowRankPayload(matrix, matrix @ q, q, x.shape, self.epsilon)

    def summable(self, payload: Payload, world_size: int) -> Tensor:
        if isinstance(payload, DensePayload):
            return self._dense.summable(payload, world_size)
        assert isinstance(payload, LowRankPayload)
        return payload.p.view(-1).div_(world_size)

    def next_summable(self, payload: Payload, total: Tensor, world_size: int) -> Tensor | None:
        """After ``P``'s sum: ``Q_i = M^T orthogonalize(P)``; after ``Q``'s sum: done."""
        if not isinstance(payload, LowRankPayload) or payload.p_hat is not None:
            return None
        payload.p_hat = orthogonalize_(total.view(payload.p.shape), payload.epsilon)
        return (payload.matrix.T @ payload.p_hat).view(-1).div_(world_size)

    def from_sum(self, total: Tensor, payload: Payload, world_size: int) -> Tensor:
        """``P^ Q-^T``; ``Q-`` becomes the warm start (unless it is not finite: a NaN would stay forever)."""
        if isinstance(payload, DensePayload):
            return total
        assert isinstance(payload, LowRankPayload)
        q_mean = total.view(payload.q.shape)
        payload.q_mean = q_mean
        if all_finite(q_mean):
            payload.q.copy_(q_mean)
        return payload.estimate()

    def unpack(self, buffer: Tensor, shape: torch.Size, dtype: torch.dtype) -> Payload:
        raise TypeError("PowerSGD payloads are all-reduced in two rounds, never gathered as bytes")

    def accumulate(self, payload: Payload, out: Tensor) -> Tensor:
        if isinstance(payload, DensePayload):
            return out.add_(payload.values)
        assert isinstance(payload, LowRankPayload)
        return out.add_(payload.estimate())

    def decompress(self, payload: Payload) -> Tensor:
        if isinstance(payload, DensePayload):
            return payload.values
        assert isinstance(payload, LowRankPayload)
        return payload.estimate()

    def preferred_aggregator(self, world_size: int) -> str:
        return "allreduce"
