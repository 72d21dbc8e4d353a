"""``BoundCheck``: the compressor's measured error against the theory of the method in use.

For each checked layer, at a captured step, with ``x`` the error-compensated gradient (what the
memory handed to the compressor) and ``C(x)`` the local payload decompressed, the relative error

    e = ||x - C(x)||^2 / ||x||^2

is compared with what the papers promise:

* Top-k family (``compressor.sparse`` and a ``density``: Top-k, Gaussian_k, DGC), with ``k`` the
  entries the payload carried and ``d`` the layer's elements:

  - ``e <= 1 - k/d``, always true for any selection of the ``k`` largest magnitudes (the
    contraction property used by Shi et al., ICDCS 2019, and by Shi et al., "Understanding Top-k
    Sparsification in Distributed Deep Learning", 2019, Sec. 4-5): the ``d - k``
    entries dropped are the smallest, so they hold at most a ``(d - k)/d`` share of the energy.
    This is the bound that must hold;
  - ``e <= (1 - k/d)^2``, the tighter bound of "Understanding Top-k Sparsification" that holds
    when the coordinates are bell-shaped (same paper, Sec. 5). It rests on an empirical
    observation: its violations are counted, never acted on.

  ``k`` is the count actually sent: ``k_for(d, density)`` for exact Top-k, approximately that for
  Gaussian_k, whose count varies (between ``k/2`` and ``k``). The ``k`` largest magnitudes of a slice
  are the slice's own largest, so the bound also holds per parameter under ``granularity="model"`` or ``"group"``.
* Unbiased compressors with a variance bound ``omega(numel)`` (DIANA's quantizer,
  Mishchenko et al. 2019, Sec. 2): ``E[e] <= omega``. One draw is checked against a
  bound on the expectation, so a violation is a report, not a failure.
* TernGrad (``compressor.name == "terngrad"``; Wen et al., NIPS 2017, Sec. 3): the
  ratio ``R = ||x||_inf * ||x||_1 / ||x||^2`` of its convergence assumption. With the
  layer's own scaler ``s = ||x||_inf`` and no clipping, ``E||t||^2 = s ||x||_1`` and so
  ``E[e] = R - 1``; clipping and a shared (larger) scaler move the draw away from it. Reported.

A compressor with none of these properties (ATOMO, PowerSGD, the identity) gets only ``e`` logged.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor

from lightning_gradcomp.callbacks._common import (
    check_layer_list,
    compressed_parameters,
    gather_vectors,
    hook_of,
    log_to_loggers,
    require_strategy,
    resolve_layers,
)
from lightning_gradcomp.core.compressors import Compressor
from lightning_gradcomp.core.validation import check_bool, check_choice, check_int, check_number

ON_VIOLATION = ("ignore", "warn", "stop", "raise")
#: The bounds, in the order their violation counts travel between ranks.
BOUNDS = ("topk", "gaussian", "omega", "terngrad")


class BoundViolationError(RuntimeError):
    """A bound that must always hold (Top-k's ``1 - k/d``) failed: a bug in a compressor or the hook."""


@dataclass(frozen=True)
class LayerBounds:
    """One layer's measured error and the bounds that apply to its compressor (``None``: not applicable).

    ``error`` is ``||x - C(x)||^2 / ||x||^2``; ``topk`` is ``1 - k/d``, ``gaussian`` ``(1 - k/d)^2``,
    ``omega`` the variance bound, ``terngrad_ratio`` ``||x||_inf ||x||_1 / ||x||^2`` (whose
    ``R - 1`` is TernGrad's expected error); ``k`` the entries sent by a sparse payload.
    """

    numel: int
    error: float
    k: int | None = None
    topk: float | None = None
    gaussian: float | None = None
    omega: float | None = None
    terngrad_ratio: float | None = None

    def violations(self, rtol: float = 1e-6) -> dict[str, bool]:
        """Which applicable bounds the error exceeds (relative slack ``rtol`` for rounding)."""
        out = {}
        for bound, limit in (
            ("topk", self.topk),
            ("gaussian", self.gaussian),
            ("omega", self.omega),
            ("terngrad", None if self.terngrad_ratio is None else self.terngrad_ratio - 1.0),
        ):
            if limit is not None:
                out[bound] = self.error > limit * (1.0 + rtol) + 1e-12
        return out


def applicable_bounds(compressor: Compressor) -> tuple[str, ...]:
    """The names (from :data:`BOUNDS`) of the bounds known for ``compressor``, from its properties.

    ``keeps_largest`` and a ``density``: the Top-k family (``"topk"``, ``"gaussian"``; not random-k, whose draw
    obeys no such bound, nor values quantised to two levels); ``unbiased`` and a
    callable ``omega(numel)``: ``"omega"``; the name ``"terngrad"``: ``"terngrad"``. A property
    that is missing just leaves its bound out.
    """
    found = []
    if getattr(compressor, "keeps_largest", False) and getattr(compressor, "density", None) is not None:
        found += ["topk", "gaussian"]
    if getattr(compressor, "unbiased", False) and callable(getattr(compressor, "omega", None)):
        found.append("omega")
    if getattr(compressor, "name", None) == "terngrad":
        found.append("terngrad")
    return tuple(found)


def layer_bounds(compensated: Tensor, compressed: Tensor, compressor: Compressor) -> LayerBounds | None:
    """Measure ``||x - C(x)||^2 / ||x||^2`` for one layer and the bounds of ``compressor`` (module docstring).

    Computed in float64 from the captured tensors. ``None`` for an all-zero or non-finite ``x``,
    where the ratio is undefined. Only the :func:`applicable_bounds` are filled in.
    """
    x = compensated.detach().reshape(-1).double()
    c = compressed.detach().reshape(-1).double()
    norm_sq = float(x.square().sum())
    if not math.isfinite(norm_sq) or norm_sq == 0.0:
        return None
    d = x.numel()
    error = float((x - c).square().sum()) / norm_sq
    bounds = applicable_bounds(compressor)
    values: dict[str, Any] = {}
    if "topk" in bounds:
        k = int(torch.count_nonzero(c))
        rest = 1.0 - k / d
        values.update(k=k, topk=rest, gaussian=rest * rest)
    if "omega" in bounds:
        values["omega"] = float(compressor.omega(d))  # type: ignore[attr-defined]
    if "terngrad" in bounds:
        values["terngrad_ratio"] = float(x.abs().max()) * float(x.abs().sum()) / norm_sq
    return LayerBounds(numel=d, error=error, **values)


class BoundCheck(pl.Callback):
    """Every ``every_n_steps`` steps, per layer: the measured compression error against the method's bounds.

    At the step due, every rank asks the hook to capture the checked layers (the first
    compressed step after it, during the dense warm-up) and computes :func:`layer_bounds` per
    layer. One small ``all_gather`` sums the violation counts over ranks, so every rank sees the
    same totals and acts alike. Rank 0 logs to every logger:

    - per layer (``log_layers=True``), rank 0's values: ``bounds/{layer}/error`` and, where they
      apply, ``bounds/{layer}/topk`` (``1 - k/d``), ``bounds/{layer}/gaussian`` (``(1 - k/d)^2``),
      ``bounds/{layer}/omega``, ``bounds/{layer}/terngrad_ratio``;
    - ``bounds/violations/{topk,gaussian,omega,terngrad}``: the share of (layer, rank) pairs
      whose error exceeds the bound (for ``terngrad``: ``R - 1``);
    - ``bounds/max_error``: the largest error over layers and ranks.

    Only Top-k's ``1 - k/d`` must always hold. When it fails, ``on_violation`` decides:
    ``"ignore"``; ``"warn"`` (a warning naming the layers, the default); ``"stop"`` (warn and set
    ``trainer.should_stop``, ending the fit gracefully after the step); ``"raise"``
    (:class:`BoundViolationError` on every rank). The other bounds are about expectations or
    assumptions and are only logged. The latest check stays in :attr:`last_check`.

    Args:
        layers: parameter names to check (default: every compressed parameter). Each must be a
            compressed parameter of the model (checked at setup).
        every_n_steps: optimizer steps between checks (integer >= 1).
        on_violation: ``"ignore"``, ``"warn"``, ``"stop"`` or ``"raise"``.
        log_layers: log the per-layer values besides the violation shares.
        rtol: relative slack for rounding when comparing with a bound (>= 0).
    """

    def __init__(
        self,
        layers: list[str] | None = None,
        every_n_steps: int = 100,
        on_violation: Literal["ignore", "warn", "stop", "raise"] = "warn",
        log_layers: bool = True,
        rtol: float = 1e-6,
    ) -> None:
        self.layers = check_layer_list("layers", layers)
        self.every_n_steps = check_int("every_n_steps", every_n_steps, 1)
        check_choice("on_violation", on_violation, ON_VIOLATION)
        check_bool("log_layers", log_layers)
        check_number("rtol", rtol, 0, 1, open_max=True)
        self.on_violation = on_violation
        self.log_layers = log_layers
        self.rtol = float(rtol)
        self.last_check: dict[str, LayerBounds] = {}
        self._names: tuple[str, ...] = ()
        self._pending = False

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Check the strategy and the layer names against the trainer and the model."""
        owner = type(self).__name__
        strategy = require_strategy(trainer, owner)
        self._names = resolve_layers(owner, self.layers, strategy, pl_module) or ()
        self._strategy = strategy

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._pending = False
        self.last_check = {}
        compressor = hook_of(trainer).compressor
        if not applicable_bounds(compressor):
            rank_zero_warn(
                f"BoundCheck: no error bound is known for {type(compressor).__name__} (it is neither a sparse "
                "compressor with a density, nor unbiased with omega(numel), nor TernGrad); only the measured "
                "error ||x - C(x)||^2 / ||x||^2 is logged"
            )

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        hook = hook_of(trainer)
        if self.layers is None:  # every compressed layer, as the units are planned now (the first step may plan anew)
            self._names = tuple(compressed_parameters(self._strategy, pl_module))
        if self._names and ((hook.step + 1) % self.every_n_steps == 0 or self._pending):
            hook.request_capture(self._names)
            self._pending = True

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not self._pending:
            return
        hook = hook_of(trainer)
        stats = hook.last_step
        # Every rank requested the same layers at the same step, so all take this branch together.
        if stats is None or not any(name in stats.captures for name in self._names):
            return
        self._pending = False
        results = {}
        for name in self._names:
            capture = stats.captures.get(name)
            if capture is not None:
                bounds = layer_bounds(capture.compensated, capture.compressed, hook.compressor)
                if bounds is not None:
                    results[name] = bounds
        self.last_check = results
        self._report(trainer, pl_module, results)

    def _report(self, trainer: pl.Trainer, pl_module: pl.LightningModule, results: dict[str, LayerBounds]) -> None:
        """Sum the violation counts over ranks (one ``all_gather``), log on rank 0, act on Top-k violations."""
        local = [0.0] * (2 * len(BOUNDS))
        failed: list[str] = []
        for name, bounds in results.items():
            for bound, violated in bounds.violations(self.rtol).items():
                i = BOUNDS.index(bound)
                local[2 * i] += violated
                local[2 * i + 1] += 1
                if bound == "topk" and violated:
                    failed.append(f"{name} (error {bounds.error:.6g} > 1 - k/d = {bounds.topk:.6g}, k={bounds.k})")
        local.append(max((b.error for b in results.values()), default=0.0))
        every = torch.tensor(gather_vectors(trainer, pl_module, local), dtype=torch.float64)
        summed = every[:, :-1].sum(dim=0).tolist()
        max_error = float(every[:, -1].max())
        metrics: dict[str, float] = {"bounds/max_error": max_error}
        for i, bound in enumerate(BOUNDS):
            if summed[2 * i + 1]:
                metrics[f"bounds/violations/{bound}"] = summed[2 * i] / summed[2 * i + 1]
        if self.log_layers:
            for name, b in results.items():
                metrics[f"bounds/{name}/error"] = b.error
                for key in ("topk", "gaussian", "omega", "terngrad_ratio"):
                    value = getattr(b, key)
                    if value is not None:
                        metrics[f"bounds/{name}/{key}"] = value
        log_to_loggers(trainer, metrics, trainer.global_step)
        topk_violations = int(summed[0])
        if topk_violations == 0 or self.on_violation == "ignore":
            return
        message = (
            f"BoundCheck at step {trainer.global_step}: the Top-k contraction ||x - C(x)||^2 <= (1 - k/d) ||x||^2, "
            f"which always holds for the k largest magnitudes, failed on {topk_violations} (layer, rank) pairs; "
            f"rank {trainer.global_rank}: {', '.join(failed) or 'none here'}"
        )
        if self.on_violation == "raise":
            raise BoundViolationError(message)
        if failed or trainer.is_global_zero:
            warnings.warn(message, stacklevel=1)
        if self.on_violation == "stop":
            trainer.should_stop = True
