"""Fit LeNet-5 on the real MNIST test set on CPU ranks, for accuracy checks (``conftest.mnist_fit`` runs it).

Trains on the first 8,000 images and validates on the last 2,000, with the same seed, batches and
steps for every strategy, so accuracies are comparable with a dense run.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import lightning.pytorch as pl

from lightning_gradcomp import GradCompStrategy
from lightning_gradcomp.examples.mnist import MNISTDataModule
from lightning_gradcomp.examples.models import ImageClassifier, LeNet5


def fit(
    rank: int,
    world_size: int,
    data_dir: str,
    strategy_kwargs: dict[str, Any],
    steps: int,
    seed: int,
    model_kwargs: dict[str, Any],
) -> dict[str, float]:
    """One rank of the fit: rank 0's validation accuracy and mean bytes per compressed step."""
    pl.seed_everything(seed, verbose=False)
    strategy = GradCompStrategy(timeout=timedelta(seconds=120), **strategy_kwargs)
    trainer = pl.Trainer(
        accelerator="cpu", devices=world_size, strategy=strategy, max_steps=steps,
        val_check_interval=steps, check_val_every_n_epoch=None, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    data = MNISTDataModule(data_dir, batch_size=32, train_split="t10k", holdout=2000)
    trainer.fit(ImageClassifier(LeNet5(), **{"lr": 0.05, **model_kwargs}), data)
    hook = strategy.gradcomp_hook
    compressed = [s for s in hook.history if s.compressed]
    return {
        "val_acc": float(trainer.callback_metrics["val_acc"]),
        "bytes_sent": sum(s.bytes_sent for s in compressed) / max(1, len(compressed)),
        "dense_bytes": sum(s.dense_bytes for s in compressed) / max(1, len(compressed)),
    }
