"""Exact Top-k sparsification (Shi et al., "A Distributed Synchronous SGD Algorithm with Global Top-k
Sparsification for Low Bandwidth Networks", ICDCS 2019, Sec. III)."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from lightning_gradcomp.core.compressors.base import all_finite
from lightning_gradcomp.core.compressors.draws import Draws, stratified_positions
from lightning_gradcomp.core.compressors.ladder import top_k_by_levels
from lightning_gradcomp.core.compressors.radix import radix_top_k
from lightning_gradcomp.core.compressors.segments import Segments, at_least_in, largest, take
from lightning_gradcomp.core.compressors.sparse import FixedKSparsifier, SparsePayload, k_for
from lightning_gradcomp.core.host_waits import reads_wait
from lightning_gradcomp.core.validation import check_choice, check_density

#: How Top-k selects off the CPU (:attr:`TopKCompressor.device_selection`).
DEVICE_SELECTIONS = ("torch.topk", "radix", "levels")


def ascending_top_k(magnitudes: Tensor, k: int) -> Tensor:
    """Ascending positions of ``k`` largest of the 1-D ``magnitudes`` (ties at the cut: the first ones).

    The cut is the ``(c - k)``-th smallest magnitude (:func:`kth_smallest`), and the positions come out in order,
    which the wire, error feedback and a unit read in pieces all want. A NaN (ranked above everything, as
    ``torch.topk`` ranks it) takes ``torch.topk`` instead.
    """
    c = magnitudes.numel()
    if k >= c:
        return torch.arange(c, device=magnitudes.device)
    if k <= 0:
        return torch.empty(0, dtype=torch.long, device=magnitudes.device)
    if not all_finite(magnitudes):
        return torch.topk(magnitudes, k, sorted=False).indices.sort().values
    cut = kth_smallest(magnitudes, c - k)
    keep = magnitudes > cut
    wanted = k - int(torch.count_nonzero(keep))  # counted without an int64 copy of the mask (a bool sum makes one)
    if wanted:  # the first ``wanted`` entries at the cut, found by position (a running count would be int64 of all)
        keep[torch.nonzero(magnitudes == cut).reshape(-1)[:wanted]] = True
    return torch.nonzero(keep).reshape(-1)


#: Fewest entries :func:`kth_smallest` narrows to a band first; below it ``torch.kthvalue`` of them all is as fast.
BAND_FROM = 1 << 16
#: Entries of the systematic sample that places :func:`kth_smallest`'s band.
BAND_SAMPLE = 4096
#: Half-width of the band in binomial standard deviations of the rank's place in the sample.
BAND_MARGIN = 4.0


def kth_smallest(values: Tensor, rank: int) -> Tensor:
    """The ``rank``-th smallest (from 1) of the finite 1-D ``values``: ``torch.kthvalue(values, rank).values`` (the
    same value; where ``-0.0`` and ``0.0`` meet at the cut, either may come back).

    ``torch.kthvalue`` of 430,000 entries costs 5.7 ms on one CPU thread (a gTop-k merge's cut at 25.2M parameters).
    On the CPU, past :data:`BAND_FROM` entries, a systematic sample of :data:`BAND_SAMPLE` of them (every
    ``c / s``-th) places a band of values expected to hold the answer, :data:`BAND_MARGIN` binomial deviations wide
    (open at an end the margin passes); a count below the band and the band's positions check that it does, and
    ``kthvalue`` of the band alone finds it (3.2 ms in all, ``benchmarks/kernel_costs.py``). A band that misses takes
    ``kthvalue`` of them all: the sample decides only how fast, never what.
    """
    c = values.numel()
    if c < BAND_FROM or reads_wait(values.device) or not 1 <= rank <= c:  # on a device the counts would wait
        return torch.kthvalue(values, rank).values
    stride = c // BAND_SAMPLE
    sample = values[: stride * BAND_SAMPLE : stride].sort().values
    expected = BAND_SAMPLE * rank / c
    spread = BAND_MARGIN * math.sqrt(BAND_SAMPLE * (rank / c) * (1 - rank / c)) + 1
    lo_at, hi_at = math.floor(expected - spread) - 1, math.ceil(expected + spread)
    # a band that reaches past the sample's ends is open there (below its least value, above its largest)
    lo = sample[lo_at] if lo_at >= 0 else -math.inf
    hi = sample[hi_at] if hi_at < BAND_SAMPLE else math.inf
    below = int(torch.count_nonzero(values < lo))
    band = (values >= lo) & (values <= hi)
    inside = torch.nonzero(band).reshape(-1)
    if not below < rank <= below + inside.numel():
        return torch.kthvalue(values, rank).values
    return torch.kthvalue(values.index_select(0, inside), rank - below).values


class TopKCompressor(FixedKSparsifier):
    """Keeps exactly the ``k = max(1, int(density * d))`` entries of largest magnitude.

    Biased (a contraction: ``||x - C(x)||^2 <= (1 - k/d) ||x||^2``); pair it with error feedback
    (``memory="ef"``) so the dropped mass is sent later.

    Selection without a sort-like pass over all ``d`` entries (``torch.topk`` of a 1.8M-entry
    gradient costs more than a whole DDP step on a CPU), by the sampling of Lin et al., "Deep
    Gradient Compression" (ICLR 2018), Sec. 3, made exact:

    1. draw ``s = max(min_samples, min(ceil(sample_ratio * d), max_samples))`` positions from the unit's
       generator, one uniformly in each of ``s`` equal strata of ``x`` (a stratified sample,
       :func:`~lightning_gradcomp.core.compressors.draws.stratified_positions`: DGC draws them independently; the
       count below has at most the binomial variance the margin assumes, and the positions come in order, which a
       unit in pieces reads in runs); if ``s >= d``, or without a generator, use ``torch.topk`` on all of ``x``;
    2. ``thr`` = the ``m``-th largest ``|x|`` of the sample, ``m = ceil(mu + margin * sqrt(mu))``
       with ``mu = s * k / d`` the expected number of sampled entries among the true top ``k``
       (DGC takes ``m = mu``, which leaves too few candidates half the time);
    3. candidates: ``|x| >= thr``, found through per-block maxima
       (:class:`~lightning_gradcomp.core.compressors.blocks.MagnitudeBlocks`) at low densities, by one pass
       in cache-sized chunks past about 0.2% (:func:`~lightning_gradcomp.core.compressors.blocks.at_least`,
       where most blocks of 64 hold a candidate); with at least ``k`` of
       them, the result is the Top-k of the candidates, which *is* a Top-k of ``x`` (every entry
       at or above the ``k``-th largest magnitude is a candidate); otherwise ``torch.topk`` of all
       of ``x`` (well under 1% of calls with ``margin = 3``).

    The randomness decides only how fast the answer is found, never the answer (up to ties in
    magnitude, which any Top-k breaks arbitrarily), so payloads have a fixed size.
    """

    name = "topk"
    keeps_largest = True
    unbiased = False
    takes_segments = True
    #: fraction of entries sampled for the threshold, the smallest sample, and the rank margin in
    #: binomial standard deviations (the ``dgc`` compressor makes them arguments)
    sample_ratio: float = 0.01
    min_samples: int = 1000
    margin: float = 3.0
    #: the largest sample (``None``: ``sample_ratio`` of any tensor). 65536 samples place the threshold
    #: within 3 standard deviations of ``k`` for ``k * 65536 / d >= 100``: past that, a larger sample
    #: only costs time (the candidates' pass is the same, their Top-k about 10% smaller at density 0.01)
    max_samples: int | None = 1 << 16
    #: how a selection is found off the CPU: ``"torch.topk"`` (a radix select over all entries, no wait for the
    #: device; 2.2 ms for 1% of 1e8 entries on an H200, then a sort of the ``k`` indices), ``"radix"`` (three
    #: counting passes over the magnitudes' bits and one selecting pass, no wait either:
    #: :func:`~lightning_gradcomp.core.compressors.radix.radix_top_k`; not yet timed on a GPU) or ``"levels"`` (a
    #: ladder of thresholds counted in one pass, one wait, then a Top-k of the candidates)
    device_selection: str = "torch.topk"

    def __init__(self, density: float = 0.001) -> None:
        self.density = check_density("density", density)

    @property
    def vouches_finite(self) -> bool:
        """Whether this compressor's selections always hold a tensor's non-finite elements (when it has any): every
        path ranks a NaN or an infinity above all finite magnitudes (``torch.topk``, the candidates of a sampled
        threshold, the ladder of levels, which falls back to ``torch.topk`` on a non-finite tensor). A subclass that
        selects otherwise (its own :meth:`select` or :meth:`select_k`) says no."""
        return type(self).select is TopKCompressor.select and type(self).select_k is TopKCompressor.select_k

    def sample_size(self, numel: int) -> int:
        """Entries sampled from a tensor of ``numel`` entries (``>= numel`` means: ``torch.topk`` instead)."""
        wanted = math.ceil(self.sample_ratio * numel)
        return max(self.min_samples, wanted if self.max_samples is None else min(wanted, self.max_samples))

    def sample_threshold(self, flat: Tensor | Segments, generator: Draws = None) -> float | None:
        """The candidate threshold from a stratified random sample of ``|flat|``; ``None`` if the sample would be the
        whole tensor.

        ``generator`` (on ``flat``'s device) draws the sample; ``None`` uses torch's global generator.
        """
        d = flat.numel()
        s = self.sample_size(d)
        if s >= d:
            return None
        k = k_for(d, self.density)
        expected = s * k / d
        rank = min(s, max(1, math.ceil(expected + self.margin * math.sqrt(expected))))
        return float(torch.topk(self.sampled_magnitudes(flat, s, generator), rank, sorted=False).values.min())

    def sampled_magnitudes(self, flat: Tensor | Segments, count: int, generator: Draws) -> Tensor:
        """``|flat|`` at ``count < d`` positions drawn from ``generator``, one uniformly in each of ``count`` equal
        strata (:func:`~lightning_gradcomp.core.compressors.draws.stratified_positions`), read in order."""
        positions = stratified_positions(generator, flat.numel(), count, flat.device)
        return take(flat, positions, ascending=True).abs()

    def exact_select(self, flat: Tensor | Segments) -> Tensor:
        """Indices of the ``k`` largest ``|flat|`` by ``torch.topk`` (unordered)."""
        return largest(flat, k_for(flat.numel(), self.density))

    def select(self, x: Tensor | Segments, generator: Draws = None) -> Tensor:
        """Indices of the entries kept (unordered): all of them when ``k >= d``, else :meth:`select_k`'s."""
        flat = x.reshape(-1)
        k = k_for(flat.numel(), self.density)
        if k >= flat.numel():
            return torch.arange(flat.numel(), device=flat.device)
        return self.select_k(flat, k, generator)

    def select_k(self, flat: Tensor | Segments, k: int, generator: Draws = None) -> Tensor:
        """Indices of exactly ``k < d`` entries of largest ``|flat|``; see the class for the method. Off the CPU, as
        :attr:`device_selection` says, without the sampled threshold's count and fallback, which would make the host
        wait for the device several times: by default ``torch.topk``, which never waits."""
        if reads_wait(flat.device):
            way = check_choice("device_selection", self.device_selection, DEVICE_SELECTIONS)
            chosen = None
            if way == "radix":
                chosen = radix_top_k(flat, k)
            elif way == "levels":
                chosen = top_k_by_levels(flat, k, self.density)
            return self.exact_select(flat).sort().values if chosen is None else chosen
        if generator is None:
            return self.exact_select(flat)
        thr = self.sample_threshold(flat, generator)
        if thr is None or not math.isfinite(thr):
            return self.exact_select(flat)
        candidates = at_least_in(flat, thr, k / flat.numel())
        if candidates.numel() < k:
            return self.exact_select(flat)
        return candidates.index_select(0, ascending_top_k(take(flat, candidates, ascending=True).abs(), k))

    def compress(self, x: Tensor | Segments, generator: Draws = None, scale: Tensor | None = None) -> SparsePayload:
        """The ``k`` entries; ``x`` may be :class:`~lightning_gradcomp.core.compressors.segments.Segments` (a unit read
        in DDP's bucket), which select exactly the entries its concatenation would."""
        flat = x.reshape(-1)
        indices = self.select(flat, generator)
        return SparsePayload(indices, take(flat, indices), x.shape, largest=self.vouches_finite)
