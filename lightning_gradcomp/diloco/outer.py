"""DiLoCo's synchronisation: the pseudo-gradient averaged over the ranks, applied by an outer optimizer.

Douillard et al., 2023 (arXiv 2311.08105), Algorithm 1: every rank keeps the weights of the last synchronisation
``theta_prev`` and takes ``H`` inner optimizer steps that exchange nothing; then the pseudo-gradient
``delta = theta_prev - theta_local`` is averaged over the ranks and applied to ``theta_prev`` by the outer
optimizer (SGD with Nesterov momentum; the paper's outer lr 0.7 and momentum 0.9), and every rank goes on from
the result. The inner optimizer's state carries on across synchronisations.

The order of the operations follows torchft's ``DiLoCo`` (``torchft.local_sgd``, 0.2.0), so that the two agree
bit for bit on two ranks: the pseudo-gradient in the parameters' dtype, summed over the ranks and divided by their
number in place; the parameters put back to ``theta_prev``; the average set as their gradient; the outer step;
the result kept as the next ``theta_prev``; the gradients dropped. Tensors of one dtype travel in one allreduce
(torchft sends each parameter on its own; the sums are the same element by element).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_gradcomp.comm import Collectives, CommCounter
from lightning_gradcomp.validation import check_bool, check_int, check_number

__all__ = ["OuterSync", "check_outer_arguments"]


def check_outer_arguments(sync_every: int, outer_lr: float, outer_momentum: float, nesterov: bool) -> None:
    """``ValueError`` naming the first of DiLoCo's outer arguments out of range (where they enter: ``OuterSync``
    and the strategy)."""
    check_int("sync_every", sync_every, 1)
    check_number("outer_lr", outer_lr, 0, float("inf"), open_min=True, open_max=True)
    check_number("outer_momentum", outer_momentum, 0, 1, open_max=True)
    check_bool("nesterov", nesterov)
    if nesterov and not outer_momentum:
        raise ValueError("nesterov=True needs outer_momentum > 0; pass nesterov=False for plain outer SGD")


class OuterSync:
    """DiLoCo's outer loop for ``parameters``: call :meth:`step` after each inner optimizer step.

    Every rank starts from rank 0's weights (broadcast once here, as DDP does), so the ranks agree however they were
    initialised. Without an initialised process group it runs alone (the average of one rank is its own).

    Args:
        parameters: the model's ``(name, parameter)`` pairs (``named_parameters()``) on their devices; frozen ones
            are left alone, and which are trained must not change afterwards.
        sync_every: inner steps between two synchronisations (``H``, at least 1).
        outer_lr: the outer optimizer's learning rate (> 0).
        outer_momentum: its momentum, in [0, 1).
        nesterov: Nesterov momentum (the paper's), which needs ``outer_momentum > 0``.
        group: the process group of the ranks (default: the world).
    """

    def __init__(
        self,
        parameters: Iterable[tuple[str, nn.Parameter]],
        sync_every: int,
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        nesterov: bool = True,
        group: torch.distributed.ProcessGroup | None = None,
    ) -> None:
        check_outer_arguments(sync_every, outer_lr, outer_momentum, nesterov)
        self.sync_every = sync_every
        self._parameters = [(name, p) for name, p in parameters if p.requires_grad]
        if not self._parameters:
            raise ValueError("parameters holds no trainable parameter: there is nothing to synchronise")
        #: counts the bytes of every synchronisation
        self.counter = CommCounter()
        self.collectives = Collectives(group, self.counter) if dist.is_available() and dist.is_initialized() else None
        if self.collectives is not None and self.collectives.world_size > 1:
            source = dist.get_global_rank(group, 0) if group is not None else 0
            with torch.no_grad():
                for _, p in self._parameters:
                    dist.broadcast(p.data, src=source, group=group)
        #: the weights at the last synchronisation (``theta_prev``), kept once for the whole run
        self.anchor = {name: p.detach().clone() for name, p in self._parameters}
        self.outer = torch.optim.SGD(
            [p for _, p in self._parameters], lr=outer_lr, momentum=outer_momentum, nesterov=nesterov
        )
        self.inner_steps = 0
        self._flats, self._deltas = self._flat_by_kind()

    def _flat_by_kind(self) -> tuple[list[Tensor], dict[str, Tensor]]:
        """A flat pseudo-gradient buffer per (device, dtype), allocated once, and each parameter's view of it."""
        by_kind: dict[tuple[torch.device, torch.dtype], list[tuple[str, nn.Parameter]]] = {}
        for name, p in self._parameters:
            by_kind.setdefault((p.device, p.dtype), []).append((name, p))
        flats, views = [], {}
        for (device, dtype), named in by_kind.items():
            flat = torch.empty(sum(p.numel() for _, p in named), dtype=dtype, device=device)
            for (name, p), part in zip(named, flat.split([p.numel() for _, p in named]), strict=True):
                views[name] = part.view_as(p)
            flats.append(flat)
        return flats, views

    def step(self) -> bool:
        """Count an inner step; every ``sync_every``-th, synchronise. Returns whether it did."""
        self.inner_steps += 1
        if self.inner_steps % self.sync_every:
            return False
        self.synchronise()
        return True

    @torch.no_grad()
    def synchronise(self) -> None:
        """Average the pseudo-gradients and take the outer step from ``theta_prev`` (every rank alike)."""
        changed = sorted(name for name, p in self._parameters if not p.requires_grad)
        if changed:
            raise RuntimeError(
                f"parameters {changed} were frozen after OuterSync was built, and its outer momentum would still move "
                "them; build a new OuterSync for the parameters trained now"
            )
        for name, p in self._parameters:  # delta = theta_prev - theta_local, in the parameter's dtype
            torch.sub(self.anchor[name], p, out=self._deltas[name])
        if self.collectives is not None:
            world = self.collectives.world_size
            for flat in self._flats:
                self.collectives.all_reduce_(flat)
                flat.div_(world)
        for name, p in self._parameters:
            p.copy_(self.anchor[name])
            p.grad = self._deltas[name]
        self.outer.step()
        for name, p in self._parameters:
            self.anchor[name].copy_(p)
        self.outer.zero_grad(set_to_none=True)

    def state_dict(self) -> dict:
        """What a resumed run needs (every rank holds the same): the inner step count, ``theta_prev`` and the outer
        optimizer's state."""
        return {
            "inner_steps": self.inner_steps,
            "anchor": {name: t.detach().to("cpu", copy=True) for name, t in self.anchor.items()},
            "outer": self.outer.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`'s output."""
        saved = {name: (tuple(t.shape), t.dtype) for name, t in state["anchor"].items()}
        here = {name: (tuple(t.shape), t.dtype) for name, t in self.anchor.items()}
        if saved != here:
            raise ValueError(f"the saved DiLoCo state has theta_prev for {saved}, this model trains {here}")
        self.inner_steps = int(state["inner_steps"])
        for name, value in state["anchor"].items():
            self.anchor[name].copy_(value)
        self.outer.load_state_dict(state["outer"])
