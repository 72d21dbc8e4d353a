"""``GradientHistogram``: what the gradients look like before and after compression.

Shi et al. ("Understanding Top-k Sparsification in Distributed Deep Learning", 2019, Sec. 5)
observe that the coordinates of residual-corrected gradients are bell-shaped; that
observation is what tightens Top-k's contraction bound and what Gaussian_k's threshold estimate
rests on. The plots put a Gaussian with the data's mean and standard deviation
over each histogram, and mark the selection threshold, so the observation can be checked on one's
own model.
"""

from __future__ import annotations

import importlib.util
import math
import re
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from torch import Tensor

from lightning_gradcomp.callbacks._common import (
    check_layer_list,
    compressed_parameters,
    hook_of,
    log_to_loggers,
    require_strategy,
    resolve_layers,
)
from lightning_gradcomp.core.stats import Capture
from lightning_gradcomp.core.validation import check_choice, check_int

BACKENDS = ("auto", "tensorboard", "png")
#: The captured tensors drawn, in panel order.
KINDS = ("raw", "compensated", "sent")


def selection_threshold(compressed: Tensor) -> float | None:
    """The smallest ``|value|`` a sparse payload carried (``None`` when it carried nothing nonzero).

    Every entry of the compensated gradient above it in magnitude was sent (for Top-k and its
    approximations, the selection is the set of largest magnitudes).
    """
    sent = compressed[compressed != 0]
    return float(sent.abs().min()) if sent.numel() else None


def histogram_values(capture: Capture, kind: str, sparse: bool) -> Tensor:
    """The values drawn for ``kind``: the captured tensor, only its nonzero entries for a sparse ``"sent"``.

    A sparse payload's dense form is mostly zeros; its histogram would be one spike at zero.
    """
    values = getattr(capture, kind).detach().reshape(-1).float().cpu()
    if kind == "sent" and sparse:
        values = values[values != 0]
    return values[torch.isfinite(values)]


