"""State carried between steps, per parameter name: nothing, an error-feedback residual, or DIANA's shifts.

The hook calls, for each compressed parameter ``name`` and step:

1. ``x = memory.compensate(name, grad)``: the tensor handed to the compressor (the hook calls
   :meth:`Memory.compensate_`, which does the same in place in the tensor it is handed: each
   parameter's gradient in DDP's bucket, or its share of the hook's kept flat copy of a unit of
   several parameters, overwritten with the average afterwards, so no tensor is allocated per step);
2. ``memory.reconstruct(name, mean)``: after aggregation, the gradient the optimizer sees, from
   the averaged result ``mean`` and the state as it was before this step;
3. ``memory.update(name, x, sent, mean, unit_numel=n)``: then the state moves on, with ``sent``
   what of this rank's payload reached the global result (a dense tensor, or
   :class:`~lightning_gradcomp.core.compressors.Entries`: a sparse payload's entries, a ternary
   payload's codes, added into the state without a dense copy), and ``n`` the size of the unit
   the parameter was compressed in (constants such as DIANA's ``alpha`` follow the unit as it
   was compressed, not the parameter).

The hook runs step 3 in two halves around the decoding of the mean, so that the mean can be written
over the compensated tensor in DDP's bucket with no buffer of its own: :meth:`Memory.settle_` first
(what follows from this rank's own payload: error feedback's residual, DIANA's ``h_i``; kept only when
the mean is finite, which on a device is a flag left there:
:mod:`~lightning_gradcomp.core.compressors.finiteness`), then, with the mean in the bucket,
:meth:`Memory.conclude_` (step 2, written in place, and what follows from the mean: DIANA's ``h``).

State is keyed by parameter name: units are made of parameters, and DDP's buckets change.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, ClassVar

import torch
from torch import Tensor

from lightning_gradcomp.core.compressors import Entries, SparseEntries, all_finite
from lightning_gradcomp.core.compressors.base import STREAM_CHUNK, chunk_for
from lightning_gradcomp.core.compressors.finiteness import Finite, all_of, finiteness, keep_where_
from lightning_gradcomp.core.compressors.kernels import shift_and_estimate_
from lightning_gradcomp.core.compressors.sparse import dense_of
from lightning_gradcomp.core.fused import compiles_on
from lightning_gradcomp.core.validation import check_choice, check_number

Sent = Tensor | Entries


class Memory(ABC):
    """Per-parameter compression state.

    ``uses_sent``: whether :meth:`update` reads what was sent (a memoryless method does not: the
    hook then never decodes the local payload for it and passes ``None``). ``keeps_state``: whether
    there is state a non-finite average must not reach (the hook only checks the average then).
    """

    name: ClassVar[str]
    uses_sent: ClassVar[bool] = True
    keeps_state: ClassVar[bool] = True

    @abstractmethod
    def compensate(self, name: str, grad: Tensor) -> Tensor:
        """The tensor to compress for parameter ``name`` this step (``grad`` is flat)."""

    def compensate_(self, name: str, x: Tensor) -> Tensor:
        """:meth:`compensate` in place in the flat ``x`` (the hook's path); returns ``x``."""
        return x.copy_(self.compensate(name, x))

    @abstractmethod
    def update(self, name: str, compensated: Tensor, sent: Sent, mean: Tensor, unit_numel: int | None = None) -> None:
        """Record what happened to ``compensated``: ``sent`` reached the result, averaged to ``mean``.

        ``unit_numel`` is the size of the unit ``name`` was compressed in (``None``: the parameter alone).
        """

    def reconstruct(self, name: str, mean: Tensor) -> Tensor:
        """The gradient estimate for the optimizer from the aggregated ``mean``."""
        return mean

    def flush_(self, name: str, grad: Tensor) -> None:
        """A dense step (averaged as DDP does) sends the whole of ``grad``: add into it, in place, what this state
        still owes the optimizer, and clear that. Default: nothing is owed (DIANA's shifts learn the gradient
        itself and stay as they are)."""
        return None

    def settle_(self, name: str, compensated: Tensor, sent: Sent, unit_numel: int, finite: Finite = True) -> None:
        """The hook's first half of :meth:`update`: what follows from this rank's own step alone (``compensated``
        and ``sent``), run before the mean is decoded, which may then be written over ``compensated`` (DDP's
        bucket, which this may use as scratch). ``finite``: whether the mean is finite (a flag on a device); the state
        moves only if it is. Default: :meth:`update` without a mean, after reading ``finite`` back (a memory whose
        update reads the mean overrides both halves, as :class:`Diana` does)."""
        if finite:
            self.update(name, compensated, sent, None, unit_numel=unit_numel)  # type: ignore[arg-type]

    def conclude_(self, name: str, mean: Tensor, out: Tensor, unit_numel: int, update: Finite) -> None:
        """The hook's second half: write :meth:`reconstruct` of ``mean`` into ``out`` (the gradient in DDP's
        bucket, which may be ``mean`` itself) and, when ``update`` (the mean's finiteness: a flag on a device), move
        the state that follows the mean (DIANA's ``h``). Default: :meth:`reconstruct` of the mean, copied unless it
        is ``out`` already."""
        estimate = self.reconstruct(name, mean)
        if out.data_ptr() != estimate.data_ptr():
            out.copy_(estimate)

    def norm(self) -> float | None:
        """L2 norm of this rank's per-rank state over all parameters (``None`` when stateless)."""
        tensors = self.local_state()
        if not tensors:
            return None
        return float(torch.stack([t.float().norm() for t in tensors]).norm())

    def local_state(self) -> list[Tensor]:
        """The per-rank tensors :meth:`norm` measures (residuals, DIANA's ``h_i``)."""
        return []

    @abstractmethod
    def state_dict(self) -> dict[str, Tensor]:
        """This rank's state, by parameter name: the live tensors, as ``nn.Module.state_dict`` gives
        them (clone them to keep a snapshot), so that saving costs no copy of a model-sized state."""

    @abstractmethod
    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        """Restore what :meth:`state_dict` returned."""


class NoMemory(Memory):
    """Memoryless: compress the gradient itself (``memory="none"``)."""

    name = "none"
    uses_sent = False
    keeps_state = False

    def compensate(self, name: str, grad: Tensor) -> Tensor:
        return grad

    def compensate_(self, name: str, x: Tensor) -> Tensor:
        return x

    def update(self, name: str, compensated: Tensor, sent: Sent, mean: Tensor, unit_numel: int | None = None) -> None:
        return None

    def state_dict(self) -> dict[str, Tensor]:
        return {}

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        if state:
            raise ValueError(f"memory 'none' holds no state, got entries for {sorted(state)}")


class ErrorFeedback(Memory):
    """Error feedback (``memory="ef"``): ``acc = grad + decay * residual``; ``residual = acc - sent``.

    What a biased compressor drops is added to the next step's gradient instead of being lost
    (Shi et al., ICDCS 2019, Algorithm 1). For a sparsifier ``sent`` equals
    ``acc`` where it is nonzero, so ``sent + residual == acc`` holds exactly. A non-finite ``acc``
    leaves the residual as it was.

    Args:
        momentum: DGC's momentum correction (Lin et al., ICLR 2018, Sec. 3.2) when positive: each
            rank keeps a velocity ``u = momentum * u + grad`` and accumulates the velocity instead
            of the gradient, ``acc = u + residual``, and both ``u`` and the residual are zeroed
            where entries were sent (momentum factor masking), so the sparse updates add up to
            what momentum SGD would apply. The momentum is then applied here, before
            sparsification: the optimizer must be plain SGD without momentum.
        decay: ``beta`` of SparseLoCo's error feedback (Sarfi et al., 2025, arXiv 2508.15706, Algorithm 1): the
            residual is scaled by it before the new tensor is added, ``acc = grad + beta * residual``, so what
            was never sent fades instead of waiting forever (their outer steps replace momentum by this buffer).
            ``1`` (the default) is plain error feedback; in (0, 1], and 1 under momentum correction.
    """

    name = "ef"

    def __init__(self, momentum: float = 0.0, decay: float = 1.0) -> None:
        self.momentum = check_number("memory 'ef': momentum", momentum, 0, 1, open_max=True)
        self.decay = check_number("memory 'ef': decay", decay, 0, 1, open_min=True)
        if self.momentum and self.decay != 1:
            raise ValueError(
                f"memory 'ef': decay={decay} with momentum={momentum}: momentum correction reads its velocity back "
                "from an undecayed residual; use one or the other"
            )
        self._residuals: dict[str, Tensor] = {}
        self._velocities: dict[str, Tensor] = {}

    def _check_shape(self, name: str, x: Tensor) -> None:
        for what, state in (("residual", self._residuals), ("velocity", self._velocities)):
            if name in state and state[name].shape != x.shape:
                raise ValueError(
                    f"{what} for {name!r} has shape {tuple(state[name].shape)} but its gradient has {tuple(x.shape)}"
                )

    def compensate(self, name: str, grad: Tensor) -> Tensor:
        return self.compensate_(name, grad.clone())

    def compensate_(self, name: str, x: Tensor) -> Tensor:
        self._check_shape(name, x)
        if self.momentum:
            velocity = self._velocities.get(name)
            if velocity is None:
                velocity = self._velocities[name] = torch.zeros_like(x)
            x.add_(velocity, alpha=self.momentum)  # u = momentum * u + grad, kept in x until update
        residual = self._residuals.get(name)
        return x if residual is None else x.add_(residual, alpha=self.decay)

    def update(self, name: str, compensated: Tensor, sent: Sent, mean: Tensor, unit_numel: int | None = None) -> None:
        """``residual = compensated - sent`` (``mean`` is not read: the hook settles this before it decodes the mean
        over ``compensated``)."""
        vouched = not isinstance(sent, Tensor) and sent.vouches_finite
        if not (sent.all_finite() if vouched else all_finite(compensated)):  # type: ignore[union-attr]
            return  # a NaN/Inf that was never sent must not sit in the residual forever
        self._record(name, compensated, sent)

    def settle_(self, name: str, compensated: Tensor, sent: Sent, unit_numel: int, finite: Finite = True) -> None:
        """:meth:`update` as the hook calls it, kept only where the mean is ``finite``: a sent form that vouches for
        the tensor's finiteness (a scaled sign's scale, Top-k's largest entries) is this rank's share of that mean, so
        it is finite and so was the tensor; nothing is read again. Else the tensor is summed too. Where ``finite`` is a
        flag on a device, the new residual is kept by it (:meth:`_record_where`: no wait for the device)."""
        if isinstance(sent, Tensor) or not sent.vouches_finite:
            finite = all_of((finite, finiteness(compensated)))
        if finite is True:
            self._record(name, compensated, sent)
        elif finite is not False:
            self._record_where(finite, name, compensated, sent)

    def _record(self, name: str, compensated: Tensor, sent: Sent) -> None:
        """``residual = compensated - sent`` (and momentum correction's velocity), both known finite."""
        residual = self._residuals.get(name)
        if self.momentum:
            # the new velocity is what compensate_ added to the gradient: acc - old residual
            velocity = self._velocities[name]
            if residual is None:
                velocity.copy_(compensated)
            else:
                torch.sub(compensated, residual, out=velocity)  # one pass
        if residual is None or residual.shape != compensated.shape or residual.dtype != compensated.dtype:
            residual = self._residuals[name] = torch.empty_like(compensated)  # allocated once
        if isinstance(sent, Tensor):
            torch.sub(compensated, sent, out=residual)
        else:  # sparse: a copy and k entries, acc - acc, exactly 0; scaled signs: one fused pass where compiled
            sent.subtract_from(compensated, out=residual)
        if self.momentum:
            _zero_where_sent(self._velocities[name], sent)

    def _record_where(self, finite: Tensor, name: str, compensated: Tensor, sent: Sent) -> None:
        """:meth:`_record` kept where the device flag ``finite`` is true, else the state as it was: ``compensated -
        sent`` is formed in ``compensated`` itself (the bucket, written over by the mean next), then selected into
        the residual in one pass (a dense ``sent`` and momentum's velocity take a temporary of the parameter)."""
        residual = self._residuals.get(name)
        if residual is None or residual.shape != compensated.shape or residual.dtype != compensated.dtype:
            residual = self._residuals[name] = torch.zeros_like(compensated)  # allocated once; zeros: no residual yet
        if self.momentum:
            velocity = self._velocities[name]
            keep_where_(finite, compensated - residual, velocity)
        if isinstance(sent, Tensor):
            keep_where_(finite, compensated - sent, residual)
        else:
            keep_where_(finite, sent.add_to_(compensated, alpha=-1), residual)
        if self.momentum:
            _zero_where_sent(velocity, sent, finite)

    def flush_(self, name: str, grad: Tensor) -> None:
        """The residual (and under momentum correction the velocity's share, ``momentum * u``: DGC's update of
        a step that sends every entry) goes with the dense step, and both are cleared."""
        velocity = self._velocities.get(name)
        if velocity is not None:
            grad.add_(velocity, alpha=self.momentum)
            velocity.zero_()
        residual = self._residuals.get(name)
        if residual is not None:
            grad.add_(residual, alpha=self.decay)
            residual.zero_()

    def local_state(self) -> list[Tensor]:
        return list(self._residuals.values())

    def residual(self, name: str) -> Tensor | None:
        """The current residual of parameter ``name`` (``None`` before its first compressed step)."""
        return self._residuals.get(name)

    def velocity(self, name: str) -> Tensor | None:
        """The momentum-correction velocity of ``name`` (``None`` without momentum or before its first step)."""
        return self._velocities.get(name)

    def state_dict(self) -> dict[str, Tensor]:
        return {**self._residuals, **{_VELOCITY + name: v for name, v in self._velocities.items()}}

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        velocities = {name[len(_VELOCITY) :]: v.clone() for name, v in state.items() if name.startswith(_VELOCITY)}
        if velocities and not self.momentum:
            raise ValueError("the saved error feedback has momentum-correction velocities; this one has momentum 0")
        self._velocities = velocities
        self._residuals = {name: r.clone() for name, r in state.items() if not name.startswith(_VELOCITY)}


#: Key prefix of the velocities in :meth:`ErrorFeedback.state_dict` (no parameter name starts so).
_VELOCITY = "velocity:"


def _zero_where_sent(velocity: Tensor, sent: Sent, finite: Finite = True) -> None:
    """Momentum factor masking (Lin et al., 2018, Sec. 3.2): no velocity where entries were sent (kept only where
    the device flag ``finite`` is true, when one is given)."""
    if isinstance(sent, SparseEntries):
        zero = velocity.new_zeros(())
        if finite is not True:
            zero = torch.where(finite, zero, velocity[sent.indices])
        velocity.index_put_((sent.indices,), zero)  # int32 indices too
    else:  # dense, or entries kept encoded (scaled signs, ternary codes): masked where they are not zero
        sent_there = dense_of(sent) != 0
        velocity.masked_fill_(sent_there if finite is True else sent_there & finite, 0)


class Diana(Memory):
    """DIANA (Mishchenko et al., 2019, Algorithm 1): compress gradient differences.

    Each rank keeps a shift ``h_i`` per parameter and every rank the same global shift ``h``:

    * send ``delta_i = Q(g_i - h_i)`` (:meth:`compensate` returns ``g_i - h_i``);
    * the optimizer gets ``g_hat = h + mean_i(delta_i)`` (:meth:`reconstruct`), unbiased when Q is;
    * ``h_i += alpha * delta_i`` and ``h += alpha * mean_i(delta_i)`` (:meth:`update`).

    With full local gradients the shifts learn each rank's gradient at the optimum, so the
    compressed differences, and with them the quantization noise, vanish: linear convergence
    where memoryless quantizers stall at a noise floor.

    Args:
        alpha: shift step in (0, 1]; ``None`` takes the paper's ``1 / (omega + 1)`` per parameter
            from ``variance_bound``.
        variance_bound: ``omega(numel)`` of the quantizer, with ``E||Q(x) - x||^2 <= omega ||x||^2``.
    """

    name = "diana"

    def __init__(self, alpha: float | None = None, variance_bound: Callable[[int], float] | None = None) -> None:
        if alpha is not None:
            check_number("alpha", alpha, 0, 1, open_min=True)
        if alpha is None and variance_bound is None:
            raise ValueError("alpha=None needs the quantizer's variance bound omega to take alpha = 1 / (omega + 1)")
        self.alpha = None if alpha is None else float(alpha)
        self.variance_bound = variance_bound
        self._local: dict[str, Tensor] = {}
        self._global: dict[str, Tensor] = {}
        self._alphas: dict[int, float] = {}
        #: the shift step each parameter was last updated with (for inspection)
        self.alphas: dict[str, float] = {}

    def alpha_for(self, unit_numel: int) -> float:
        """The shift step for a unit of ``unit_numel`` elements: ``alpha``, or ``1 / (omega(unit_numel) + 1)``.

        ``omega`` is the variance bound of the unit *as it is compressed*: a parameter compressed
        inside a larger unit is quantized with that unit's blocks (Mishchenko et al., 2019,
        Theorem 2 needs ``alpha <= 1 / (omega + 1)`` of the operator actually applied).
        """
        if self.alpha is not None:
            return self.alpha
        if unit_numel not in self._alphas:
            assert self.variance_bound is not None
            omega = float(self.variance_bound(unit_numel))
            if not math.isfinite(omega) or omega < 0:
                raise ValueError(f"variance bound omega must be finite and >= 0, got {omega} for {unit_numel} elements")
            self._alphas[unit_numel] = 1.0 / (omega + 1.0)
        return self._alphas[unit_numel]

    def compensate(self, name: str, grad: Tensor) -> Tensor:
        shift = self._local.get(name)
        return grad.clone() if shift is None else grad - shift

    def compensate_(self, name: str, x: Tensor) -> Tensor:
        shift = self._local.get(name)
        return x if shift is None else x.sub_(shift)

    def reconstruct(self, name: str, mean: Tensor) -> Tensor:
        shift = self._global.get(name)
        return mean if shift is None else shift + mean

    def settle_(self, name: str, compensated: Tensor, sent: Sent, unit_numel: int, finite: Finite = True) -> None:
        """``h_i += alpha * delta_i`` from this rank's own payload (its codes, never decoded whole), unless it or the
        mean is non-finite; ``compensated`` is not read (the mean may be written over it next), except as scratch
        where ``finite`` is a flag on a device (:meth:`_step_where`)."""
        alpha = self.alphas[name] = self.alpha_for(unit_numel)
        finite = all_of((finite, finiteness(sent) if isinstance(sent, Tensor) else sent.all_finite()))
        if finite is True:
            self._step(self._local, name, sent, alpha, like=compensated)
        elif finite is not False:
            self._step_where(finite, self._local, name, sent, alpha, scratch=compensated)

    def conclude_(self, name: str, mean: Tensor, out: Tensor, unit_numel: int, update: Finite) -> None:
        """``out = h + mean`` and, when ``update``, ``h += alpha * mean``, in one pass: one compiled kernel in place
        where kernels run compiled and ``out`` is ``mean`` itself (DDP's bucket), else cache-sized chunks, so that
        ``out`` may be ``mean`` without a model-sized temporary. An ``update`` flag on a device keeps the new ``h``
        only where it is true, a chunk at a time."""
        shift = self._global.get(name)
        alpha = self.alpha_for(unit_numel)
        if shift is None:
            if out.data_ptr() != mean.data_ptr():
                out.copy_(mean)
            if update is True:
                self._step(self._global, name, mean, alpha, like=mean)
            elif update is not False:
                self._step_where(update, self._global, name, mean, alpha, scratch=None)
            return
        if (
            update is True
            and out.data_ptr() == mean.data_ptr()
            and mean.dtype == torch.float32
            and compiles_on(mean.device)
        ):
            shift_and_estimate_(mean, shift, torch.full((), alpha, dtype=mean.dtype, device=mean.device))
            return
        span = chunk_for(out.device, STREAM_CHUNK)
        estimate = torch.empty(min(mean.numel(), span), dtype=out.dtype, device=out.device)
        for start in range(0, mean.numel(), span):
            m, h = mean[start : start + span], shift[start : start + span]
            chunk = torch.add(h, m, out=estimate[: m.numel()])
            if update is True:
                h.add_(m, alpha=alpha)
            elif update is not False:
                keep_where_(update, torch.add(h, m, alpha=alpha), h)  # as add_ rounds it
            out[start : start + span].copy_(chunk)

    def update(self, name: str, compensated: Tensor, sent: Sent, mean: Tensor, unit_numel: int | None = None) -> None:
        alpha = self.alpha_for(compensated.numel() if unit_numel is None else unit_numel)
        self.alphas[name] = alpha
        # h depends on the mean alone, identical on every rank; h_i skips a non-finite local step
        self._step(self._global, name, mean, alpha, like=mean)
        if all_finite(sent) if isinstance(sent, Tensor) else sent.all_finite():
            self._step(self._local, name, sent, alpha, like=compensated)

    @staticmethod
    def _step_where(
        finite: Tensor, shifts: dict[str, Tensor], name: str, step: Sent, alpha: float, scratch: Tensor | None
    ) -> None:
        """:meth:`_step` kept where the device flag ``finite`` is true: the stepped shift is formed in ``scratch`` (a
        temporary when ``None``), as :meth:`_step` forms it in place, then selected into the shift (a NaN in a step it
        drops never reaches it)."""
        like = step if isinstance(step, Tensor) else scratch
        assert like is not None
        shift = shifts.get(name)
        if shift is None:
            shift = shifts[name] = torch.zeros_like(like)
        if isinstance(step, Tensor):
            stepped = torch.add(shift, step, alpha=alpha, **({} if scratch is None else {"out": scratch}))
        else:
            stepped = step.add_to_(scratch.copy_(shift), alpha=alpha)
        keep_where_(finite, stepped, shift)

    @staticmethod
    def _step(shifts: dict[str, Tensor], name: str, step: Sent, alpha: float, like: Tensor) -> None:
        """``shifts[name] += alpha * step`` in place, from zeros shaped as ``like`` at the first step; an
        encoded ``step`` (this rank's own ternary codes) is added in one fused pass, never decoded whole."""
        shift = shifts.get(name)
        if shift is None:
            shift = shifts[name] = torch.zeros_like(like)
        if isinstance(step, Tensor):
            shift.add_(step, alpha=alpha)
        else:
            step.add_to_(shift, alpha=alpha)

    def local_state(self) -> list[Tensor]:
        return list(self._local.values())

    def shifts(self, name: str) -> tuple[Tensor | None, Tensor | None]:
        """``(h_i, h)`` of parameter ``name`` (``None`` before its first compressed step)."""
        return self._local.get(name), self._global.get(name)

    def state_dict(self) -> dict[str, Tensor]:
        state = {f"h_local/{name}": h for name, h in self._local.items()}
        state.update({f"h/{name}": h for name, h in self._global.items()})
        return state

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        local, shared = {}, {}
        for key, value in state.items():
            kind, _, name = key.partition("/")
            if kind not in ("h_local", "h") or not name:
                raise ValueError(f"unexpected DIANA state entry {key!r}")
            (local if kind == "h_local" else shared)[name] = value.clone()
        self._local, self._global = local, shared


MEMORIES: dict[str, type[Memory]] = {cls.name: cls for cls in (NoMemory, ErrorFeedback, Diana)}


def build_memory(name: str, **kwargs: Any) -> Memory:
    """A fresh memory from its registry name and keyword arguments."""
    check_choice("memory", name, sorted(MEMORIES))
    try:
        return MEMORIES[name](**kwargs)
    except TypeError as err:
        raise ValueError(f"memory {name!r} does not take the arguments {sorted(kwargs)}: {err}") from None
