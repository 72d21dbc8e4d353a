"""Small host values put on a device without making the host wait for it.

``torch.tensor(values, device="cuda")`` copies from pageable host memory, which waits for the device (a host wait in
the middle of a step, for a handful of integers). Copied from pinned memory instead, the copy is queued on the stream
and the host goes on; the pinned block is reused only after the copy has run (torch's caching host allocator records
the stream). Elsewhere it is a plain copy.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["device_tensor"]


def device_tensor(values: Sequence[int] | Sequence[float], dtype: torch.dtype, device: torch.device | str) -> Tensor:
    """``torch.tensor(values, dtype=dtype)`` on ``device``, on CUDA without a host wait."""
    host = torch.tensor(values, dtype=dtype)
    device = torch.device(device)
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)
