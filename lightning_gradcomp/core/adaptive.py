"""Accordion: compress less while training is in a critical regime, detected from the gradient norm's rate of change.

Agarwal, Wang, Lee, Venkataraman and Papailiopoulos, "Adaptive Gradient Communication via Critical
Learning Regime Identification" (MLSys 2021), Sec. 3 and Algorithm 1. Early training, and the
steps after a change of learning rate, are *critical*: an inaccurate gradient there costs accuracy
that later steps do not win back. Accordion detects them from the gradient norm: every ``interval``
steps it compares the norm ``||D_i||`` measured over the interval that just ended with the previous
interval's; a relative change ``|(||D_{i-1}|| - ||D_i||)| / ||D_{i-1}||`` of at least ``threshold``
(the paper's ``eta = 0.5``) marks the next interval critical, where a low compression level is used
(here: the ``critical_density``, or dense steps), otherwise the high one (the compressor's own
density). The first intervals are critical, since there is nothing to compare with yet.

What it measures, and how every rank decides alike:

* ``||D_i||`` is the root mean square over the interval of the norm of this rank's *local* gradient,
  taken before compression, averaged over the ranks. The authors accumulate each layer's gradient
  over an epoch and use rank 0's norms; a mean of per-step squared norms needs no model-sized
  accumulator (the memory a method needs stays its own state) and does not depend on the level in
  force (the norm of a sparse estimate would drop the moment the density does).
* Each rank adds one squared norm per step (computed per parameter, summed in parameter order, so
  the sum does not depend on DDP's bucket layout, which changes after the first step and after a
  restart). At each decision the ranks sum their accumulators in one collective of two float64
  numbers, once per ``interval`` steps, not per step: every rank then holds the same sum and takes
  the same decision. The authors decide on rank 0 and broadcast the choice.
* The accumulator, the last interval's norm and the regime in force are this rank's checkpoint
  state (:meth:`Accordion.state_dict`), so a run resumed between two decisions decides as the run
  that never stopped.

The authors also force the low level at a learning-rate decay; a hook does not see the optimizer,
and the change of gradient norm that a decay causes is what the rule detects anyway.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lightning_gradcomp.core.schedule import StepPlan, WarmupSchedule
from lightning_gradcomp.core.validation import check_density, check_int, check_number

__all__ = ["Accordion", "AccordionDecision"]

#: Accordion's default interval between decisions, in optimizer steps.
DEFAULT_INTERVAL = 50
#: The paper's threshold on the relative change of the gradient norm (``eta``, Sec. 3).
DEFAULT_THRESHOLD = 0.5


@dataclass(frozen=True)
class AccordionDecision:
    """One decision: at ``step``, the interval's gradient norm ``norm`` (root mean square over its steps and
    the ranks), its relative change from the previous interval's (``None`` for the first), and whether the
    steps from ``step`` on are ``critical``."""

    step: int
    norm: float
    change: float | None
    critical: bool


class Accordion(WarmupSchedule):
    """Adaptive compression: ``critical_density`` (or dense steps) in critical regimes, ``density`` otherwise.

    Args:
        density: the compressor's own density, used outside critical regimes (``None`` for a compressor
            without one: it then compresses as configured).
        critical_density: the density in critical regimes; ``None`` averages those steps densely, as DDP
            does (how PowerSGD, ATOMO, TernGrad and the quantizers compress less).
        interval: optimizer steps between two decisions.
        threshold: the relative change of the gradient norm that marks a critical regime (paper: 0.5).
        warmup_steps: the first steps, averaged densely before any decision (DDP's first step at least).
    """

    observes = True
    name = "accordion"

    def __init__(
        self,
        density: float | None = None,
        critical_density: float | None = None,
        interval: int = DEFAULT_INTERVAL,
        threshold: float = DEFAULT_THRESHOLD,
        warmup_steps: int = 1,
    ) -> None:
        super().__init__(warmup_steps)
        self.density = None if density is None else check_density("density", density)
        if critical_density is not None:
            check_density("critical_density", critical_density)
            if density is None:
                raise ValueError(
                    f"critical_density={critical_density} needs a compressor with a density; without one, "
                    "critical regimes are averaged densely (critical_density=None)"
                )
            if critical_density < density:
                raise ValueError(
                    f"critical_density={critical_density} is below the density {density}: critical regimes must "
                    "be compressed less, not more"
                )
        self.critical_density = critical_density
        self.interval = check_int("interval", interval, 1, note="optimizer steps between two decisions")
        self.threshold = check_number("threshold", threshold, 0, open_min=True)
        self.critical = True
        self.previous: float | None = None
        self.decisions: list[AccordionDecision] = []
        self._accumulated: Tensor | None = None  # this rank's sum of squared norms since the last decision
        self._observed: Tensor | None = None  # and the number of steps with a finite one
        self._loaded: tuple[float, float] = (0.0, 0.0)

    def plan(self, step: int) -> StepPlan:
        if step < self.warmup_steps:
            return StepPlan(compress=False, regime="warmup")
        if not self.critical:
            return StepPlan(compress=True, density=self.density, regime="relaxed")
        if self.critical_density is None:
            return StepPlan(compress=False, regime="critical")
        return StepPlan(compress=True, density=self.critical_density, regime="critical")

    def due(self, step: int) -> bool:
        return step > 0 and step % self.interval == 0

    def observe(self, squared_norm: Tensor) -> None:
        """Add one step's squared norm of this rank's gradient (a 0-dim tensor: no host synchronisation);
        a non-finite one (a step AMP skips) is left out."""
        if self._accumulated is None or self._observed is None:
            options = {"dtype": torch.float64, "device": squared_norm.device}
            self._accumulated = torch.tensor(self._loaded[0], **options)
            self._observed = torch.tensor(self._loaded[1], **options)
        finite = torch.isfinite(squared_norm)
        self._accumulated += torch.where(finite, squared_norm.double(), 0.0)
        self._observed += finite.double()

    def statistics(self) -> Tensor:
        if self._accumulated is None or self._observed is None:
            return torch.tensor(self._loaded, dtype=torch.float64)
        return torch.stack([self._accumulated, self._observed])

    def decide(self, step: int, summed: Tensor, world_size: int) -> None:
        """The regime from ``step`` on, from the ranks' summed squared norms and step counts (Algorithm 1)."""
        total, count = (float(v) for v in summed.tolist())
        self._accumulated = self._observed = None
        self._loaded = (0.0, 0.0)
        if count <= 0:  # no finite gradient in the interval: nothing to compare, the regime stays
            return
        norm = math.sqrt(total / count)
        change = None
        if self.previous is not None:
            change = abs(self.previous - norm) / self.previous if self.previous > 0 else (math.inf if norm else 0.0)
            self.critical = change >= self.threshold
        self.previous = norm
        self.decisions.append(AccordionDecision(step, norm, change, self.critical))

    def state_dict(self) -> dict[str, Any]:
        """This rank's accumulator since the last decision, the last interval's norm, the regime in force and the
        decisions so far (a few numbers per interval)."""
        accumulated, observed = (float(v) for v in self.statistics().tolist())
        return {
            "name": self.name,
            "accumulated": accumulated,
            "observed": observed,
            "previous": self.previous,
            "critical": self.critical,
            "decisions": [(d.step, d.norm, d.change, d.critical) for d in self.decisions],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.check_state(state)
        self._loaded = (float(state["accumulated"]), float(state["observed"]))
        self._accumulated = self._observed = None
        self.previous = None if state["previous"] is None else float(state["previous"])
        self.critical = bool(state["critical"])
        self.decisions = [AccordionDecision(*d) for d in state["decisions"]]

    def __repr__(self) -> str:
        return (
            f"Accordion(density={self.density}, critical_density={self.critical_density}, interval={self.interval}, "
            f"threshold={self.threshold}, warmup_steps={self.warmup_steps})"
        )
