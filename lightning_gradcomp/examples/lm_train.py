"""Train a byte-level GPT on the standard library's source under any strategy:
``python -m lightning_gradcomp.examples.lm_train --strategy ddp_diloco_sparseloco --devices 4``.

The model is :class:`~lightning_gradcomp.examples.gpt.LanguageModel` (0.88M parameters, AdamW with warm-up and
cosine decay); the text is :mod:`~lightning_gradcomp.examples.stdlib_corpus`, read from this Python's own standard
library, so nothing is downloaded. Any name a Trainer takes works as ``--strategy``: ``ddp`` (plain DDP), the DDP
presets (``ddp_bf16``, ``ddp_topk``, ...), DiLoCo's (``ddp_diloco``, ``ddp_diloco_qsgd``, ``ddp_diloco_topk``,
``ddp_diloco_sparseloco``; ``--sync-every`` sets their ``H``) and HSDP's. At the end it prints the validation loss
(nats per byte) before and after, and the bytes each rank handed to collectives per step against what plain DDP
sends, from :class:`~lightning_gradcomp.CompressionMonitor`.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

import lightning.pytorch as pl
import torch

from lightning_gradcomp import GradCompHSDPStrategy, GradCompStrategy
from lightning_gradcomp.callbacks import CompressionMonitor
from lightning_gradcomp.diloco import DILOCO_PRESETS, GradCompDiLoCoStrategy
from lightning_gradcomp.examples.gpt import LanguageModel
from lightning_gradcomp.examples.stdlib_corpus import StdlibTextDataModule


def build_strategy(name: str, sync_every: int | None) -> Any:
    """The strategy named ``name``, a DiLoCo preset with ``sync_every`` when one is given."""
    if sync_every is not None:
        if name not in DILOCO_PRESETS:
            raise ValueError(f"--sync-every sets DiLoCo's H; {name!r} is not one of {sorted(DILOCO_PRESETS)}")
        return GradCompDiLoCoStrategy.from_preset(name, sync_every=sync_every)
    return name


def train(
    strategy: str = "ddp_diloco_sparseloco",
    devices: int = 2,
    steps: int = 600,
    batch_size: int = 16,
    sync_every: int | None = None,
    eval_every: int = 100,
    validation_windows: int = 256,
    seed: int = 0,
    **model: Any,
) -> dict[str, Any]:
    """Fit the language model for ``steps`` steps; the validation losses before and after, the bytes per step, the
    corpus it read and the trainer."""
    pl.seed_everything(seed, verbose=False)
    module = LanguageModel(steps=steps, **model)
    data = StdlibTextDataModule(module.hparams.context, batch_size, validation_windows, seed=seed)
    monitor = CompressionMonitor(every_n_steps=max(1, steps), print_summary=False)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=build_strategy(strategy, sync_every),
        max_steps=steps,
        val_check_interval=min(eval_every, steps),
        check_val_every_n_epoch=None,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
    )
    if isinstance(trainer.strategy, (GradCompStrategy, GradCompDiLoCoStrategy, GradCompHSDPStrategy)):
        trainer.callbacks.append(monitor)  # the package's strategies count their bytes; Lightning's DDP does not
    data.setup("fit")
    before = validation_loss(module, data)
    trainer.fit(module, data)
    after = float(trainer.callback_metrics["val_loss"])
    summary = monitor.summary[-1] if monitor.summary else None
    per_step = (summary.bytes_sent, summary.dense_bytes) if summary is not None else None
    corpus = data.corpus.summary if data.corpus is not None else {}
    return {"before": before, "after": after, "per_step": per_step, "corpus": corpus, "trainer": trainer}


def validation_loss(module: LanguageModel, data: StdlibTextDataModule) -> float:
    """The mean next-byte loss (nats) over the validation windows, this process alone."""
    total, count = 0.0, 0
    with torch.no_grad():
        for x, y in data.val_dataloader():
            total += float(module._loss((x, y))) * y.numel()
            count += y.numel()
    return total / count


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--strategy", default="ddp_diloco_sparseloco", help="ddp, ddp_bf16, ddp_diloco, ...")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--batch-size", type=int, default=16, help="windows of 128 bytes per rank per step")
    parser.add_argument("--sync-every", type=int, default=None, help="DiLoCo's H (DiLoCo presets only)")
    parser.add_argument("--eval-every", type=int, default=100)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(list(argv) if argv is not None else None)
    result = train(args.strategy, args.devices, args.steps, args.batch_size, args.sync_every, args.eval_every,
                   seed=args.seed, lr=args.lr)  # fmt: skip
    if result["trainer"].is_global_zero:
        corpus = result["corpus"]
        print(f"corpus: Python {corpus['python']} standard library, {corpus['files']} files, {corpus['bytes']:,} bytes")
        line = f"{args.strategy}: validation loss {result['before']:.3f} -> {result['after']:.3f} nats per byte"
        if result["per_step"] is not None:
            sent, dense = result["per_step"]
            line += f"; bytes sent per step, all ranks: {sent:,.0f} (plain DDP: {dense:,.0f})"
        print(line)
    return result


if __name__ == "__main__":
    main()
