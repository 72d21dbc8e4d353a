"""Paired comparison of two methods over the same seeds: mean difference and its 95% interval."""

from __future__ import annotations

import math
import statistics

#: Two-sided 95% quantiles of Student's t, t_{0.975, df}, df = 1..30 (standard tables).
_T975 = (
    12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
    2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086,
    2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042,
)  # fmt: skip


def t975(df: int) -> float:
    """Student's t quantile for a two-sided 95% interval with ``df`` degrees of freedom (1.96 beyond 30)."""
    if df < 1:
        raise ValueError(f"df must be >= 1, got {df}")
    return _T975[df - 1] if df <= len(_T975) else 1.96


def paired_difference(method: dict[int, float], baseline: dict[int, float]) -> tuple[float, float, int]:
    """``(mean, half width of its 95% interval, n)`` of ``method[s] - baseline[s]`` over the seeds both have.

    Pairing by seed removes what the seed decides for both (initialisation, batch order), so the
    interval reflects only what the method changes. With one seed the half width is ``inf``.
    """
    seeds = sorted(set(method) & set(baseline))
    if not seeds:
        raise ValueError("no seed in common")
    diffs = [method[s] - baseline[s] for s in seeds]
    if len(diffs) == 1:
        return diffs[0], math.inf, 1
    return statistics.mean(diffs), t975(len(diffs) - 1) * statistics.stdev(diffs) / math.sqrt(len(diffs)), len(diffs)


def verdict(mean: float, half_width: float, tolerance: float) -> str:
    """Whether the method is shown to lose at most ``tolerance`` points, shown to lose more, or neither."""
    if mean - half_width >= -tolerance:
        return "within"
    if mean + half_width < -tolerance:
        return "loses"
    return "undecided"
