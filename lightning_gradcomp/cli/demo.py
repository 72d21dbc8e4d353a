"""A short compressed-training run on CPU processes, with what it sent: ``gradcomp demo``."""

from __future__ import annotations

import argparse
import inspect
from collections.abc import Sequence
from datetime import timedelta

import lightning.pytorch as pl
from rich.console import Console
from rich.table import Table

from lightning_gradcomp.cli.catalog import PROG
from lightning_gradcomp.core.compressors import COMPRESSORS
from lightning_gradcomp.core.stats import bytes_per_compressed_step
from lightning_gradcomp.core.validation import check_density, check_int
from lightning_gradcomp.ddp.strategy import GradCompStrategy
from lightning_gradcomp.ddp.torch_ddp import destroy_process_group
from lightning_gradcomp.examples.teacher import MLPClassifier, TeacherDataModule


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
    sent, dense = bytes_per_compressed_step(hook.history) or (0.0, 0.0)
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
    del trainer, strategy, hook  # the DDP wrapper goes before the process group
    destroy_process_group()
    return summary


def _demo_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=f"{PROG} demo", description="Train a small MLP on CPU processes and show the bytes saved."
    )
    parser.add_argument("--devices", type=int, default=2, help="CPU processes (default: 2)")
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps (default: 300)")
    sparsifiers = sorted(name for name, cls in COMPRESSORS.items() if "density" in inspect.signature(cls).parameters)
    parser.add_argument("--compressor", choices=["none", *sparsifiers], default="topk")
    parser.add_argument("--density", type=float, default=0.01, help="Top-k density in (0, 1] (default: 0.01)")
    return parser


def demo_main(argv: Sequence[str]) -> int:
    """``gradcomp demo``: :func:`run_demo` with checked arguments."""
    parser = _demo_parser()
    args = parser.parse_args(list(argv))
    try:
        check_int("--devices", args.devices, 1)
        check_int("--steps", args.steps, 1)
        check_density("--density", args.density)
    except ValueError as err:
        parser.error(str(err))
    run_demo(devices=args.devices, steps=args.steps, compressor=args.compressor, density=args.density)
    return 0
