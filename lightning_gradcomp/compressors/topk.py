"""Exact Top-k sparsification (Shi et al., ICDCS 2019, Sec. III; ALGORITHMS.md Sec. 4)."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from lightning_gradcomp.compressors.base import Compressor, Payload
from lightning_gradcomp.compressors.sparse import SparsePayload, index_dtype, itemsize


def validate_density(density: float) -> float:
    """Return ``density`` as a float, or raise ``ValueError`` unless it lies in (0, 1]."""
    if isinstance(density, bool) or not isinstance(density, (int, float)) or not (0.0 < density <= 1.0):
        raise ValueError(f"density must be a number in (0, 1], got {density!r}")
    if not math.isfinite(density):
        raise ValueError(f"density must be a number in (0, 1], got {density!r}")
    return float(density)


def k_for(numel: int, density: float) -> int:
    """Entries to keep: ``max(1, int(density * numel))`` (the authors' rule), never above ``numel``."""
    if numel == 0:
        return 0
    return min(numel, max(1, int(density * numel)))


class TopKCompressor(Compressor):
    """Keeps the ``k = max(1, int(density * d))`` entries of largest magnitude (``torch.topk``).

    Biased (a contraction: ``||x - C(x)||^2 <= (1 - k/d) ||x||^2``); pair it with error feedback
    (``memory="ef"``) so the dropped mass is sent later.
    """

    name = "topk"
    unbiased = False
    sparse = True

    def __init__(self, density: float = 0.001) -> None:
        self.density = validate_density(density)

    def select(self, x: Tensor) -> Tensor:
        """Indices of the ``k`` largest ``|x|`` (unordered)."""
        k = k_for(x.numel(), self.density)
        return torch.topk(x.abs(), k, sorted=False).indices

    def compress(
        self, x: Tensor, generator: torch.Generator | None = None, scale: Tensor | None = None
    ) -> SparsePayload:
        flat = x.reshape(-1)
        indices = self.select(flat)
        return SparsePayload(indices, flat[indices], x.shape)

    def unpack(self, buffer: Tensor, shape: torch.Size, dtype: torch.dtype) -> SparsePayload:
        return SparsePayload.from_bytes(buffer, shape, dtype)

    def accumulate(self, payload: Payload, out: Tensor) -> Tensor:
        assert isinstance(payload, SparsePayload)
        return payload.accumulate(out)

    def payload_nbytes(self, shape: torch.Size, dtype: torch.dtype) -> int:
        numel = shape.numel()
        return k_for(numel, self.density) * (itemsize(index_dtype(numel)) + itemsize(dtype))
