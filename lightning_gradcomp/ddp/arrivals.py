"""Which parameters received a gradient since the last exchange: the steps a parameter sits out leave its memory be.

DDP with ``find_unused_parameters=True`` (or ``static_graph=True``) hands the hook zeros for a parameter that took
no part in this rank's forward pass, and keeps the average it gets back only where some rank used the parameter: a
parameter that no rank used keeps its gradient as it was (``None`` after ``zero_grad``). A memory that took those
zeros for a gradient would change on a step whose result is thrown away: an error-feedback residual sent and lost,
DIANA's shifts pulled towards zero (``h_i += alpha Q(0 - h_i)``) by a step that never was.

So the hook leaves the memory of a parameter that received no gradient on this rank as it is, and sends nothing of
it (its share of the compressed tensor stays DDP's zeros). Where every rank sat it out, nothing changes at all;
where another rank used it, this rank's share of the average is zero, as under plain DDP, with error feedback
(what it still owes goes with a later step), and the shift ``h_i`` under DIANA (the rank's estimate of its
gradient stands for the step, the averaged shift moving as on every rank alike).

A parameter's gradient is known to have arrived from ``register_post_accumulate_grad_hook``, which runs when the
gradient is accumulated, before DDP marks the parameter ready; several backward passes before one exchange
(gradient accumulation) count together.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import torch
from torch.utils.hooks import RemovableHandle

__all__ = ["GradientArrivals"]


class GradientArrivals:
    """The names of the trainable parameters whose gradient was accumulated since :meth:`end_step`."""

    def __init__(self, named_parameters: Iterable[tuple[str, torch.Tensor]]) -> None:
        self._arrived: set[str] = set()
        self._handles: list[RemovableHandle] = [
            p.register_post_accumulate_grad_hook(self._noter(name)) for name, p in named_parameters if p.requires_grad
        ]

    def _noter(self, name: str) -> Callable[[torch.Tensor], None]:
        def arrive(_parameter: torch.Tensor) -> None:
            self._arrived.add(name)

        return arrive

    def sat_out(self, names: Sequence[str]) -> list[bool]:
        """For each of ``names``: whether that parameter received no gradient on this rank this step. When no
        gradient arrived at all, the gradients came from no backward pass (a hook called by hand): none sat out."""
        if not self._arrived:
            return [False] * len(names)
        return [name not in self._arrived for name in names]

    def end_step(self) -> None:
        """Forget this step's arrivals (the exchange is over)."""
        self._arrived.clear()

    def remove(self) -> None:
        """Remove the hooks from the parameters."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
