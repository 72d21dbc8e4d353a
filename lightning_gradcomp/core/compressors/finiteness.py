"""Whether values are finite, told without making the host wait for a device.

Error feedback and DIANA keep a NaN or an infinity out of their state: a step whose mean is not finite leaves the state
as it was. On the CPU that is a bool read from one sum. On a device, reading it back would make the host wait at every
unit, so the answer stays on the device as a 0-dim bool tensor (a *flag*), and the state's update is kept only where
it is true (``torch.where``, which a NaN in the update it drops cannot reach).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor

from lightning_gradcomp.core.compressors.base import all_finite
from lightning_gradcomp.core.host_waits import reads_wait

__all__ = ["Finite", "all_of", "finiteness", "keep_where_", "nonfinite_count"]

#: ``True``/``False`` where known on the host; else a 0-dim bool tensor on the device.
Finite = bool | Tensor


def finiteness(x: Tensor) -> Finite:
    """Whether every entry of ``x`` is finite: :func:`~lightning_gradcomp.core.compressors.base.all_finite`'s bool
    where reading it costs no wait (the CPU), else a flag on ``x``'s device, from the same one sum."""
    if not reads_wait(x.device):
        return all_finite(x)
    if not x.numel():
        return True
    return torch.isfinite(x.sum(dtype=torch.float32) if x.element_size() < 4 else x.sum())


def all_of(flags: Iterable[Finite]) -> Finite:
    """Whether all of ``flags`` hold: ``False`` as soon as one is known false, a flag when some are on a device."""
    on_device = None
    for flag in flags:
        if flag is False:
            return False
        if flag is not True:
            on_device = flag if on_device is None else on_device & flag
    return True if on_device is None else on_device


def nonfinite_count(finite: Finite) -> int | Tensor:
    """1 where ``finite`` is false, else 0: an int, or an int64 0-dim tensor on the flag's device."""
    if isinstance(finite, bool):
        return int(not finite)
    return (~finite).long()


def keep_where_(finite: Tensor, new: Tensor, out: Tensor) -> Tensor:
    """``out = new`` where the flag ``finite`` is true, else ``out`` as it was, in one pass with no temporary (a NaN in
    ``new`` never reaches ``out`` when the flag is false); returns ``out``."""
    return torch.where(finite, new, out, out=out)