class GradientHistogram(pl.Callback):
    """Every ``every_n_steps`` steps: histograms of chosen layers' raw, error-compensated and sent gradients.

    At the step due, rank 0 asks the hook to capture the layers (``GradCompHook.request_capture``;
    during the dense warm-up the capture waits for the first compressed step) and draws, for
    each layer, rank 0's

    - ``raw``: the local gradient;
    - ``compensated``: what the memory handed to the compressor (``grad + residual`` under error
      feedback, ``grad - h_i`` under DIANA);
    - ``sent``: what of the local payload reached the global result (its nonzero entries when the
      payload is sparse, without a Gaussian: they are the two tails beyond the threshold).

    With a :class:`~lightning.pytorch.loggers.TensorBoardLogger` among the trainer's loggers
    (``backend="auto"`` or ``"tensorboard"``) they go to TensorBoard as histograms
    ``gradients/{layer}/{raw,compensated,sent}``. Otherwise (``"auto"`` or ``"png"``) rank 0
    writes one PNG per layer and step, ``{log_dir}/gradient_histograms/{layer}_step{N}.png``
    (``log_dir`` is ``trainer.log_dir``: the first logger's directory, else ``default_root_dir``),
    three panels drawn on matplotlib's Agg canvas (the object API: no pyplot, the process's
    backend is left alone), each with the Gaussian of the data's mean and standard deviation over
    the (density) histogram. For sparse compressors the selection threshold, the smallest
    ``|value|`` sent, is marked (dashed, at ``+-threshold``) on every panel and logged as
    ``gradients/{layer}/threshold`` to every logger. The PNGs are drawn by one background thread,
    so training goes on meanwhile; the end of training waits for them and :attr:`written` lists
    the files.

    Args:
        layers: parameter names to draw (checked at setup against the model's parameters; each
            must be compressed). Default: the compressed parameter with the most elements.
        every_n_steps: optimizer steps between histograms (integer >= 1).
        bins: histogram bins of the PNG plots (integer >= 2).
        backend: ``"auto"``, ``"tensorboard"`` (requires a TensorBoardLogger) or ``"png"``.
        dirname: subdirectory of the log directory for the PNG files.
    """

    def __init__(
        self,
        layers: list[str] | None = None,
        every_n_steps: int = 500,
        bins: int = 64,
        backend: Literal["auto", "tensorboard", "png"] = "auto",
        dirname: str = "gradient_histograms",
    ) -> None:
        self.layers = check_layer_list("layers", layers)
        self.every_n_steps = check_int("every_n_steps", every_n_steps, 1)
        check_int("bins", bins, 2)
        check_choice("backend", backend, BACKENDS)
        if not isinstance(dirname, str) or not dirname:
            raise ValueError(f"dirname must be a non-empty string, got {dirname!r}")
        self.bins = bins
        self.backend = backend
        self.dirname = dirname
        self.written: list[Path] = []
        self._names: tuple[str, ...] = ()
        self._strategy: Any = None
        self._tensorboard: TensorBoardLogger | None = None
        self._directory: Path | None = None
        self._pending = False
        self._sparse = False
        self._renderer: ThreadPoolExecutor | None = None
        self._rendering: list[Future[Path]] = []

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Check the strategy, the layer names and the backend against the trainer and the model."""
        owner = type(self).__name__
        strategy = require_strategy(trainer, owner)
        self._strategy = strategy
        self._names = resolve_layers(owner, self.layers, strategy, pl_module) or self._largest(pl_module)
        if not self._names:
            raise ValueError(f"{owner}: the strategy compresses no parameter of this model; nothing to draw")
        tensorboard = [logger for logger in trainer.loggers if isinstance(logger, TensorBoardLogger)]
        if self.backend == "tensorboard" and not tensorboard:
            raise ValueError(f"{owner}: backend='tensorboard' needs a TensorBoardLogger among the trainer's loggers")
        self._tensorboard = tensorboard[0] if tensorboard and self.backend != "png" else None
        if self._tensorboard is None and importlib.util.find_spec("matplotlib") is None:
            # Checked on every rank at setup: failing on rank 0 alone, later, would leave the others waiting.
            raise ModuleNotFoundError(
                f"{owner} draws PNG plots with matplotlib, which is not installed: pip install matplotlib "
                "(or add a TensorBoardLogger to the trainer to log TensorBoard histograms instead)"
            )

    def _largest(self, pl_module: pl.LightningModule) -> tuple[str, ...]:
        """The largest compressed parameter (none when nothing is compressed)."""
        compressed = compressed_parameters(self._strategy, pl_module)
        return (max(compressed, key=compressed.__getitem__),) if compressed else ()

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._pending = False
        self._sparse = bool(getattr(hook_of(trainer).compressor, "sparse", False))
        if self._tensorboard is None:
            log_dir = trainer.log_dir  # a broadcast: every rank must ask
            self._directory = Path(log_dir if log_dir is not None else trainer.default_root_dir) / self.dirname
            if trainer.is_global_zero:
                # Imported here, before the first step, so the import is not paid inside the training loop.
                import matplotlib.backends.backend_agg
                import matplotlib.figure  # noqa: F401

                self._directory.mkdir(parents=True, exist_ok=True)
                self._renderer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="GradientHistogram")

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if not trainer.is_global_zero:
            return
        hook = hook_of(trainer)
        if self.layers is None:  # the largest compressed layer as the units are planned now (the first step may)
            self._names = self._largest(pl_module) or self._names
        if (hook.step + 1) % self.every_n_steps == 0 or self._pending:
            hook.request_capture(self._names)
            self._pending = True

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not (trainer.is_global_zero and self._pending):
            return
        stats = hook_of(trainer).last_step
        if stats is None or not any(name in stats.captures for name in self._names):
            return
        self._pending = False
        thresholds = {}
        for name in self._names:
            capture = stats.captures.get(name)
            if capture is None:
                continue
            threshold = selection_threshold(capture.compressed) if self._sparse else None
            if threshold is not None:
                thresholds[f"gradients/{name}/threshold"] = threshold
            if self._tensorboard is not None:
                self._to_tensorboard(name, capture, trainer.global_step)
            else:
                assert self._renderer is not None
                self._rendering.append(
                    self._renderer.submit(self._to_png, name, capture, threshold, trainer.global_step)
                )
        log_to_loggers(trainer, thresholds, trainer.global_step)
        self._collect(wait=False)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._collect(wait=True)

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if self._renderer is not None:
            self._renderer.shutdown(wait=True, cancel_futures=True)
            self._renderer = None
        self._rendering = []

    def _collect(self, wait: bool) -> None:
        """Move finished plots to :attr:`written`; with ``wait``, finish all first.

        A plot that failed is a warning, not an error: raising on rank 0 alone would leave the
        other ranks waiting in the next collective.
        """
        if wait and self._renderer is not None:
            self._renderer.shutdown(wait=True)
            self._renderer = None
        while self._rendering and (wait or self._rendering[0].done()):
            try:
                self.written.append(self._rendering.pop(0).result())
            except Exception as err:
                warnings.warn(f"GradientHistogram: a histogram plot failed: {err!r}", stacklevel=1)

    def _to_tensorboard(self, name: str, capture: Capture, step: int) -> None:
        assert self._tensorboard is not None
        writer = self._tensorboard.experiment
        for kind in KINDS:
            values = histogram_values(capture, kind, self._sparse)
            if values.numel():
                writer.add_histogram(f"gradients/{name}/{kind}", values.numpy(), global_step=step)

    def _to_png(self, name: str, capture: Capture, threshold: float | None, step: int) -> Path:
        """Draw the three panels of ``name`` into a PNG file and return its path (runs in the render thread)."""
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.ticker import MaxNLocator

        assert self._directory is not None
        # Fixed margins and titles instead of a layout engine and legends: text layout dominates the cost.
        figure = Figure(figsize=(12, 3.8))
        FigureCanvasAgg(figure)
        axes = figure.subplots(1, len(KINDS))
        figure.subplots_adjust(left=0.05, right=0.99, bottom=0.08, top=0.76, wspace=0.2)
        for ax, kind in zip(axes, KINDS, strict=True):
            values = histogram_values(capture, kind, self._sparse)
            sparse_sent = kind == "sent" and self._sparse
            title = f"{kind}{' (nonzero)' if sparse_sent else ''}: {values.numel()} values"
            ax.xaxis.set_major_locator(MaxNLocator(5))
            ax.yaxis.set_major_locator(MaxNLocator(4))
            ax.tick_params(labelsize=7)
            if values.numel():
                low, high = float(values.min()), float(values.max())
                if high <= low:
                    low, high = low - 0.5, high + 0.5
                counts = torch.histc(values, bins=self.bins, min=low, max=high)
                edges = torch.linspace(low, high, self.bins + 1)
                density = counts / (counts.sum() * (edges[1] - edges[0]))
                ax.stairs(density.numpy(), edges.numpy(), fill=True, alpha=0.6, color="C0")
                mean, std = float(values.mean()), float(values.std(correction=0))
                if std > 0 and not sparse_sent:
                    grid = torch.linspace(low, high, 200, dtype=torch.float64)
                    pdf = torch.exp(-0.5 * ((grid - mean) / std) ** 2) / (std * math.sqrt(2 * math.pi))
                    ax.plot(grid.numpy(), pdf.numpy(), color="C3", lw=1.2)
                    title += f"\nGaussian fit (red): mean {mean:.3g}, std {std:.3g}"
                if threshold is not None:
                    ax.axvline(-threshold, color="k", ls="--", lw=0.9)
                    ax.axvline(threshold, color="k", ls="--", lw=0.9)
                    if not sparse_sent:
                        title += f"\nthreshold (dashed): |x| >= {threshold:.3g}"
            ax.set_title(title, fontsize=8)
        figure.suptitle(f"{name}, step {step} (rank 0)", fontsize=10, y=0.985)
        path = self._directory / f"{_safe(name)}_step{step:07d}.png"
        figure.savefig(path, dpi=80)
        return path


def _safe(name: str) -> str:
    """A file-name-safe form of a parameter name (dots kept)."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name)
