"""How many times a call makes the host wait for a CUDA device: a codec that waits stalls the backward thread, which
then queues no more kernels until the device catches up. Counted with ``torch.cuda.set_sync_debug_mode("warn")``,
which warns at each synchronizing operation (torch calls the mode a prototype that may miss some)."""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch

__all__ = ["host_waits"]


def host_waits(fn: Callable[[], object], device: torch.device | str = "cuda") -> int | None:
    """How many times one call of ``fn`` makes the host wait for ``device`` (from autograd's backward thread too);
    ``None`` off CUDA, where nothing is counted."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in seen)
