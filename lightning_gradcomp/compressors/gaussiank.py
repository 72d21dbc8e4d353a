"""Gaussian_k: a Top-k threshold estimated from the mean and standard deviation, in O(d).

Shi et al., "Understanding Top-k Sparsification in Distributed Deep Learning" (2019), Sec. 5
(Algorithm "Gaussian_k"); ALGORITHMS.md Sec. 5. Residual-corrected gradients are bell-shaped,
so if ``acc ~ N(mu, sigma^2)`` the ``k = rho * d`` entries of largest magnitude lie beyond

    thr = mu + Phi^-1(1 - rho / 2) * sigma

(``rho / 2`` in each tail). The threshold costs two reductions instead of a sort or a selection,
and a few refinements repair it when the data are not Gaussian (``2k/3 <= count <= 4k/3`` is
accepted; below, ``thr *= 0.5``; above, ``thr *= 1.5``; at most three times). The count is
approximate, so ranks send different numbers of entries: aggregate with ``"allgather"`` (sizes
are exchanged) or ``"gtopk"`` (which keeps at most ``k`` entries per rank).
"""

from __future__ import annotations

import functools
import math

import torch
from torch import Tensor

from lightning_gradcomp.compressors.topk import TopKCompressor, k_for

#: Accepted count window, as fractions of ``k`` (the paper's ``2k/3`` and ``4k/3``).
LOWER, UPPER = 2.0 / 3.0, 4.0 / 3.0
#: Threshold factors applied when the count is below / above the window (the paper's values).
SHRINK, GROW = 0.5, 1.5


def _gap(count: int, k: int) -> float:
    """How far ``count`` is from ``k``, as ``|log(count / k)|`` (infinite for an empty selection)."""
    return abs(math.log(count / k)) if count else math.inf


@functools.lru_cache(maxsize=64)
def normal_quantile(p: float) -> float:
    """``Phi^-1(p)``, the standard normal quantile, for ``0 < p < 1`` (``torch.special.ndtri`` in float64)."""
    return float(torch.special.ndtri(torch.tensor(p, dtype=torch.float64)))


