"""``RunSummary``: what one training run reached and what its gradient exchange cost, as a table and JSON.

The ``gradcomp`` command adds it to every run (configure it under ``summary:`` in a recipe or with
``--summary.path=...``); ``gradcomp compare`` reads the JSON it writes. Bytes come from the
strategy's hook (``strategy.gradcomp_hook.history``: what was handed to collectives, counted, not
computed). Lightning's plain ``DDPStrategy`` has no hook: its bytes per step are the bytes of the
gradients it allreduces, i.e. of the trainable parameters, and the summary says so in
``bytes_source``.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch import Callback
from lightning.pytorch.trainer.states import TrainerFn
from rich.console import Console
from rich.table import Table

from lightning_gradcomp.core.validation import check_bool

#: Where the bytes of a summary come from.
BYTES_FROM_HOOK = "hook"
BYTES_FROM_PARAMETERS = "parameters"
BYTES_NONE = "none (one process)"


def _metric(trainer: pl.Trainer, key: str) -> float | None:
    value = trainer.callback_metrics.get(key)
    return None if value is None else float(value)


def _finite(value: float | None) -> float | None:
    """JSON has no infinity or NaN: keep finite numbers, map the rest to ``None``."""
    return value if value is not None and math.isfinite(value) else None


class RunSummary(Callback):
    """Records the validation curve, final metrics, bytes per step and fit time of a ``fit``.

    At the end of training every rank contributes its byte counts (ranks of a sparse method can
    send different amounts); rank 0 prints a one-row table and writes ``path`` as JSON. Bytes per
    step are means over the steps the hook's history holds (all of them up to its length, 10,000
    by default; dense warm-up steps included) and over ranks.

    Args:
        path: JSON file written at the end of ``fit`` (``None``: write nothing).
        print_table: print the table at the end of ``fit``.
        accuracy: name of the logged accuracy metric.
        loss: name of the logged validation loss (falls back to ``train_loss`` when not logged).
    """

    def __init__(
        self, path: str | None = None, print_table: bool = True, accuracy: str = "val_acc", loss: str = "val_loss"
    ) -> None:
        super().__init__()
        if path is not None and (not isinstance(path, str) or not path):
            raise ValueError(f"path must be a file name or None, got {path!r}")
        check_bool("print_table", print_table)
        for name, value in (("accuracy", accuracy), ("loss", loss)):
            if not isinstance(value, str) or not value:
                raise ValueError(f"{name} must be a metric name, got {value!r}")
        self.path, self.print_table, self.accuracy, self.loss = path, print_table, accuracy, loss
        self.curve: list[dict[str, Any]] = []
        self.summary: dict[str, Any] | None = None
        self._start = 0.0

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.curve, self.summary, self._start = [], None, time.perf_counter()

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking or trainer.state.fn != TrainerFn.FITTING:
            return
        self.curve.append(
            {
                "step": trainer.global_step,
                "epoch": trainer.current_epoch,
                self.accuracy: _metric(trainer, self.accuracy),
                self.loss: _metric(trainer, self.loss),
            }
        )

    def _bytes(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any]:
        hook = getattr(trainer.strategy, "gradcomp_hook", None) or getattr(trainer.strategy, "replica_exchange", None)
        outer_sync = getattr(trainer.strategy, "outer_sync", None)
        if outer_sync is not None:  # DiLoCo: the whole fit's inner steps, bytes at the synchronisations
            source = BYTES_FROM_HOOK
            steps, sent, dense, synchronisations = outer_sync.totals()
            local = [sent, dense, steps, synchronisations if outer_sync.exchange is not None else 0]
        elif hook is not None:
            history = list(hook.history)
            source = BYTES_FROM_HOOK
            local = [
                sum(s.bytes_sent for s in history),
                sum(s.dense_bytes for s in history),
                len(history),
                sum(s.compressed for s in history),
            ]
        else:
            source = BYTES_FROM_PARAMETERS if trainer.world_size > 1 else BYTES_NONE
            dense = sum(p.numel() * p.element_size() for p in pl_module.parameters() if p.requires_grad)
            steps = trainer.global_step
            local = [dense * steps if trainer.world_size > 1 else 0, dense * steps, steps, 0]
        totals = torch.tensor(local, dtype=torch.float64, device=pl_module.device)
        if trainer.world_size > 1:
            totals = trainer.strategy.reduce(totals, reduce_op="sum") / trainer.world_size
        sent, dense, steps, compressed = (float(v) for v in totals.cpu())
        return {
            "bytes_source": source,
            "bytes_sent_per_step": sent / steps if steps else None,
            "dense_bytes_per_step": dense / steps if steps else None,
            "compression_ratio": _finite(dense / sent) if sent else None,
            "exchange_steps": round(steps),
            "compressed_steps": round(compressed),
        }

    def _loss(self, trainer: pl.Trainer) -> float | None:
        value = _metric(trainer, self.loss)
        return _metric(trainer, "train_loss") if value is None else value

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        strategy = trainer.strategy
        compressor = getattr(strategy, "compressor", None)
        if compressor is None and getattr(strategy, "outer_sync", None) is not None:
            exchange = strategy.outer_sync.exchange
            compressor = exchange.compressor if exchange is not None else None
        if compressor is None and getattr(strategy, "replica_exchange", None) is not None:  # HSDP's
            compressor = strategy.replica_exchange.average.compressor
        summary = {
            "strategy": type(strategy).__name__,
            "compressor": repr(compressor) if compressor is not None else None,
            "world_size": trainer.world_size,
            "global_step": trainer.global_step,
            "epochs": trainer.current_epoch,
            self.accuracy: _finite(_metric(trainer, self.accuracy)),
            self.loss: _finite(self._loss(trainer)),
            **self._bytes(trainer, pl_module),
            "fit_seconds": time.perf_counter() - self._start,
            "curve": self.curve,
        }
        self.summary = summary
        if not trainer.is_global_zero:
            return
        if self.path is not None:
            path = Path(self.path)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(summary, indent=2))
        if self.print_table:
            console = Console()
            if not console.is_terminal:  # a log file or a pipe: do not wrap the table at 80 columns
                console = Console(width=120)
            console.print(summary_table(summary, self.accuracy, self.loss))


def _format(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def summary_table(summary: dict[str, Any], accuracy: str = "val_acc", loss: str = "val_loss") -> Table:
    """A one-row rich table of a :class:`RunSummary` record."""
    title = f"{summary['strategy']} on {summary['world_size']} process(es), {summary['global_step']} steps"
    if summary.get("compressor"):
        title += f": {summary['compressor']}"
    table = Table(title=title)
    columns = (accuracy, loss, "sent B/step", "dense B/step", "ratio", "MB saved", "bytes from", "fit s")
    for column in columns:
        table.add_column(column, justify="right")
    ratio = summary["compression_ratio"]
    sent, dense, steps = summary["bytes_sent_per_step"], summary["dense_bytes_per_step"], summary.get("exchange_steps")
    saved = None if None in (sent, dense, steps) else (dense - sent) * steps / 1e6
    if summary.get("compressor"):
        table.caption = "accuracy against plain DDP on the same recipe: gradcomp compare --strategies ddp,recipe"
    table.add_row(
        _format(summary[accuracy], ".4f"),
        _format(summary[loss], ".4f"),
        _format(summary["bytes_sent_per_step"], ",.0f"),
        _format(summary["dense_bytes_per_step"], ",.0f"),
        "-" if ratio is None else f"{ratio:.1f}x",
        _format(saved, ",.1f"),
        summary["bytes_source"],
        f"{summary['fit_seconds']:.1f}",
    )
    return table
