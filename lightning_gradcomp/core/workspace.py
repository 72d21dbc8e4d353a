"""Working buffers kept from step to step: a model-sized tensor is allocated once, never per step.

A fresh allocation of tens of megabytes is handed back to the system when freed, so the next step's
faults its pages in again: on a 25M-parameter model that costs more than the arithmetic done in it
(45 ms against 7 ms for the same multiply into a kept tensor, one CPU thread: benchmarks/kernels.py).
The hook therefore keeps, per unit, the buffers its trip still needs (the flat copy of a unit of several
parameters that its compressor cannot read in DDP's buckets, an average that cannot be decoded over the bucket,
the wire-precision summand, this rank's packed payload, the bytes gathered from every rank) in a
:class:`Workspace`, and hands compressors and aggregators a :data:`Scratch`: a function of (role, size, dtype,
device) that returns the same tensor every step. A buffer's contents are whatever the last user left there.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
from torch import Tensor

__all__ = ["Scratch", "Workspace"]

#: ``scratch(role, numel, dtype, device)``: a flat tensor kept for this unit and role (contents undefined).
Scratch = Callable[[str, int, torch.dtype, torch.device], Tensor]


class Workspace:
    """Flat buffers by (owner, role), allocated at first use and again only if the size, dtype or device changes."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[int, str], Tensor] = {}

    def buffer(self, owner: int, role: str, numel: int, dtype: torch.dtype, device: torch.device) -> Tensor:
        """The kept flat tensor of ``owner`` (a unit's index) for ``role``."""
        kept = self._buffers.get((owner, role))
        if kept is None or kept.numel() != numel or kept.dtype != dtype or kept.device != torch.device(device):
            kept = self._buffers[(owner, role)] = torch.empty(numel, dtype=dtype, device=device)
        return kept

    def scratch(self, owner: int) -> Scratch:
        """``owner``'s buffers as a :data:`Scratch`, for a compressor or an aggregator."""
        return partial(self.buffer, owner)

    @property
    def nbytes(self) -> int:
        """Bytes held by every kept buffer."""
        return sum(t.numel() * t.element_size() for t in self._buffers.values())