class GaussianKCompressor(TopKCompressor):
    """Keeps about ``k = max(1, int(density * d))`` entries of largest magnitude, found by a Gaussian threshold.

    Selection (:meth:`select`), all passes O(d), no sort:

    1. ``mu`` and ``sigma`` of ``acc`` from one sum and one sum of squares
       (``sigma^2 = E[x^2] - mu^2``; both reductions read the tensor once and allocate nothing;
       the difference loses precision only when ``|mu| >> sigma``, which the refinements absorb);
    2. ``thr = |mu| + Phi^-1(1 - rho/2) * sigma``; find the entries with ``|acc| > thr``;
    3. up to ``refinements`` times: ``thr *= 0.5`` if their count is below ``2k/3``, ``thr *= 1.5``
       if above ``4k/3``, and find them again (a raised threshold only filters the current ones).

    Deviations from the paper, all for inputs far from the paper's bell shape:

    * ``|mu|`` instead of ``mu``: Top-k is invariant under ``acc -> -acc`` and so is this
      threshold. The paper's ``mu + z * sigma`` turns negative when ``mu < -z * sigma`` and then
      selects every entry; for ``mu >= 0`` both agree, and gradients have ``mu`` close to 0.
    * When no threshold tried lands in the window, the one whose count was closest to ``k``
      (in ratio) is used, not the last one: the coarse factors can overshoot, e.g. counts of
      0.64k, 92k, 11k, 0.15k for ``N(0.1 sigma, sigma^2)`` data at ``rho = 0.001``, where the
      paper would return the last, 0.15k.
    * Fallback to exact Top-k (``torch.topk``, ``k`` entries) when the refined threshold still
      selects nothing although the tensor is nonzero (a constant tensor, or a tensor whose
      entries all share one magnitude), or selects more than half of the entries while more
      than ``4k/3`` were wanted (a sparse payload of ``d/2`` entries outweighs the dense tensor).
      The paper would send nothing, or everything, in those cases. An all-zero tensor selects
      nothing (an empty payload).

    The count varies per call and per rank, so :meth:`payload_nbytes` is ``None``. Counting uses
    per-block maxima (:class:`MagnitudeBlocks`), so each refinement touches only the few blocks
    holding candidates rather than all ``d`` entries again.

    Args:
        density: the target fraction ``rho = k / d`` of entries kept, in (0, 1].
        refinements: how many times the threshold may be rescaled, an integer in [0, 10]
            (the paper uses 3).
    """

    name = "gaussiank"

    def __init__(self, density: float = 0.001, refinements: int = 3) -> None:
        super().__init__(density)
        if isinstance(refinements, bool) or not isinstance(refinements, int) or not (0 <= refinements <= 10):
            raise ValueError(f"refinements must be an integer in [0, 10], got {refinements!r}")
        self.refinements = refinements

    def payload_nbytes(self, shape: torch.Size, dtype: torch.dtype) -> None:
        """``None``: the number of entries, hence the size, varies per call and per rank."""
        return None

    def threshold(self, x: Tensor) -> float:
        """The initial threshold ``|mu| + Phi^-1(1 - rho/2) * sigma`` of the flat tensor ``x`` (0 for an empty one)."""
        d = x.numel()
        if d == 0:
            return 0.0
        acc_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
        total = float(torch.sum(x, dtype=acc_dtype))
        sumsq = float(torch.linalg.vector_norm(x, dtype=acc_dtype)) ** 2
        mu = total / d
        sigma = math.sqrt(max(sumsq / d - mu * mu, 0.0))
        # read at every call: a density schedule may change ``self.density`` between epochs
        z = normal_quantile(1.0 - self.density / 2.0) if self.density < 1.0 else 0.0
        return abs(mu) + z * sigma

    def select(self, x: Tensor) -> Tensor:
        """Indices of the entries with ``|x| > thr`` for the refined Gaussian threshold; see the class."""
        flat = x.reshape(-1)
        d = flat.numel()
        k = k_for(d, self.density)
        if k >= d:
            return torch.arange(d, device=flat.device)
        thr = self.threshold(flat)
        if not math.isfinite(thr):
            return super().select(flat)
        blocks = MagnitudeBlocks(flat)
        if blocks.peak() == 0.0:
            return torch.empty(0, dtype=torch.long, device=flat.device)
        indices = blocks.above(thr)
        lower, upper = LOWER * k, UPPER * k
        best = indices
        for _ in range(self.refinements):
            count = indices.numel()
            if count < lower:
                thr *= SHRINK
                indices = blocks.above(thr)
            elif count > upper:
                thr *= GROW
                indices = indices[flat[indices].abs() > thr]
            else:
                break
            if _gap(indices.numel(), k) < _gap(best.numel(), k):
                best = indices
        count = best.numel()
        if count == 0 or (count > upper and 2 * count > d):
            return super().select(flat)
        return best


class MagnitudeBlocks:
    """The largest ``|x|`` of each block of ``block`` consecutive entries, to find large entries without a full pass.

    Built with two reductions (``amax``, ``amin``) that read the tensor once each and write
    ``d / block`` numbers. :meth:`above` then touches only the blocks whose largest magnitude
    passes the threshold: for a threshold that keeps ``c`` entries, at most ``c`` blocks, so
    ``O(d / block + c * block)`` work instead of comparing (and allocating a mask for) all ``d``
    entries. Every threshold tried by a refinement loop reuses the same block maxima.
    """

    def __init__(self, flat: Tensor, block: int = 64) -> None:
        if isinstance(block, bool) or not isinstance(block, int) or block < 1:
            raise ValueError(f"block must be an integer >= 1, got {block!r}")
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
