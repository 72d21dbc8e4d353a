"""Where the host waits for a device, and how many times a call makes it wait.

A codec that waits stalls the backward thread, which then queues no more kernels until the device catches up. On a
device the codecs therefore take paths of fixed sizes that read nothing back (:func:`reads_wait`); on CUDA the waits
are counted with ``torch.cuda.set_sync_debug_mode("warn")``, which warns at each synchronizing operation (torch calls
the mode a prototype that may miss some).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator

import torch

__all__ = ["cpu_as_a_device", "host_waits", "reads_wait"]

_cpu_waits = False


def reads_wait(device: torch.device) -> bool:
    """Whether reading a value of a tensor on ``device`` back (``.item()``, a size that depends on the data) makes the
    host wait for it: on any device but the CPU, and on the CPU too under :func:`cpu_as_a_device`."""
    return _cpu_waits or device.type != "cpu"


@contextlib.contextmanager
def cpu_as_a_device() -> Iterator[None]:
    """Inside, the CPU takes the paths a device takes (:func:`reads_wait` is true everywhere), in every thread: so that
    a machine without a GPU can count what those paths read back and check that they give the CPU's results."""
    global _cpu_waits
    before, _cpu_waits = _cpu_waits, True
    try:
        yield
    finally:
        _cpu_waits = before


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
