"""Schedules: what each step does, dense or compressed and at which density, decided from state every rank holds.

A schedule gives the hook a :class:`StepPlan` at the start of every step. :class:`WarmupSchedule`
is a pure function of the step counter: ``warmup_steps`` dense steps, then compressed steps whose
density a :class:`DensityWarmup` may lower gradually. The adaptive
:class:`~lightning_gradcomp.core.adaptive.Accordion` decides from what the run measures instead. Either
way every rank holds the same plan, and the checkpoint carries the schedule's state
(:meth:`WarmupSchedule.state_dict`), so a resumed run makes the same decisions as the run that never
stopped.

Density warm-up by step: sparsifiers start dense-ish and reach their density gradually.

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
from dataclasses import dataclass
from typing import Any, Literal

from torch import Tensor

from lightning_gradcomp.core.validation import check_density, check_int

__all__ = ["DensityWarmup", "StepPlan", "WarmupSchedule"]

#: What a step is: one of the dense first steps, a step of a critical regime (compressed less, or dense), a
#: relaxed one (compressed at the compressor's density), or a step of a schedule without regimes.
Regime = Literal["warmup", "critical", "relaxed", "steady"]


@dataclass(frozen=True)
class StepPlan:
    """What one step does: through the compression pipeline (``compress``) or DDP's dense average, the
    sparsifier's ``density`` for the step (``None``: leave it as it is), and the ``regime`` it belongs to."""

    compress: bool
    density: float | None = None
    regime: Regime = "steady"


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


class WarmupSchedule:
    """``warmup_steps`` dense steps (as DDP averages them), then every step compressed, at the density of
    ``density_warmup`` if given. A pure function of the step counter: it observes nothing and keeps no state."""

    #: whether the hook must hand :meth:`observe` each step's squared gradient norm (only adaptive schedules do)
    observes = False
    #: the schedule's name in its state (a checkpoint of one schedule cannot resume another)
    name = "warmup"

    def __init__(self, warmup_steps: int = 1, density_warmup: DensityWarmup | None = None) -> None:
        self.warmup_steps = check_int("warmup_steps", warmup_steps, 0)
        self.density_warmup = density_warmup

    def plan(self, step: int) -> StepPlan:
        """The plan of step ``step`` (0 is the first)."""
        if step < self.warmup_steps:
            return StepPlan(compress=False, regime="warmup")
        density = None if self.density_warmup is None else self.density_warmup.density(step - self.warmup_steps)
        return StepPlan(compress=True, density=density)

    def due(self, step: int) -> bool:
        """Whether step ``step`` needs the ranks' summed statistics first (:meth:`decide`): never here."""
        return False

    def observe(self, squared_norm: Tensor) -> None:
        """Take one step's squared norm of this rank's gradient (only called when :attr:`observes`)."""

    def statistics(self) -> Tensor:
        """This rank's statistics since the last decision, to be summed over ranks (only called when :meth:`due`)."""
        raise NotImplementedError(f"{type(self).__name__} decides nothing")

    def decide(self, step: int, summed: Tensor, world_size: int) -> None:
        """Decide from ``summed`` (:meth:`statistics` summed over ``world_size`` ranks) at step ``step``."""
        raise NotImplementedError(f"{type(self).__name__} decides nothing")

    def state_dict(self) -> dict[str, Any]:
        """What a resumed run needs to plan alike (only the name: the step counter, which the hook keeps, suffices)."""
        return {"name": self.name}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output."""
        self.check_state(state)

    def check_state(self, state: dict[str, Any]) -> None:
        """Refuse the state of another schedule, naming both (a state saved before schedules had names, or none, is
        a warm-up's)."""
        saved = state.get("name", WarmupSchedule.name)
        if saved != self.name:
            raise ValueError(
                f"the checkpoint holds the state of the {saved!r} schedule, but this run uses {self.name!r} "
                f"(adaptive={'accordion' if self.name == 'accordion' else 'none'}): resume with the schedule it was "
                "saved with"
            )

    def __repr__(self) -> str:
        return f"WarmupSchedule(warmup_steps={self.warmup_steps}, density_warmup={self.density_warmup!r})"
