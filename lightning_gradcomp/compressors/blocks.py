"""Per-block maxima of |x|: find the entries above a threshold without comparing all of them."""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_gradcomp.validation import check_int


class MagnitudeBlocks:
    """The largest ``|x|`` of each block of ``block`` consecutive entries, to find large entries without a full pass.

    Built with two reductions (``amax``, ``amin``) that read the tensor once each and write
    ``d / block`` numbers. :meth:`above` then touches only the blocks whose largest magnitude
    passes the threshold: for a threshold that keeps ``c`` entries, at most ``c`` blocks, so
    ``O(d / block + c * block)`` work instead of comparing (and allocating a mask for) all ``d``
    entries. Every threshold tried by a refinement loop reuses the same block maxima.
    """

    def __init__(self, flat: Tensor, block: int = 64) -> None:
        check_int("block", block, 1)
        self.flat = flat
        self.block = block
        self._full = flat.numel() // block
        self._body = flat[: self._full * block].view(self._full, block)
        self._tail = flat[self._full * block :]
        peaks = torch.maximum(self._body.amax(1), self._body.amin(1).neg())
        if self._tail.numel():
            peaks = torch.cat([peaks, self._tail.abs().amax().reshape(1).to(peaks.dtype)])
        self.peaks = peaks

    def peak(self) -> float:
        """The largest ``|x|`` (0 for an all-zero or empty tensor)."""
        return float(self.peaks.max()) if self.peaks.numel() else 0.0

    def kth_peak(self, k: int) -> float:
        """The ``k``-th largest block maximum: at least ``k`` entries have ``|x|`` at or above it
        (``0.0`` when there are fewer than ``k`` blocks, which every entry reaches)."""
        if k > self.peaks.numel():
            return 0.0
        return float(torch.topk(self.peaks, k, sorted=False).values.min())

    def above(self, thr: float, inclusive: bool = False) -> Tensor:
        """Ascending indices of the entries with ``|x| > thr`` (``>=`` when ``inclusive``)."""
        compare = torch.ge if inclusive else torch.gt
        blocks = torch.nonzero(compare(self.peaks[: self._full], thr)).reshape(-1)
        hits = torch.nonzero(compare(self._body.index_select(0, blocks).abs(), thr))
        indices = blocks[hits[:, 0]] * self.block + hits[:, 1]
        if self._tail.numel() and bool(compare(self.peaks[-1], thr)):
            tail = torch.nonzero(compare(self._tail.abs(), thr)).reshape(-1) + self._full * self.block
            indices = torch.cat([indices, tail])
        return indices
