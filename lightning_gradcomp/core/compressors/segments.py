"""A flat tensor held in pieces: a unit of several parameters read where DDP left their gradients.

A unit that spans several parameters (the whole model, for the Top-k family's authors' setting)
is one flat vector to its compressor, but its gradients lie in DDP's buckets, one view per
parameter, not side by side. Copying them into a flat buffer costs a model-sized tensor and a
pass over it every step. A compressor that only reads entries and picks some of them (Top-k)
reads the pieces instead: :class:`Segments` maps flat indices to (piece, offset), and takes the
average back the same way (the scatter operations a sparse sum needs), so the average lands in
the bucket without a flat buffer either.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cached_property
from itertools import accumulate

import torch
from torch import Tensor

from lightning_gradcomp.core.compressors.blocks import BlockPeaks, MagnitudeBlocks, above
from lightning_gradcomp.core.compressors.indices import edges_if_ascending, narrowed
from lightning_gradcomp.core.host_copies import device_tensor

__all__ = [
    "PieceBlocks",
    "Segments",
    "above_in",
    "adjoining",
    "at_least_in",
    "largest",
    "magnitude_blocks",
    "pieces",
    "take",
]


class Segments:
    """The concatenation of the flat tensors ``parts`` (views; one dtype and device), never materialized.

    Offers what a selecting compressor and a sparse sum need of a flat tensor: its size, entries
    gathered or scattered by flat index, zeroing and scaling in place, and its parts back by size.
    """

    def __init__(self, parts: Sequence[Tensor]) -> None:
        if not parts:
            raise ValueError("Segments needs at least one part")
        self.parts = [p.reshape(-1) for p in parts]
        first = self.parts[0]
        if any(p.dtype != first.dtype or p.device != first.device for p in self.parts):
            raise ValueError("the parts of Segments must share one dtype and device")
        self.numels = [p.numel() for p in self.parts]
        self.starts = [0, *accumulate(self.numels[:-1])]

    @cached_property
    def _bounds(self) -> Tensor:
        """The first flat index of every part but the first (searchsorted on it gives an index's part), made where an
        index is first routed: a unit read in pieces by a codec that never routes one (a 16-bit wire) copies none."""
        return device_tensor(self.starts[1:], torch.long, self.device)

    @property
    def dtype(self) -> torch.dtype:
        return self.parts[0].dtype

    @property
    def device(self) -> torch.device:
        return self.parts[0].device

    @property
    def shape(self) -> torch.Size:
        return torch.Size([self.numel()])

    def numel(self) -> int:
        return sum(self.numels)

    def _routes(self, indices: Tensor, ascending: bool = False) -> list[tuple[slice | Tensor, Tensor, Tensor]]:
        """Per part: (its positions in ``indices``, the local indices there, the part). Ascending ``indices`` (said
        so, or found so: decoded payloads and Top-k's selections are) are cut into runs by one binary search per
        part; others are sorted out by part with a mask each."""
        routes: list[tuple[slice | Tensor, Tensor, Tensor]] = []
        bounds = self._bounds.to(indices.dtype)  # of the indices' dtype: else searchsorted widens them all
        inner = torch.searchsorted(indices, bounds).tolist() if ascending else edges_if_ascending(indices, bounds)
        if inner is not None:  # the check and the binary search read back at once
            edges = [0, *inner, indices.numel()]
            for part, start, lo, hi in zip(self.parts, self.starts, edges[:-1], edges[1:], strict=True):
                if hi > lo:  # the first part's indices are its own: a view, no copy
                    routes.append((slice(lo, hi), indices[lo:hi] - start if start else indices[lo:hi], part))
            return routes
        which = torch.searchsorted(bounds, indices, right=True)
        for i, (part, start) in enumerate(zip(self.parts, self.starts, strict=True)):
            positions = torch.nonzero(which == i).reshape(-1)
            if positions.numel():
                routes.append((positions, indices[positions] - start, part))
        return routes

    def gather(self, indices: Tensor, ascending: bool = False) -> Tensor:
        """The entries at the flat ``indices`` (repeats allowed; ``ascending`` when they are sorted), in that order."""
        out = torch.empty(indices.numel(), dtype=self.dtype, device=self.device)
        for positions, local, part in self._routes(indices.reshape(-1), ascending):
            if isinstance(positions, slice):  # a run: gathered straight into its place
                torch.index_select(part, 0, local, out=out[positions])
            else:
                out[positions] = part.index_select(0, local)
        return out

    def index_add_(self, dim: int, indices: Tensor, values: Tensor, alpha: float = 1.0) -> Segments:
        """``self[indices] += alpha * values`` (repeats add up, in order), as ``Tensor.index_add_`` on dim 0."""
        if dim != 0:
            raise ValueError(f"Segments are flat: dim must be 0, got {dim}")
        for positions, local, part in self._routes(indices):
            part.index_add_(0, local, values[positions], alpha=alpha)
        return self

    def index_put_(self, indices: tuple[Tensor], values: Tensor) -> Segments:
        """``self[indices[0]] = values``, as ``Tensor.index_put_`` with one flat index tensor."""
        for positions, local, part in self._routes(indices[0]):
            part.index_put_((local,), values[positions])
        return self

    def zero_(self) -> Segments:
        for part in self.parts:
            part.zero_()
        return self

    def copy_(self, flat: Tensor) -> Segments:
        """Each part overwritten by its slice of the flat ``flat`` (cast to the parts' dtype)."""
        for part, start in zip(self.parts, self.starts, strict=True):
            part.copy_(flat[start : start + part.numel()])
        return self

    def joined(self) -> Tensor:
        """The concatenation itself, as a new flat tensor (for what needs one tensor, off the hot path)."""
        return torch.cat(self.parts)

    def div_(self, divisor: float | Tensor) -> Segments:
        """Each entry divided by ``divisor``: a number, or a flat tensor of one divisor per entry."""
        for part, start in zip(self.parts, self.starts, strict=True):
            part.div_(divisor[start : start + part.numel()] if isinstance(divisor, Tensor) else divisor)
        return self

    def split(self, numels: Sequence[int]) -> list[Tensor]:
        """The parts, when ``numels`` are their sizes (how the hook hands each parameter its share)."""
        if list(numels) != self.numels:
            raise ValueError(f"Segments of parts {self.numels} cannot be split as {list(numels)}")
        return list(self.parts)

    def reshape(self, *shape: int) -> Segments:
        """Itself, for ``reshape(-1)``: already flat."""
        if tuple(shape) not in ((-1,), (self.numel(),)):
            raise ValueError(f"Segments are flat and cannot take the shape {shape}")
        return self

    def topk_indices(self, k: int) -> Tensor:
        """Flat indices of ``k`` entries of largest magnitude (unordered): each part's best, then the best of those."""
        best_values, best_indices = [], []
        for part, start in zip(self.parts, self.starts, strict=True):
            top = torch.topk(part.abs(), min(k, part.numel()), sorted=False)
            best_values.append(top.values)
            best_indices.append(top.indices.add_(start))
        values, indices = torch.cat(best_values), torch.cat(best_indices)
        return indices[torch.topk(values, k, sorted=False).indices]


def adjoining(parts: Sequence[Tensor]) -> Tensor | None:
    """``parts`` as one flat view when they lie back to back, in order, in one storage (a unit inside one of
    DDP's buckets: the bucket's gradients are views of its buffer), else ``None``."""
    first = parts[0]
    storage, offset = first.untyped_storage().data_ptr(), first.storage_offset()
    for part in parts:
        if part.untyped_storage().data_ptr() != storage or part.storage_offset() != offset or not part.is_contiguous():
            return None
        offset += part.numel()
    return first.as_strided((offset - first.storage_offset(),), (1,), first.storage_offset())


def pieces(x: Tensor | Segments, numels: Sequence[int]) -> list[Tensor]:
    """The flat share of each parameter of a unit's tensor, of ``numels`` elements each (views, never copies)."""
    if isinstance(x, Segments):
        return x.split(numels)
    return list(x.reshape(-1).split(list(numels)))


def take(x: Tensor | Segments, indices: Tensor, ascending: bool = False) -> Tensor:
    """The entries of the flat ``x`` at the 1-D ``indices``, whether it is one tensor or pieces (``ascending``: the
    indices are sorted, which pieces route faster). A tensor's by ``index_select``: on one CPU thread about half the
    time of ``x[indices]`` for int32 positions (``benchmarks/kernel_costs.py``)."""
    return x.gather(indices, ascending) if isinstance(x, Segments) else x.index_select(0, indices)


def largest(x: Tensor | Segments, k: int) -> Tensor:
    """Flat indices of ``k`` entries of largest magnitude of the flat ``x`` (unordered), by ``torch.topk``."""
    if isinstance(x, Segments):
        return x.topk_indices(k)
    return torch.topk(x.abs(), k, sorted=False).indices


def above_in(x: Tensor | Segments, thr: float, fraction: float, inclusive: bool = False) -> Tensor:
    """Ascending flat indices of the entries with ``|x| > thr`` (``>=`` when ``inclusive``; :func:`~.blocks.above`
    part by part): the same indices, in the same order, as on the concatenated tensor."""
    if not isinstance(x, Segments):
        return above(x, thr, fraction, inclusive)
    numel = x.numel()  # the pieces' indices widened where the whole tensor's would not fit in theirs
    found = [
        narrowed(above(part, thr, fraction, inclusive), numel).add_(start)
        for part, start in zip(x.parts, x.starts, strict=True)
    ]
    return torch.cat(found)


def at_least_in(x: Tensor | Segments, thr: float, fraction: float) -> Tensor:
    """Ascending flat indices of the entries with ``|x| >= thr``: :func:`above_in`, inclusive."""
    return above_in(x, thr, fraction, inclusive=True)


class PieceBlocks(BlockPeaks):
    """:class:`~lightning_gradcomp.core.compressors.blocks.MagnitudeBlocks` of each piece of :class:`Segments`,
    answering as those of one tensor: the block maxima never span two pieces, and each block still holds one entry at
    its maximum, so :meth:`kth_peak`'s guarantee holds as it is."""

    def __init__(self, x: Segments, block: int = 64) -> None:
        self.x = x
        self.pieces = [MagnitudeBlocks(part, block) for part in x.parts]
        self.peaks = torch.cat([b.peaks for b in self.pieces])

    def above(self, thr: float, inclusive: bool = False) -> Tensor:
        """Ascending flat indices of the entries with ``|x| > thr`` (``>=`` when ``inclusive``)."""
        found = [b.above(thr, inclusive).add_(start) for b, start in zip(self.pieces, self.x.starts, strict=True)]
        return torch.cat(found)


def magnitude_blocks(x: Tensor | Segments, block: int = 64) -> MagnitudeBlocks | PieceBlocks:
    """The block maxima of the flat ``x``, whether it is one tensor or pieces."""
    return PieceBlocks(x, block) if isinstance(x, Segments) else MagnitudeBlocks(x, block)
