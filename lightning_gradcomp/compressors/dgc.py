"""DGC's sampled Top-k: a threshold from a random sample, then exact Top-k among the candidates.

Lin et al., "Deep Gradient Compression" (ICLR 2018), Sec. 3 and its sampling-based selection;
the baseline "DGC sampling" of Shi et al., "Understanding Top-k Sparsification in Distributed
Deep Learning" (2019), Sec. 5; ALGORITHMS.md Sec. 5. Selecting among a few candidates instead of
all ``d`` entries costs two comparisons per entry plus a Top-k of about ``k`` candidates.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from lightning_gradcomp.compressors.gaussiank import MagnitudeBlocks
from lightning_gradcomp.compressors.sparse import SparsePayload
from lightning_gradcomp.compressors.topk import TopKCompressor, k_for, validate_density


class DGCCompressor(TopKCompressor):
    """Exactly ``k = max(1, int(density * d))`` entries of largest magnitude, found through a sample.

    Selection (:meth:`select`):

    1. draw ``s = max(min_samples, ceil(sample_ratio * d))`` positions uniformly (with
       replacement, from the rank's ``torch.Generator``); if ``s >= d`` use exact Top-k instead;
    2. ``thr`` = the ``m``-th largest ``|x|`` of the sample, ``m = ceil(mu + margin * sqrt(mu))``
       with ``mu = s * k / d`` the expected number of sampled entries among the true top ``k``;
    3. candidates: ``|x| >= thr`` (found through per-block maxima,
       :class:`~lightning_gradcomp.compressors.gaussiank.MagnitudeBlocks`); if there are at least
       ``k``, the result is the exact Top-k of the candidates, which is an exact Top-k of ``x``
       (every entry at or above the ``k``-th largest magnitude is a candidate); otherwise exact
       Top-k of all of ``x``.

    Deviation from DGC: DGC takes the ``rho * s``-th largest sample entry (``margin = 0``), which
    leaves fewer than ``k`` candidates about half the time, and then lowers the threshold in a
    loop. Raising the rank by ``margin`` binomial standard deviations (default 3) makes that
    rare (well under 1% of calls) at the price of about ``k * margin / sqrt(mu)`` extra candidates,
    and the exact fallback keeps the count at exactly ``k``, so payloads have a fixed size
    (:meth:`payload_nbytes`, no size exchange in the allgather).

    Args:
        density: the fraction ``rho = k / d`` of entries kept, in (0, 1].
        sample_ratio: fraction of entries sampled, in (0, 1] (DGC: 0.1% to 1%; default 1%).
        min_samples: the smallest sample, an integer >= 1 (small tensors are sampled whole,
            which means exact Top-k).
        margin: how many binomial standard deviations the sample rank is raised by, a finite
            number >= 0.
    """

    name = "dgc"

    def __init__(
        self, density: float = 0.001, sample_ratio: float = 0.01, min_samples: int = 1000, margin: float = 3.0
    ) -> None:
        super().__init__(density)
        try:
            self.sample_ratio = validate_density(sample_ratio)
        except ValueError:
            raise ValueError(f"sample_ratio must be a number in (0, 1], got {sample_ratio!r}") from None
        if isinstance(min_samples, bool) or not isinstance(min_samples, int) or min_samples < 1:
            raise ValueError(f"min_samples must be an integer >= 1, got {min_samples!r}")
        self.min_samples = min_samples
        if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not math.isfinite(margin) or margin < 0:
            raise ValueError(f"margin must be a finite number >= 0, got {margin!r}")
        self.margin = float(margin)

    def sample_size(self, numel: int) -> int:
        """Entries sampled from a tensor of ``numel`` entries (``>= numel`` means: use exact Top-k)."""
        return max(self.min_samples, math.ceil(self.sample_ratio * numel))

    def sample_threshold(self, flat: Tensor, generator: torch.Generator | None = None) -> float | None:
        """The candidate threshold from a random sample of ``|flat|``; ``None`` if the sample would be the whole tensor.

        ``generator`` (on ``flat``'s device) draws the sample; ``None`` uses torch's global generator.
        """
        d = flat.numel()
        s = self.sample_size(d)
        if s >= d:
            return None
        k = k_for(d, self.density)
        expected = s * k / d
        rank = min(s, max(1, math.ceil(expected + self.margin * math.sqrt(expected))))
        positions = torch.randint(0, d, (s,), generator=generator, device=flat.device)
        sample = flat[positions].abs()
        return float(torch.topk(sample, rank, sorted=False).values.min())

    def select(self, x: Tensor, generator: torch.Generator | None = None) -> Tensor:
        """Indices of exactly ``k`` entries of largest ``|x|`` (unordered); see the class for the method."""
        flat = x.reshape(-1)
        d = flat.numel()
        k = k_for(d, self.density)
        if k >= d:
            return torch.arange(d, device=flat.device)
        thr = self.sample_threshold(flat, generator)
        if thr is None or not math.isfinite(thr):
            return super().select(flat)
        candidates = MagnitudeBlocks(flat).above(thr, inclusive=True)
        if candidates.numel() < k:
            return super().select(flat)
        best = torch.topk(flat[candidates].abs(), k, sorted=False).indices
        return candidates[best]

    def compress(
        self, x: Tensor, generator: torch.Generator | None = None, scale: Tensor | None = None
    ) -> SparsePayload:
        flat = x.reshape(-1)
        indices = self.select(flat, generator)
        return SparsePayload(indices, flat[indices], x.shape)
