"""Diagnostics that read the hook's per-step statistics (compression monitor, histograms, bound checks).

Each callback works alone and needs a :class:`~lightning_gradcomp.GradCompStrategy`:

- :class:`CompressionMonitor`: bytes on the wire per rank and in total, the measured compression
  ratio, bits per element, density, time shares of compress / communicate / decompress, residual
  norm; the live ratio in the progress bar; an end-of-fit table.
- :class:`GradientHistogram`: raw, error-compensated and sent gradients of chosen layers, to
  TensorBoard or as PNG plots with the fitted Gaussian and the selection threshold.
- :class:`BoundCheck`: the measured error ``||x - C(x)||^2 / ||x||^2`` against the method's bounds.

Default frequencies (every 50, 500 and 100 optimizer steps) keep their cost under 5 % of the
step time on the MNIST recipe (``benchmarks/callback_overhead.py``).
"""

from lightning_gradcomp.callbacks.bound_check import BoundCheck, BoundViolationError, LayerBounds, layer_bounds
from lightning_gradcomp.callbacks.compression_monitor import CompressionMonitor, RankSummary
from lightning_gradcomp.callbacks.gradient_histogram import GradientHistogram

__all__ = [
    "BoundCheck",
    "BoundViolationError",
    "CompressionMonitor",
    "GradientHistogram",
    "LayerBounds",
    "RankSummary",
    "layer_bounds",
]
