"""A magnitude threshold found on the device in two passes and one read-back: the counts of entries at or above a
geometric ladder of levels, from one histogram of log-magnitudes.

On a GPU, the CPU's ways of finding a Top-k threshold (a sampled threshold whose candidates are counted, Gaussian_k's
refinements, each count read by the host) make the host wait for the device once per try: hundreds of waits for a
large bucket. Here every level's count comes from one pass, and the host reads one small tensor (the chosen level's
count, and whether the tensor is finite) to size the selection exactly.

The levels are ``centre * 2^((j - LEVELS / 2) / STEPS_PER_OCTAVE)`` for ``j = 0 .. LEVELS - 1``: 2^(1/32) apart
(a Gaussian tail near the 1% quantile holds about 1.2 times as many entries at one level as at the next), from
``centre / 16`` to ``centre * 16``. An entry's level is ``floor(v)``, ``v = STEPS_PER_OCTAVE * log2(|x| / centre) +
LEVELS / 2``, computed the same way (the same operations in the same order, so bit for bit) in the counting pass and
in the selecting pass: the selection ``v >= j`` holds exactly ``counts[j]`` entries, with no tie or rounding between
a count and its mask.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator

import torch
from torch import Tensor

from lightning_gradcomp.core.compressors.base import STREAM_CHUNK, chunk_for
from lightning_gradcomp.core.compressors.segments import Segments

#: Levels per doubling of the magnitude, and levels in all (a power of two, so that ``histc``'s bin of ``v`` is
#: exactly ``floor(v)``: its ``v * LEVELS / LEVELS`` rounds nothing).
STEPS_PER_OCTAVE = 32
LEVELS = 256


@functools.lru_cache(maxsize=64)
def normal_quantile(p: float) -> float:
    """``Phi^-1(p)``, the standard normal quantile, for ``0 < p < 1`` (``torch.special.ndtri`` in float64)."""
    return float(torch.special.ndtri(torch.tensor(p, dtype=torch.float64)))


def pieces(flat: Tensor | Segments) -> Iterator[tuple[int, Tensor]]:
    """``(start, piece)`` over the flat tensor (or the parts of :class:`Segments`) in chunks of
    :func:`~lightning_gradcomp.core.compressors.base.chunk_for` elements."""
    parts = zip(flat.starts, flat.parts, strict=True) if isinstance(flat, Segments) else [(0, flat)]
    for offset, part in parts:
        span = chunk_for(part.device, STREAM_CHUNK)
        for start in range(0, part.numel(), span):
            yield offset + start, part[start : start + span]


def log_levels(piece: Tensor, centre: Tensor) -> Tensor:
    """``v = STEPS_PER_OCTAVE * log2(|piece| / centre) + LEVELS / 2`` in float32 (``-inf`` for zeros; at most
    ``LEVELS - 0.5``, so that entries above the top level count at the top level)."""
    v = torch.log2(piece.abs().float().div_(centre)).mul_(STEPS_PER_OCTAVE).add_(LEVELS // 2)
    return v.clamp_(max=LEVELS - 0.5)


def gaussian_centre(flat: Tensor | Segments, density: float) -> tuple[Tensor, Tensor]:
    """Shi et al.'s threshold ``|mu| + Phi^-1(1 - rho/2) sigma`` (Gaussian_k, Sec. 5) as a device scalar, floored
    at the smallest normal float32 (so that ``|x| / centre`` stays defined), and the sum of squares (whose
    finiteness says whether ``flat`` is finite)."""
    parts = flat.parts if isinstance(flat, Segments) else [flat]
    total = torch.stack([part.sum(dtype=torch.float32) for part in parts]).sum()
    sumsq = torch.stack([torch.linalg.vector_norm(part, dtype=torch.float32).square() for part in parts]).sum()
    d = flat.numel()
    mu = total / d
    sigma = (sumsq / d - mu * mu).clamp_(min=0).sqrt_()
    z = normal_quantile(1.0 - density / 2.0) if density < 1 else 0.0
    centre = (mu.abs() + z * sigma).clamp_(min=torch.finfo(torch.float32).tiny)
    return centre, sumsq


def histc_refused(device: torch.device) -> bool:
    """Whether ``torch.histc`` would raise on ``device``: off the CPU under ``torch.use_deterministic_algorithms``
    (CUDA's ``histc`` adds with atomics; its counts of whole entries are exact all the same)."""
    return device.type != "cpu" and torch.are_deterministic_algorithms_enabled()


def level_counts(flat: Tensor | Segments, centre: Tensor) -> Tensor:
    """``counts[j]``: how many entries of ``flat`` lie at level ``j`` or above (float32, exact below 2^24 per
    chunk and summed in float64 across chunks; a histogram of :func:`log_levels` summed from the top)."""
    histogram = torch.zeros(LEVELS, dtype=torch.float64, device=centre.device)
    for _, piece in pieces(flat):
        histogram += torch.histc(log_levels(piece, centre), bins=LEVELS, min=0, max=LEVELS)
    return histogram.flip(0).cumsum(0).flip(0)


def select_at_level(flat: Tensor | Segments, centre: Tensor, level: Tensor, count: int) -> Tensor:
    """Ascending flat indices of the ``count`` entries at ``level`` or above (``count`` is that level's
    :func:`level_counts`): a mask written piece by piece, then one ``nonzero_static`` of that exact size."""
    mask = torch.empty(flat.numel(), dtype=torch.bool, device=centre.device)
    for start, piece in pieces(flat):
        torch.ge(log_levels(piece, centre), level, out=mask[start : start + piece.numel()])
    return torch.nonzero_static(mask, size=count, fill_value=-1).reshape(-1)


def top_k_by_levels(flat: Tensor | Segments, k: int, density: float) -> Tensor | None:
    """Ascending indices of exactly ``k`` entries of largest ``|flat|``, or ``None`` where the ladder cannot say
    (a non-finite entry, or fewer than ``k`` entries at its lowest level, or more than ``4k + 1024`` at the level
    chosen, or :func:`histc_refused`): the candidates are the entries at the highest level that ``k`` or more reach,
    and ``torch.topk`` picks ``k`` of them. Every entry at least as large as the ``k``-th largest is a candidate, so
    the result is a Top-k."""
    if histc_refused(flat.device):
        return None
    centre, sumsq = gaussian_centre(flat, density)
    counts = level_counts(flat, centre)
    level = ((counts >= k).sum() - 1).clamp_(min=0).reshape(1)
    read = torch.cat([sumsq.isfinite().double().reshape(1), counts[:1], counts.index_select(0, level)])
    finite, reached, chosen = read.tolist()  # the one wait for the device
    if not finite or reached < k or chosen > 4 * k + 1024:
        return None
    candidates = select_at_level(flat, centre, level.float(), int(chosen))
    values = flat.gather(candidates, True) if isinstance(flat, Segments) else flat[candidates]
    return candidates[torch.topk(values.abs(), k, sorted=False).indices].sort().values


def gaussian_k_by_levels(flat: Tensor | Segments, k: int, density: float, lower: float) -> Tensor | None:
    """Ascending indices of the entries at the lowest level that ``k`` or fewer reach, when they are at least
    ``lower * k``: Gaussian_k's count window without its refinements' read-backs. ``None`` where the ladder cannot
    say (a non-finite or all-zero tensor, or no level whose count lies in the window, or :func:`histc_refused`)."""
    if histc_refused(flat.device):
        return None
    centre, sumsq = gaussian_centre(flat, density)
    counts = level_counts(flat, centre)
    level = (counts > k).sum().clamp_(max=LEVELS - 1).reshape(1)
    read = torch.cat([sumsq.isfinite().double().reshape(1), sumsq.double().reshape(1), counts.index_select(0, level)])
    finite, nonzero, chosen = read.tolist()  # the one wait for the device
    if not finite or nonzero == 0 or not math.ceil(lower * k) <= chosen <= k:
        return None
    return select_at_level(flat, centre, level.float(), int(chosen))
