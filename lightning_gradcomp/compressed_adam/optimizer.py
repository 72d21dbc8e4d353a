"""Compressed Adam: 1-bit Adam's two stages over the user's own ``torch.optim.Adam`` or ``AdamW``.

Tang, Gan, Awan, Rajbhandari, Li, Lian, Liu, Zhang and He, "1-bit Adam: Communication Efficient Large-Scale Training
with Adam's Convergence Speed" (ICML 2021, arXiv 2102.02888), Algorithm 1:

* **warm-up** (the first ``freeze_step`` optimizer steps): the user's Adam as it is, every gradient averaged over the
  ranks (densely, :mod:`~lightning_gradcomp.compressed_adam.hook`);
* **compression stage**: the variance is frozen (Adam's preconditioner stops moving, so the update becomes linear in
  the momentum), no gradient is exchanged, and each rank updates the momentum with its own gradient,
  ``m_i = beta1 m + (1 - beta1) g_i``; the ranks' momenta are averaged compressed, in two phases with error feedback
  on the worker and on the rank that reduces each chunk (:class:`~lightning_gradcomp.core.two_phase_average.
  TwoPhaseAverage`: 1-bit Adam's compressed allreduce), so every rank holds the same ``m``; the step is Adam's with that
  ``m`` and the frozen variance.

The paper's Algorithm 1 writes Adam without its bias corrections; the user's optimizer has them, so the compressed
stage keeps them as that optimizer would: ``m`` is divided by ``1 - beta1^t`` (``t`` counting on), and the frozen
preconditioner is ``sqrt(v / (1 - beta2^T)) + eps`` as the optimizer last used it at step ``T``. Weight decay is the
optimizer's: decoupled for AdamW (and Adam's ``decoupled_weight_decay``), added to the gradient for Adam. Entries whose
variance is exactly zero when it is frozen (a gradient that was always zero: embedding rows of tokens never seen) keep a
zero momentum: a sign cannot say zero (the paper's momentum mask, derived here from the variance).

With ``variance_refresh="exponential"`` the variance is updated again, on a dense step, at steps ``2 T``, ``4 T``,
``8 T``, ...: 0/1 Adam's adaptive freezing (Lu et al., ICLR 2022, arXiv 2202.06009: the variance updated at
exponentially spaced steps instead of never).
"""

from __future__ import annotations

import functools
import math
from collections import deque
from collections.abc import Callable
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_gradcomp.compressed_adam.hook import GradientRouting, compressed_adam_comm_hook
from lightning_gradcomp.core.comm import Collectives, CommCounter
from lightning_gradcomp.core.compressors import Compressor, build_compressor
from lightning_gradcomp.core.stats import StepStats
from lightning_gradcomp.core.two_phase_average import TwoPhaseAverage, check_two_phase_compressor
from lightning_gradcomp.core.validation import check_choice, check_int

__all__ = ["ADAM_OPTIMIZERS", "CompressedAdam", "check_adam"]

#: The optimizers compressed Adam takes.
ADAM_OPTIMIZERS = (torch.optim.Adam, torch.optim.AdamW)
#: What ``variance_refresh`` takes.
REFRESH = ("none", "exponential")


def check_adam(optimizer: Any, owner: str) -> None:
    """``ValueError`` naming what is not a plain Adam or AdamW: another optimizer, AMSGrad, ``maximize``."""
    if not isinstance(optimizer, ADAM_OPTIMIZERS):
        raise ValueError(
            f"{owner} compresses Adam's momentum and takes torch.optim.Adam or torch.optim.AdamW; the optimizer is "
            f"{type(optimizer).__name__}"
        )
    for index, group in enumerate(optimizer.param_groups):
        for flag in ("amsgrad", "maximize", "differentiable"):
            if group.get(flag):
                raise ValueError(f"{owner} does not support {flag}=True (parameter group {index} of the optimizer)")


