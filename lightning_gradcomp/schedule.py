"""Density warm-up by step: sparsifiers start dense-ish and reach their density gradually.

Sparsifying from the first step at density 0.001 throws away most of the early gradients, whose
directions change fastest; the residual then carries stale mass for many steps and training
starts far behind plain DDP. The authors of every Top-k-family method warm up: DGC raises sparsity
exponentially over the first epochs, 75%, 93.75%, 98.4375%, 99.6%, 99.9% (Lin et al., ICLR 2018,
"warm-up training"); gTop-k uses density 0.004 in the first epoch (Shi et al., ICDCS 2019);
Gaussian_k 1/64, 0.004, then 0.001 in epochs 0, 1, 2+ (Shi et al. 2019). :class:`DensityWarmup` is
DGC's exponential schedule counted in optimizer steps rather than epochs, so it needs no epoch
length and works the same under Lightning, Fabric and a hand-written loop: the density falls
geometrically from ``start`` to the compressor's density over ``steps`` compressed steps.
The density is a pure function of the step counter, so a resumed run uses the same densities
as the run that never stopped.
"""

from __future__ import annotations

import math

from lightning_gradcomp.validation import check_density, check_int

__all__ = ["DensityWarmup"]


class DensityWarmup:
    """Density ``start * (target / start) ** (t / steps)`` at compressed step ``t < steps``, ``target`` after.

    Args:
        target: the density reached at the end (the compressor's own density).
        steps: compressed steps the warm-up lasts (0: no warm-up).
        start: density at the first compressed step (DGC's first stage keeps 25%); a ``target``
            at or above ``start`` means no warm-up.
    """

    def __init__(self, target: float, steps: int, start: float = 0.25) -> None:
        for name, value in (("target", target), ("start", start)):
            check_density(f"density warm-up {name}", value)
        check_int("density warm-up steps", steps, 0)
        self.target = float(target)
        self.steps = steps
        self.start = float(start)

    def density(self, step: int) -> float:
        """The density at compressed step ``step`` (0 is the first compressed step)."""
        if step >= self.steps or self.target >= self.start:
            return self.target
        return self.start * math.exp(math.log(self.target / self.start) * max(step, 0) / self.steps)

    def __repr__(self) -> str:
        return f"DensityWarmup(target={self.target}, steps={self.steps}, start={self.start})"
