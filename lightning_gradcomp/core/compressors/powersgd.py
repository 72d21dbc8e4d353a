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
that a half-precision wire, :mod:`~lightning_gradcomp.core.compressors.precision`, cannot overflow),
so the allreduce aggregator runs them (:meth:`PowerSGDCompressor.next_summable`); the compressor
never touches a process group. A unit of several parameters sends all its matrices' ``P`` in one
round and all their ``Q`` in the next (the hook passes the parameters' shapes), so a model costs
two collectives per unit, not per matrix. A payload stands for ``M^`` once both rounds are done,
so error feedback keeps ``e = M - M^``, the residual against the shared estimate, as in
Algorithm 2 with ``DECOMPRESS`` of the aggregate and as PyTorch's hook does. Matrices the rank
does not shrink enough (``(n + m) r * min_compression_rate >= n m``, PyTorch's rule) and vectors
are summed exactly, in the first round. Deliberate
differences from PyTorch's hook are listed in :class:`PowerSGDCompressor`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from lightning_gradcomp.core.compressors.base import Compressor, Payload
from lightning_gradcomp.core.compressors.draws import Draws
from lightning_gradcomp.core.compressors.finiteness import finiteness
from lightning_gradcomp.core.compressors.identity import DensePayload, IdentityCompressor
from lightning_gradcomp.core.validation import check_int, check_number
from lightning_gradcomp.core.workspace import Scratch


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


@dataclass(frozen=True)
class _Part:
    """One parameter of a unit, sent as a rank-``r`` approximation (``matrix``, ``q``) or dense (``matrix`` None).

    ``span`` is where it sits in the unit's flat tensor, ``first`` where it sits in the first
    round's summand (its values when dense, its ``P`` else), ``second`` where its ``M^T P^`` sits
    in the second round's (matrices only).
    """

    span: slice
    values: Tensor
    first: slice
    matrix: Tensor | None = None
    q: Tensor | None = None
    second: slice | None = None


@dataclass(eq=False)
class LowRankPayload(Payload):
    """One rank's part in PowerSGD's two rounds for a unit's tensors, and once they are done the average.

    The first round sums ``first`` (every matrix's ``M Q`` and every dense tensor's values, in the
    parts' order), the second every matrix's ``M^T P^``: one collective per round for the whole
    unit. ``warm_start`` is the unit's ``Q`` (every matrix's, flat and concatenated; the parts' ``q``
    are views of it), which the second round's mean replaces. ``nbytes`` is what the two rounds
    send: ``(n + m) r`` values per matrix, and the dense tensors.
    """

    shape: torch.Size
    parts: tuple[_Part, ...]
    first: Tensor
    second_numel: int
    warm_start: Tensor
    epsilon: float
    first_total: Tensor | None = field(default=None)
    p_hats: list[Tensor] = field(default_factory=list)
    mean: Tensor | None = field(default=None)

    @property
    def dtype(self) -> torch.dtype:  # type: ignore[override]
        return self.first.dtype

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return self.first.device

    @property
    def nbytes(self) -> int:
        return self.wire_nbytes(self.first.element_size())

    def wire_nbytes(self, float_itemsize: int) -> int:
        return (self.first.numel() + self.second_numel) * float_itemsize

    def to_bytes(self) -> Tensor:
        raise TypeError("PowerSGD's two messages are all-reduced one after the other; they have no single wire form")

    def estimate(self) -> Tensor:
        """The average over ranks, flat: ``P^ Q-^T`` for each matrix, the mean of each dense tensor."""
        if self.mean is None:
            raise RuntimeError("the PowerSGD payload has not been aggregated yet (its rounds are not done)")
        return self.mean

    def sent(self) -> Tensor:
        """What of this rank's tensor reached the average: each matrix's shared ``P^ Q-^T`` (what error
        feedback subtracts, as in Algorithm 2) and each dense tensor whole (it was summed exactly)."""
        estimate = self.estimate()
        dense = [part for part in self.parts if part.matrix is None]
        if not dense:
            return estimate
        sent = estimate.clone()
        for part in dense:
            sent[part.span].copy_(part.values)
        return sent


class PowerSGDCompressor(Compressor):
    """Low-rank approximation of each matrix by a warm-started power iteration (PowerSGD), two allreduces per unit.

    Use it with ``memory="ef"`` (the paper's error feedback) and the allreduce aggregator. A unit of
    several parameters (``granularity="group"``) is compressed matrix by matrix, and its matrices'
    ``P`` (then ``Q``) travel in one allreduce, as PyTorch batches a bucket's.

    Args:
        rank: the approximation rank ``r`` (PyTorch's ``matrix_approximation_rank``); a matrix gets
            ``min(n, m, rank)``.
        min_compression_rate: a matrix is compressed only if ``n m > (n + m) r *
            min_compression_rate`` (PyTorch's rule and default); others are sent dense.
        epsilon: added to each column's norm in the orthogonalisation (PyTorch's
            ``orthogonalization_epsilon``).

    Differences from PyTorch's ``powerSGD_hook`` (``warm_start=True``, ``use_error_feedback=True``),
    each deliberate:

    * state (``Q`` and the residual) is kept per unit and parameter, not per DDP bucket, so it
      survives the bucket rebuild after the first step and a restart (PyTorch needs
      ``start_powerSGD_iter > 1`` for that reason); the initial ``Q`` is drawn per unit from the
      strategy's seed;
    * what one allreduce carries is a unit, fixed by the parameters, not a bucket: over three or
      more ranks a float sum depends on where an element sits in the reduced tensor, which would
      tie the result to DDP's bucket layout;
    * matrices too small to gain are summed with the first round's ``P``'s (PyTorch reduces them in
      an allreduce of their own) and keep no residual (PyTorch keeps ``local - mean`` for them,
      which the mean cancels);
    * with ``epsilon=0`` a zero column stays zero instead of turning the estimate into NaN.
    """

    name = "powersgd"
    unbiased = False
    takes_shapes = True
    gatherable = False
    warm_started = True
    float_wire = True

    def __init__(self, rank: int = 1, min_compression_rate: float = 2.0, epsilon: float = 0.0) -> None:
        self.rank = check_int("rank", rank, 1, note="the approximation rank r")
        self.min_compression_rate = check_number("min_compression_rate", min_compression_rate, 1)
        self.epsilon = check_number("epsilon", epsilon, 0)
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
        self, shapes: tuple[torch.Size, ...], dtype: torch.dtype, device: torch.device, generator: torch.Generator
    ) -> Tensor | None:
        """Every matrix's ``Q`` (``m x r``) drawn in turn from a standard normal with ``generator`` (seeded
        alike on every rank), flat and concatenated; ``None`` when the unit has no matrix to approximate."""
        qs = []
        for shape in shapes:
            r = self.factor_rank(shape)
            if r is not None:
                m = shape.numel() // shape[0]
                qs.append(torch.randn(m * r, generator=generator, device=generator.device, dtype=torch.float32))
        return torch.cat(qs).to(device=device, dtype=dtype) if qs else None

    def compress(
        self,
        x: Tensor,
        generator: Draws = None,
        scale: Tensor | None = None,
        warm_start: Tensor | None = None,
        shapes: tuple[torch.Size, ...] | None = None,
    ) -> Payload:
        """``P = M Q`` for each matrix of ``x`` (``x`` itself, or the flat concatenation of tensors of
        ``shapes``), with ``Q = orthogonalize(warm_start)`` (in place, as PyTorch does)."""
        shapes = (x.shape,) if shapes is None else tuple(shapes)
        if sum(shape.numel() for shape in shapes) != x.numel():
            raise ValueError(f"shapes {[tuple(s) for s in shapes]} do not add up to the {x.numel()} elements of x")
        ranks = [self.factor_rank(shape) for shape in shapes]
        if all(r is None for r in ranks):
            return self._dense.compress(x)
        q_numel = sum(shape.numel() // shape[0] * r for shape, r in zip(shapes, ranks, strict=True) if r)
        if warm_start is None or warm_start.numel() != q_numel:
            raise ValueError(
                f"PowerSGD needs the unit's warm start Q ({q_numel} values for shapes {[tuple(s) for s in shapes]}), "
                f"got {None if warm_start is None else tuple(warm_start.shape)}"
            )
        flat, q_flat = x.reshape(-1), warm_start.view(-1)
        parts, offset, first, second = [], 0, 0, 0
        for shape, r in zip(shapes, ranks, strict=True):
            span = slice(offset, offset + shape.numel())
            values = flat[span]
            if r is None:
                parts.append(_Part(span, values, slice(first, first + values.numel())))
                first += values.numel()
            else:
                n, m = shape[0], shape.numel() // shape[0]
                q = orthogonalize_(q_flat[second : second + m * r].view(m, r), self.epsilon)
                parts.append(
                    _Part(
                        span, values, slice(first, first + n * r), values.view(n, m), q, slice(second, second + m * r)
                    )
                )
                first, second = first + n * r, second + m * r
            offset = span.stop
        summand = torch.empty(first, dtype=x.dtype, device=x.device)
        for part in parts:
            if part.matrix is None:
                summand[part.first].copy_(part.values)
            else:
                assert part.q is not None
                torch.matmul(part.matrix, part.q, out=summand[part.first].view(-1, part.q.shape[1]))
        return LowRankPayload(x.shape, tuple(parts), summand, second, q_flat, self.epsilon)

    def summable(self, payload: Payload, world_size: int, scratch: Scratch | None = None) -> Tensor:
        if isinstance(payload, DensePayload):
            return self._dense.summable(payload, world_size, scratch)
        assert isinstance(payload, LowRankPayload)
        return payload.first.div_(world_size)

    def next_summable(self, payload: Payload, total: Tensor, world_size: int) -> Tensor | None:
        """After the first round's sum: ``M^T orthogonalize(P)`` for each matrix; after the second: done."""
        if not isinstance(payload, LowRankPayload) or payload.first_total is not None:
            return None
        payload.first_total = total
        summand = torch.empty(payload.second_numel, dtype=payload.dtype, device=payload.device)
        for part in payload.parts:
            if part.matrix is not None:
                assert part.q is not None and part.second is not None
                r = part.q.shape[1]
                p_hat = orthogonalize_(total[part.first].view(-1, r), payload.epsilon)
                payload.p_hats.append(p_hat)
                # M^T P as (P^T M)^T: the product streams over M's rows as stored (a transposed M is read
                # across its rows, about 12 times slower on one CPU thread at 4096 x 4096: benchmarks/kernel_costs.py)
                summand[part.second].view(-1, r).copy_(torch.matmul(p_hat.T, part.matrix).T)
        return summand.div_(world_size)

    def from_sum(self, total: Tensor, payload: Payload, world_size: int, out: Tensor | None = None) -> Tensor:
        """``P^ Q-^T`` for each matrix, the first round's mean for each dense tensor; ``Q-`` becomes the warm
        start (unless it is not finite: a NaN would stay forever)."""
        if isinstance(payload, DensePayload):
            return total
        assert isinstance(payload, LowRankPayload) and payload.first_total is not None
        mean = out if out is not None else torch.empty(payload.numel, dtype=payload.dtype, device=payload.device)
        p_hats = iter(payload.p_hats)
        for part in payload.parts:
            target = mean[part.span]
            if part.matrix is None:
                target.copy_(payload.first_total[part.first])
            else:
                assert part.second is not None
                p_hat = next(p_hats)
                q_mean = total[part.second].view(-1, p_hat.shape[1])
                torch.matmul(p_hat, q_mean.T, out=target.view(p_hat.shape[0], -1))
        finite = finiteness(total)  # on a device, a flag there: the warm start is kept by it, no wait
        if finite is not False:
            for part in payload.parts:  # a matrix whose mean Q is zero (no rank's M had anything) keeps its Q:
                if part.second is not None:  # from Q = 0, P = M Q would stay zero whatever M became
                    kept, mean_q = payload.warm_start[part.second], total[part.second]
                    taken = mean_q.any() if finite is True else mean_q.any() & finite
                    kept.copy_(torch.where(taken, mean_q, kept))
        payload.mean = mean
        return mean

    def unpack(self, buffer: Tensor, shape: torch.Size, dtype: torch.dtype) -> Payload:
        raise TypeError("PowerSGD payloads are all-reduced in two rounds, never gathered as bytes")

    def accumulate(self, payload: Payload, out: Tensor) -> Tensor:
        return out.add_(self.decompress(payload))

    def decompress(self, payload: Payload) -> Tensor:
        """What of this rank's tensor reached the average (:meth:`LowRankPayload.sent`)."""
        if isinstance(payload, DensePayload):
            return payload.values
        assert isinstance(payload, LowRankPayload)
        return payload.sent()

    def preferred_aggregator(self, world_size: int) -> str:
        return "allreduce"