class CompressedAdam:
    """Compressed Adam over ``optimizer`` (the user's Adam or AdamW, with its hyper-parameters, parameter groups and
    schedule): call :meth:`step` instead of ``optimizer.step()``, or :meth:`install` it in its place.

    Args:
        optimizer: ``torch.optim.Adam`` or ``AdamW``; every trained parameter of one dtype and device.
        compressor: the momentum's compressor in both phases: ``"sign"`` (1-bit, the paper's; ``magnitude="rms"``
            by default, its scale), ``"topk"``, ``"qsgd"``, ``"int8"``, ``"fp8"``, or an instance.
        compressor_kwargs: its arguments (``density`` for Top-k, ...).
        freeze_step: optimizer steps of the warm-up (dense Adam) before the variance is frozen (>= 1).
        variance_refresh: ``"none"``, or ``"exponential"`` (0/1 Adam's: the variance updated on a dense step at
            ``2 freeze_step``, ``4 freeze_step``, ...).
        group: the process group of the ranks (default: the world; none initialised: one rank, nothing exchanged).
        seed: base seed of a random compressor's streams.
        history: optimizer steps whose :class:`~lightning_gradcomp.core.stats.StepStats` are kept.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        compressor: str | Compressor = "sign",
        compressor_kwargs: dict[str, Any] | None = None,
        freeze_step: int = 100,
        variance_refresh: Literal["none", "exponential"] = "none",
        group: dist.ProcessGroup | None = None,
        seed: int = 0,
        history: int = 1000,
    ) -> None:
        check_adam(optimizer, type(self).__name__)
        self.codec = build_codec(compressor, compressor_kwargs)
        self.freeze_step = check_int("freeze_step", freeze_step, 1)
        self.variance_refresh = check_choice("variance_refresh", variance_refresh, REFRESH)
        self.seed = check_int("seed", seed, 0)
        check_int("history", history, 1)
        self.optimizer = optimizer
        self.parameters = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
        kinds = {(p.dtype, p.device) for p in self.parameters}
        if len(kinds) != 1:
            raise ValueError(
                f"{type(self).__name__} needs every trained parameter of one dtype and device, got {kinds}"
            )
        self.counter = CommCounter()
        self._counted = self.counter.copy()  # the counts at the end of the last step
        distributed = dist.is_available() and dist.is_initialized()
        self.collectives = Collectives(group, self.counter) if distributed else None
        self.routing = (
            GradientRouting(self.parameters, self.collectives, self.next_step_is_dense) if distributed else None
        )
        #: optimizer steps taken (warm-up included), the step the variance was frozen at, and last updated at
        self.steps = 0
        self.frozen_at: int | None = None
        self.variance_step: int | None = None
        #: one record per optimizer step, the latest last
        self.history: deque[StepStats] = deque(maxlen=history)
        self.exchange: TwoPhaseAverage | None = None
        self._momentum: Tensor | None = None
        self._denominator: Tensor | None = None
        self._mask: Tensor | None = None
        self._restored: dict[str, Any] | None = None
        self._adam_step: Callable[..., Any] = optimizer.step
        dtype, device = next(iter(kinds))
        self._numel = sum(p.numel() for p in self.parameters)
        self._dense_bytes = self._numel * torch.empty(0, dtype=dtype).element_size()
        if self.collectives is not None and self.collectives.world_size > 1:
            self.exchange = TwoPhaseAverage(self.codec, [p.numel() for p in self.parameters], self.collectives,
                                            dtype, device, seed)  # fmt: skip

    @property
    def phase(self) -> str:
        """``"warmup"`` (dense Adam) or ``"compressed"``."""
        return "warmup" if self.frozen_at is None else "compressed"

    @property
    def last_step(self) -> StepStats | None:
        """The latest optimizer step's record (``None`` before the first)."""
        return self.history[-1] if self.history else None

    @property
    def memory(self) -> CompressedAdam:
        """What a monitor reads of this rank's state (:meth:`norm`), as it reads a hook's memory."""
        return self

    def norm(self) -> float | None:
        """The L2 norm of this rank's error-feedback residuals, the worker's and the server's (``None`` alone)."""
        if self.exchange is None:
            return None
        return math.hypot(float(self.exchange.worker_error.norm()), float(self.exchange.server_error.norm()))

    def next_step_is_dense(self) -> bool:
        """Whether the coming optimizer step averages the gradients densely: a warm-up step, or a refresh of the
        variance (asked by the hook before the step's backward pass is exchanged)."""
        step = self.steps + 1
        if step <= self.freeze_step:
            return True
        if self.variance_refresh == "exponential":
            ratio = step / self.freeze_step
            return ratio == int(ratio) and int(ratio) & (int(ratio) - 1) == 0
        return False

    def install(self, ddp: nn.Module | None = None) -> CompressedAdam:
        """Take ``optimizer.step``'s place (the caller's loop, a scheduler and Lightning call it as before) and register
        the hook on ``ddp`` (a ``DistributedDataParallel``: its own gradient averaging is replaced)."""
        step = functools.partial(CompressedAdam.step, self)
        if hasattr(self._adam_step, "_wrapped_by_lr_sched"):  # a scheduler counts the optimizer's steps through it:
            step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]  (our step calls its wrapper every step)
        self.optimizer.step = step  # type: ignore[method-assign]
        if ddp is not None and self.routing is not None:
            ddp.register_comm_hook(self.routing, compressed_adam_comm_hook)  # type: ignore[operator]
        return self

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One optimizer step: the user's Adam on a dense step, the compressed stage's otherwise."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        dense = self.next_step_is_dense()
        self.steps += 1
        stats = StepStats(step=self.steps - 1, numel=self._numel, dense_bytes=self._dense_bytes)
        stats.regime = "warmup" if self.frozen_at is None else "steady"
        if dense:
            self._adam_step()
            if self.steps >= self.freeze_step:
                self._freeze()
        else:
            self._compressed_step(stats)
        stats.compressed = not dense
        stats.take_counts(self.counter.since(self._counted))  # the backward pass's average too, on a dense step
        self._counted = self.counter.copy()
        self.history.append(stats)
        return loss

    @torch.no_grad()
    def _freeze(self) -> None:
        """Freeze the variance as the optimizer last used it: the preconditioner, the momentum mask, the flat momentum
        every parameter's ``exp_avg`` is a view of."""
        self.frozen_at = self.frozen_at if self.frozen_at is not None else self.steps
        self.variance_step = self.steps
        self._adopt(force=True)

    def _adopt(self, force: bool = False) -> None:
        """Lay every parameter's momentum in one flat buffer (their ``exp_avg`` views of it) and compute the frozen
        preconditioner and mask; again after the optimizer's state was loaded (its tensors then are new)."""
        states = [self.optimizer.state[p] for p in self.parameters]
        first = states[0]["exp_avg"]
        if not force and self._momentum is not None and first.data_ptr() == self._momentum.data_ptr():
            return
        flat = torch.cat([s["exp_avg"].reshape(-1) for s in states])
        variance = torch.cat([s["exp_avg_sq"].reshape(-1) for s in states])
        self._momentum = flat
        offset = 0
        for p, state in zip(self.parameters, states, strict=True):
            state["exp_avg"] = flat[offset : offset + p.numel()].view_as(p)
            offset += p.numel()
        assert self.variance_step is not None
        denominators = []
        offset = 0
        for group in self.optimizer.param_groups:
            beta2, eps = group["betas"][1], group["eps"]
            for p in (p for p in group["params"] if p.requires_grad):
                correction = math.sqrt(1 - beta2**self.variance_step)
                denominators.append(variance[offset : offset + p.numel()].sqrt().div_(correction).add_(eps))
                offset += p.numel()
        self._denominator = torch.cat(denominators)
        self._mask = (variance > 0).to(flat.dtype) if bool((variance == 0).any()) else None

    @torch.no_grad()
    def _compressed_step(self, stats: StepStats) -> None:
        if self._restored is not None:
            self._restore_exchange()
        self._adopt()
        momentum, denominator = self._momentum, self._denominator
        assert momentum is not None and denominator is not None
        offset = 0
        for group, p in self._grouped():
            beta1 = group["betas"][0]
            grad = p.grad if p.grad is not None else torch.zeros_like(p)
            if group["weight_decay"] and not self._decoupled(group):
                grad = grad.add(p, alpha=group["weight_decay"])
            momentum[offset : offset + p.numel()].mul_(beta1).add_(grad.reshape(-1), alpha=1 - beta1)
            offset += p.numel()
        if self.exchange is not None:
            self.exchange.average_(momentum, self.steps - 1, stats)
        if self._mask is not None:
            momentum.mul_(self._mask)
        offset = 0
        for group, p in self._grouped():
            state = self.optimizer.state[p]
            state["step"] += 1
            t = float(state["step"])
            lr, beta1 = group["lr"], group["betas"][0]
            if group["weight_decay"] and self._decoupled(group):
                p.mul_(1 - lr * group["weight_decay"])
            view = slice(offset, offset + p.numel())
            p.addcdiv_(momentum[view].view_as(p), denominator[view].view_as(p), value=-lr / (1 - beta1**t))
            offset += p.numel()
        self._mark_stepped()

    def _grouped(self) -> list[tuple[dict[str, Any], nn.Parameter]]:
        return [(g, p) for g in self.optimizer.param_groups for p in g["params"] if p.requires_grad]

    def _decoupled(self, group: dict[str, Any]) -> bool:
        return isinstance(self.optimizer, torch.optim.AdamW) or bool(group.get("decoupled_weight_decay", False))

    def _mark_stepped(self) -> None:
        """Run the optimizer's own step with no gradient (it changes nothing): its hooks, and a scheduler's check that
        the optimizer stepped, see a step."""
        grads = [p.grad for p in self.parameters]
        for p in self.parameters:
            p.grad = None
        try:
            self._adam_step()
        finally:
            for p, grad in zip(self.parameters, grads, strict=True):
                p.grad = grad

    def state_dict(self) -> dict[str, Any]:
        """This rank's state beside the optimizer's own (the momentum and variance are in it, alike on every rank):
        the steps, the stage, and both error-feedback residuals (this rank's own)."""
        exchange = self.exchange.state_dict() if self.exchange is not None else None
        if self._restored is not None and exchange is not None:
            exchange = self._restored
        return {"steps": self.steps, "frozen_at": self.frozen_at, "variance_step": self.variance_step,
                "exchange": exchange}  # fmt: skip

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output (the optimizer's own state restored apart, before or after)."""
        self.steps = int(state["steps"])
        self.frozen_at = None if state["frozen_at"] is None else int(state["frozen_at"])
        self.variance_step = None if state["variance_step"] is None else int(state["variance_step"])
        exchange = state.get("exchange")
        if (exchange is None) != (self.exchange is None):
            raise ValueError("the saved compressed Adam state was written by another number of ranks")
        self._restored = exchange
        self._momentum = None  # adopted again at the next compressed step, from the optimizer's state as loaded

    def _restore_exchange(self) -> None:
        assert self.exchange is not None and self._restored is not None
        self.exchange.load_state_dict(self._restored)
        self._restored = None


def build_codec(compressor: str | Compressor, compressor_kwargs: dict[str, Any] | None) -> Compressor:
    """The momentum's compressor (a 1-bit sign scaled by the root mean square, the paper's, when named ``"sign"``
    without arguments), checked for the two-phase average."""
    if compressor_kwargs is not None and not isinstance(compressor_kwargs, dict):
        raise ValueError(
            f"compressor_kwargs must be a dictionary of keyword arguments or None, got {compressor_kwargs!r}"
        )
    kwargs = dict(compressor_kwargs or {})
    if compressor == "sign":
        kwargs.setdefault("magnitude", "rms")
    codec = build_compressor(compressor, **kwargs)
    check_two_phase_compressor(codec)
    return codec
