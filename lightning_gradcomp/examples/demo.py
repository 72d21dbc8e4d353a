"""A short compressed-training run on CPU processes, with what it sent: ``gradcomp demo``."""

from __future__ import annotations

from datetime import timedelta

import lightning.pytorch as pl
import torch.distributed
from rich.console import Console
from rich.table import Table

from lightning_gradcomp.examples.teacher import MLPClassifier, TeacherDataModule
from lightning_gradcomp.strategy import GradCompStrategy


def run_demo(
    devices: int = 2, steps: int = 300, compressor: str = "topk", density: float = 0.01, seed: int = 0
) -> dict[str, float]:
    """Fit an MLP on the built-in teacher task over ``devices`` CPU processes; rank 0 prints a summary."""
    pl.seed_everything(seed, verbose=False)
    kwargs = {"density": density} if compressor != "none" else {"memory": "none"}
    strategy = GradCompStrategy(compressor=compressor, timeout=timedelta(seconds=120), **kwargs)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_steps=steps,
        val_check_interval=steps,
        check_val_every_n_epoch=None,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(MLPClassifier(), TeacherDataModule(seed=seed))
    hook = strategy.gradcomp_hook
    assert hook is not None
    compressed = [s for s in hook.history if s.compressed]
    sent = sum(s.bytes_sent for s in compressed) / max(1, len(compressed))
    dense = sum(s.dense_bytes for s in compressed) / max(1, len(compressed))
    summary = {
        "val_acc": float(trainer.callback_metrics["val_acc"]),
        "bytes_sent_per_step": sent,
        "dense_bytes_per_step": dense,
        "compression_ratio": dense / sent if sent else float("inf"),
    }
    if trainer.is_global_zero:
        table = Table(title=f"{compressor} (density {density}) on {devices} CPU processes, {steps} steps")
        for column in ("val accuracy", "bytes sent / step", "dense bytes / step", "compression"):
            table.add_column(column, justify="right")
        table.add_row(
            f"{summary['val_acc']:.3f}", f"{sent:,.0f}", f"{dense:,.0f}", f"{summary['compression_ratio']:.1f}x"
        )
        Console().print(table)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()  # a clean exit: gloo threads joined, not killed
    return summary
