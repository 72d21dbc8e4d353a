"""Per-block maxima of |x|: find the entries above a threshold without comparing all of them."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from lightning_gradcomp.core.compressors.base import STREAM_CHUNK, chunk_for
from lightning_gradcomp.core.compressors.indices import position_dtype
from lightning_gradcomp.core.validation import check_int

#: Past one passing block in this many, :meth:`MagnitudeBlocks.above` streams over the whole tensor instead.
STREAM_FRACTION = 8


def sparse_nonzero(mask: Tensor) -> Tensor:
    """Ascending indices of the True entries of the flat bool ``mask``, fast when they are few.

    Looks at eight entries at a time (one int64 word) first, then inside the words that hold any, gathered into
    one flat mask (a 1-D ``nonzero``: a 2-D one writes twice the coordinates, more slowly): about twice as fast as
    ``torch.nonzero`` at 1% of entries set, as fast at 3% (one CPU thread).
    """
    numel = mask.numel()
    body = numel - numel % 8
    words = torch.nonzero(mask[:body].view(torch.int64)).reshape(-1)
    inside = torch.nonzero(mask[:body].view(-1, 8).index_select(0, words).reshape(-1)).reshape(-1)
    indices = words.index_select(0, inside >> 3).mul_(8).add_(inside & 7)
    if body < numel:
        indices = torch.cat([indices, torch.nonzero(mask[body:]).reshape(-1) + body])
    return indices


def streamed_above(flat: Tensor, thr: float, inclusive: bool = False) -> Tensor:
    """Ascending indices of the entries of the 1-D ``flat`` with ``|x| > thr`` (``>=`` when ``inclusive``), chunk by
    chunk: no temporary of the tensor's size (``|x|`` and its mask of a whole 25M-entry model would be 125 MB). The
    indices are int32 while ``flat`` has at most ``2^31`` entries (:func:`~.indices.position_dtype`).

    The test is ``hardshrink``'s, ``|x| > lambda`` in one pass (``lambda``: ``thr``, or the ``flat`` dtype's
    number just below it for ``>=``), and its result becomes a mask by a cast: on one CPU thread 3.5x faster
    than ``abs`` then a comparison (``benchmarks/kernel_costs.py``). A NaN passes (as ``torch.topk`` ranks NaN above
    everything). The mask covers a chunk, whose set entries one :func:`sparse_nonzero` finds; the test's values go
    through a buffer of a quarter of it (on the CPU: 1 MiB of fp32 instead of 4).
    """
    dtype = position_dtype(flat.numel())
    if thr < 0 or (inclusive and thr == 0):
        return torch.arange(flat.numel(), dtype=dtype, device=flat.device)
    if inclusive:
        below = torch.tensor(thr, dtype=flat.dtype).nextafter(torch.tensor(-math.inf, dtype=flat.dtype))
        thr = float(below)
    span = chunk_for(flat.device, STREAM_CHUNK)
    size = min(flat.numel(), span)
    quarter = -(-size // 4) if flat.device.type == "cpu" else size
    shrunk = torch.empty(quarter, dtype=flat.dtype, device=flat.device)
    mask = torch.empty(size, dtype=torch.bool, device=flat.device)
    found = []
    for start in range(0, flat.numel(), span):
        chunk = flat[start : start + span]
        n = chunk.numel()
        for at in range(0, n, quarter):
            piece = chunk[at : at + quarter]
            m = piece.numel()
            torch.ops.aten.hardshrink.out(piece, thr, out=shrunk[:m])
            mask[at : at + m].copy_(shrunk[:m])
        found.append(sparse_nonzero(mask[:n]).to(dtype).add_(start))
    return torch.cat(found) if found else torch.empty(0, dtype=dtype, device=flat.device)


class BlockPeaks:
    """The answers block maxima give (``peaks``: the largest ``|x|`` of each block), whatever cut the blocks."""

    peaks: Tensor

    def kth_peak(self, k: int) -> float:
        """The ``k``-th largest block maximum: at least ``k`` entries have ``|x|`` at or above it
        (``0.0`` when there are fewer than ``k`` blocks, which every entry reaches)."""
        if k > self.peaks.numel():
            return 0.0
        return float(torch.topk(self.peaks, k, sorted=False).values.min())


class MagnitudeBlocks(BlockPeaks):
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

    def above(self, thr: float, inclusive: bool = False) -> Tensor:
        """Ascending indices of the entries with ``|x| > thr`` (``>=`` when ``inclusive``); a NaN passes.

        When more than one block in :data:`STREAM_FRACTION` passes (a threshold keeping about 1% of the
        entries reaches half of the blocks of 64), copying those blocks out costs more than one pass
        over the tensor in cache-sized chunks, which is taken instead.
        """
        blocks = torch.nonzero(passes(self.peaks[: self._full], thr, inclusive)).reshape(-1)
        if blocks.numel() * STREAM_FRACTION > self._full:
            return streamed_above(self.flat, thr, inclusive)
        hits = torch.nonzero(passes(self._body.index_select(0, blocks).abs(), thr, inclusive))
        indices = blocks[hits[:, 0]] * self.block + hits[:, 1]
        if self._tail.numel() and bool(passes(self.peaks[-1], thr, inclusive)):
            tail = torch.nonzero(passes(self._tail.abs(), thr, inclusive)).reshape(-1) + self._full * self.block
            indices = torch.cat([indices, tail])
        return indices


def passes(magnitudes: Tensor, thr: float, inclusive: bool) -> Tensor:
    """``magnitudes > thr`` (``>=`` when ``inclusive``), a NaN passing: as :func:`streamed_above` tests, so that a
    selection holds every NaN it can (a block's maximum is NaN where an element is)."""
    return ~(magnitudes < thr) if inclusive else ~(magnitudes <= thr)


def streams(fraction: float, block: int = 64) -> bool:
    """Whether finding entries above a threshold that about ``fraction`` of them pass takes one streamed pass
    rather than block maxima: once more than one block in :data:`STREAM_FRACTION` would hold one."""
    passing = 1.0 - (1.0 - min(max(fraction, 0.0), 1.0)) ** block  # blocks holding at least one such entry
    return passing * STREAM_FRACTION > 1.0


def above(flat: Tensor, thr: float, fraction: float, inclusive: bool = False, block: int = 64) -> Tensor:
    """Ascending indices of the entries with ``|x| > thr`` (``>=`` when ``inclusive``), where about ``fraction`` of
    them are expected to be: by one streamed pass when :func:`streams` says so, else through block maxima."""
    if streams(fraction, block):
        return streamed_above(flat, thr, inclusive)
    return MagnitudeBlocks(flat, block).above(thr, inclusive)


def at_least(flat: Tensor, thr: float, fraction: float, block: int = 64) -> Tensor:
    """Ascending indices of the entries with ``|x| >= thr``: :func:`above`, inclusive."""
    return above(flat, thr, fraction, inclusive=True, block=block)
