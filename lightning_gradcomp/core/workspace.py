"""Working buffers kept from step to step: a model-sized tensor is allocated once, never per step.

A fresh allocation of tens of megabytes is handed back to the system when freed, so the next step's
faults its pages in again: on a 25M-parameter model that costs more than the arithmetic done in it
(45 ms against 7 ms for the same multiply into a kept tensor, one CPU thread: benchmarks/kernel_costs.py).
The hook therefore keeps, per unit, the buffers its trip still needs (the flat copy of a unit of several
parameters that its compressor cannot read in DDP's buckets, an average that cannot be decoded over the bucket,
the wire-precision summand, this rank's packed payload, the bytes gathered from every rank) in a
:class:`Workspace`, and hands compressors and aggregators a :data:`Scratch`: a function of (role, size, dtype,
device) that returns the same tensor every step. A buffer's contents are whatever the last user left there.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial

import torch
from torch import Tensor

__all__ = ["OWN_PAYLOAD", "Scratch", "Workspace"]

#: ``scratch(role, numel, dtype, device)``: a flat tensor kept for this unit and role (contents undefined).
Scratch = Callable[[str, int, torch.dtype, torch.device], Tensor]

#: The role of the buffer a compressor writes this rank's payload into, as it travels (its wire bytes).
OWN_PAYLOAD = "own payload"

#: Payloads laid end to end start on multiples of this many bytes, so that each one's float32 header can be viewed
#: where it lies (:meth:`Workspace.lay_out`).
PAYLOAD_ALIGNMENT = 4


class Workspace:
    """Flat buffers by (owner, role), allocated at first use and again only if the size, dtype or device changes."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[int, str], Tensor] = {}
        self._layouts: dict[tuple[int, str], tuple] = {}  # each layout's owners, sizes and device, once made

    def buffer(self, owner: int, role: str, numel: int, dtype: torch.dtype, device: torch.device) -> Tensor:
        """The kept flat tensor of ``owner`` (a unit's index) for ``role``."""
        kept = self._buffers.get((owner, role))
        if kept is None or kept.numel() != numel or kept.dtype != dtype or kept.device != torch.device(device):
            kept = self._buffers[(owner, role)] = torch.empty(numel, dtype=dtype, device=device)
        return kept

    def lay_out(self, owners: Sequence[int], role: str, numels: Sequence[int | None], device: torch.device) -> None:
        """Make the uint8 ``role`` buffers of ``owners`` (of ``numels`` bytes) lie end to end, in that order, in one
        kept tensor: payloads gathered together then travel as one span from where they were written, with no copy
        into a row of their own (:meth:`~lightning_gradcomp.core.comm.collectives.Collectives.all_gather_bytes_start`).

        Nothing changes where fewer than two owners would share it, a size is unknown (``None``) or an offset would
        not be a multiple of :data:`PAYLOAD_ALIGNMENT`. A layout is made once: a user that asks for another size
        gets a buffer of its own, as before, and keeps it."""
        if len(owners) < 2 or any(n is None for n in numels) or any(n % PAYLOAD_ALIGNMENT for n in numels[:-1]):
            return
        key, layout = (owners[0], role), (tuple(owners), tuple(numels), torch.device(device))
        if self._layouts.get(key) == layout:
            return
        self._layouts[key] = layout
        joined = torch.empty(sum(numels), dtype=torch.uint8, device=device)  # kept alive by its views
        for owner, view in zip(owners, joined.split(list(numels)), strict=True):
            self._buffers[(owner, role)] = view

    def scratch(self, owner: int) -> Scratch:
        """``owner``'s buffers as a :data:`Scratch`, for a compressor or an aggregator."""
        return partial(self.buffer, owner)

    @property
    def nbytes(self) -> int:
        """Bytes held by every kept buffer (those laid out together counted once)."""
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in self._buffers.values()}
        return sum(storages.values())
