"""Fit LeNet-5 on the real MNIST test set (../shared/data/mnist) on 2 CPU ranks, for accuracy checks.

Trains on the first 8,000 images and validates on the last 2,000, with the same seed, batches and
steps for every strategy, so accuracies are comparable with a dense run.
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
from ranks import run_ranks

from lightning_gradcomp import GradCompStrategy
from lightning_gradcomp.examples.mnist import MNISTDataModule
from lightning_gradcomp.examples.models import ImageClassifier, LeNet5

MNIST_DIR = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "mnist"
needs_mnist = pytest.mark.skipif(not MNIST_DIR.is_dir(), reason=f"MNIST files not found in {MNIST_DIR}")


def _fit(
    rank: int, world_size: int, strategy_kwargs: dict[str, Any], steps: int, seed: int, model_kwargs: dict[str, Any]
) -> dict[str, float]:
    pl.seed_everything(seed, verbose=False)
    strategy = GradCompStrategy(timeout=timedelta(seconds=120), **strategy_kwargs)
    trainer = pl.Trainer(
        accelerator="cpu", devices=world_size, strategy=strategy, max_steps=steps,
        val_check_interval=steps, check_val_every_n_epoch=None, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    data = MNISTDataModule(str(MNIST_DIR), batch_size=32, train_split="t10k", holdout=2000)
    trainer.fit(ImageClassifier(LeNet5(), **{"lr": 0.05, **model_kwargs}), data)
    hook = strategy.gradcomp_hook
    compressed = [s for s in hook.history if s.compressed]
    return {
        "val_acc": float(trainer.callback_metrics["val_acc"]),
        "bytes_sent": sum(s.bytes_sent for s in compressed) / max(1, len(compressed)),
        "dense_bytes": sum(s.dense_bytes for s in compressed) / max(1, len(compressed)),
    }


_RESULTS: dict[str, dict] = {}


def fit_mnist(
    strategy_kwargs: dict[str, Any],
    steps: int = 250,
    seed: int = 0,
    world_size: int = 2,
    model_kwargs: dict[str, Any] | None = None,
) -> dict:
    """Rank 0's validation accuracy and mean bytes per compressed step for ``GradCompStrategy(**strategy_kwargs)``.

    Results are kept for the test session, so the dense baseline that several tests compare with
    is trained once.
    """
    model_kwargs = dict(model_kwargs or {})
    key = repr((sorted(strategy_kwargs.items()), steps, seed, world_size, sorted(model_kwargs.items())))
    if key not in _RESULTS:
        _RESULTS[key] = run_ranks(
            _fit, world_size, strategy_kwargs, steps, seed, model_kwargs, init=False, timeout=300
        )[0]
    return _RESULTS[key]
