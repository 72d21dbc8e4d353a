"""Step-time overhead of the diagnostics callbacks at their default frequencies, on the MNIST recipe.

LeNet-5 on MNIST (the t10k split, 2,000 images held out), 2 CPU processes over gloo, Top-k at
density 0.01 with error feedback and allgather. Each repeat fits the same model on the same
batches once without callbacks and once with all three (``CompressionMonitor()``,
``GradientHistogram()``, ``BoundCheck()``: every 50, 500 and 100 steps), in alternating order so
that load on a shared machine hits both alike. Timing runs from the batch start of step
``--skip`` to the end of training (validation is off), so the callbacks' periodic work (gathers,
captures, PNG plots, bound checks) and their end-of-fit work (last log, summary table, waiting
for the plot thread) are inside it. Three measures, each the median over repeats:

- wall: rank 0's wall time per step, with callbacks over without (paired per repeat); the
  figure the target is about, and the one other processes on a shared machine make noisy;
- CPU: the two ranks' process CPU time per step (all threads, the plot thread included), paired
  likewise; far less sensitive to other load;
- in hooks: rank 0's time inside the callbacks' own hooks, as a share of its step time.

Target: wall overhead under 5 %.

    python benchmarks/callback_overhead.py [--data-dir /work/shared/data/mnist] [--steps 1000]
        [--repeats 5] [--each] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.multiprocessing as mp

TARGET_PCT = 5.0
DENSITY = 0.01
DEFAULT_DATA_DIR = "/work/shared/data/mnist"


class StepTimer(pl.Callback):
    """Wall and process CPU time from the batch start of step ``skip`` to the end of training (put it last)."""

    def __init__(self, skip: int) -> None:
        self.skip = skip
        self.start: tuple[float, float] | None = None
        self.seconds = 0.0
        self.cpu_seconds = 0.0
        self.steps = 0

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        if self.start is None and trainer.global_step == self.skip:
            self.start = (time.perf_counter(), time.process_time())

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        assert self.start is not None, "fewer steps than --skip"
        self.seconds = time.perf_counter() - self.start[0]
        self.cpu_seconds = time.process_time() - self.start[1]
        self.steps = trainer.global_step - self.skip


def timed(cls: type[pl.Callback], skip: int) -> type[pl.Callback]:
    """A subclass of ``cls`` that adds up the seconds spent in its training hooks from step ``skip`` on."""

    class Timed(cls):  # type: ignore[misc, valid-type]
        seconds = 0.0

        def _time(self, trainer: pl.Trainer, hook: str, *args: Any) -> None:
            start = time.perf_counter()
            getattr(super(), hook)(trainer, *args)
            if trainer.global_step >= skip:
                self.seconds += time.perf_counter() - start

        def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
            self._time(trainer, "on_train_batch_start", *args)

        def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
            self._time(trainer, "on_train_batch_end", *args)

        def on_train_end(self, trainer: pl.Trainer, *args: Any) -> None:
            self._time(trainer, "on_train_end", *args)

    Timed.__name__ = cls.__name__
    return Timed


def callbacks_for(variant: str, skip: int) -> list[pl.Callback]:
    """The callbacks of a variant, each at its default frequency (timed)."""
    from lightning_gradcomp.callbacks import BoundCheck, CompressionMonitor, GradientHistogram

    every = {"CompressionMonitor": CompressionMonitor, "GradientHistogram": GradientHistogram, "BoundCheck": BoundCheck}
    chosen = list(every) if variant == "all three" else [variant] if variant in every else []
    return [timed(every[name], skip)() for name in chosen]


def fit_once(variant: str, args: argparse.Namespace, root: str) -> dict[str, Any]:
    """Wall and CPU seconds per step of one fit of ``variant`` on this rank, and the share spent in each callback."""
    from lightning.pytorch.loggers import CSVLogger

    from lightning_gradcomp import GradCompStrategy
    from lightning_gradcomp.examples.mnist import MNISTDataModule
    from lightning_gradcomp.examples.models import ImageClassifier, LeNet5

    pl.seed_everything(0, verbose=False)
    timer = StepTimer(args.skip)
    callbacks = callbacks_for(variant, args.skip)
    strategy = GradCompStrategy(
        compressor="topk", density=DENSITY, memory="ef", aggregator="allgather", timeout=timedelta(seconds=300)
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=args.steps,
        limit_val_batches=0,
        logger=CSVLogger(root, name=variant.replace(" ", "_")),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[*callbacks, timer],
    )
    data = MNISTDataModule(args.data_dir, batch_size=32, train_split="t10k", holdout=2000)
    trainer.fit(ImageClassifier(LeNet5(), lr=0.05), data)
    return {
        "wall": timer.seconds / timer.steps,
        "cpu": timer.cpu_seconds / timer.steps,
        "inside": {type(c).__name__: c.seconds / timer.seconds for c in callbacks},
    }


def worker(rank: int, port: int, args: argparse.Namespace, variants: list[str], out: str) -> None:
    os.environ.update(
        OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", RANK=str(rank),
        LOCAL_RANK=str(rank), NODE_RANK="0",
    )  # fmt: skip
    torch.set_num_threads(1)
    # The end-of-fit tables go to stderr (rank 0) or nowhere: stdout carries only the result (--json).
    sys.stdout = sys.stderr if rank == 0 else open(os.devnull, "w")  # noqa: SIM115
    times: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
    with tempfile.TemporaryDirectory() as root:
        # A short discarded fit first: one-off costs of the first fit in a process stay out of the repeats.
        fit_once("none", argparse.Namespace(**{**vars(args), "steps": args.skip + 20}), root)
        for repeat in range(args.repeats):
            order = variants if repeat % 2 == 0 else variants[::-1]
            for variant in order:
                times[variant].append(fit_once(variant, args, root))
    Path(out, f"{rank}.json").write_text(json.dumps(times))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run(args: argparse.Namespace, variants: list[str]) -> list[dict[str, list[dict[str, Any]]]]:
    """Each rank's :func:`fit_once` results by variant, in repeat order, from one 2-process run."""
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(worker, args=(free_port(), args, variants, out), nprocs=2, start_method="spawn")
        return [json.loads(Path(out, f"{rank}.json").read_text()) for rank in range(2)]


def paired_overhead(with_: list[float], without: list[float]) -> list[float]:
    """Per-repeat overhead in percent of ``with_`` over ``without`` (same repeat, same order of fits)."""
    return [100.0 * (a / b - 1.0) for a, b in zip(with_, without, strict=True)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", default=DEFAULT_DATA_DIR, help=f"MNIST IDX files (default {DEFAULT_DATA_DIR})")
    parser.add_argument("--steps", type=int, default=1000, help="optimizer steps per fit (default 1000)")
    parser.add_argument("--skip", type=int, default=50, help="first steps left out of the timing (default 50)")
    parser.add_argument("--repeats", type=int, default=5, help="fits per variant, alternating (default 5)")
    parser.add_argument("--each", action="store_true", help="also time each callback alone")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args()
    if not 0 <= args.skip < args.steps or args.repeats < 1:
        parser.error("need 0 <= --skip < --steps and --repeats >= 1")
    variants = ["none", "all three"]
    if args.each:
        variants += ["CompressionMonitor", "GradientHistogram", "BoundCheck"]
    ranks = run(args, variants)
    wall = {v: [r["wall"] for r in ranks[0][v]] for v in variants}
    cpu = {v: [sum(rank[v][i]["cpu"] for rank in ranks) for i in range(args.repeats)] for v in variants}
    rows = []
    for variant in variants:
        wall_pct = paired_overhead(wall[variant], wall["none"])
        cpu_pct = paired_overhead(cpu[variant], cpu["none"])
        inside = [r["inside"] for r in ranks[0][variant]]
        rows.append(
            {
                "variant": variant,
                "wall_ms_per_step": [1e3 * t for t in wall[variant]],
                "cpu_ms_per_step_both_ranks": [1e3 * t for t in cpu[variant]],
                "wall_overhead_pct_per_repeat": wall_pct,
                "cpu_overhead_pct_per_repeat": cpu_pct,
                "wall_overhead_pct": statistics.median(wall_pct),
                "cpu_overhead_pct": statistics.median(cpu_pct),
                "inside_hooks_pct": 100.0 * statistics.median(sum(s.values()) for s in inside),
                "inside_hooks_pct_by_callback": {
                    name: 100.0 * statistics.median(s[name] for s in inside) for name in inside[0]
                },
            }
        )
    main_row = next(r for r in rows if r["variant"] == "all three")
    summary = {
        "setup": f"LeNet-5, MNIST t10k (holdout 2000), batch 32 per rank, 2 CPU ranks (gloo), topk density {DENSITY}",
        "torch": torch.__version__,
        "steps": args.steps,
        "timed_steps": args.steps - args.skip,
        "repeats": args.repeats,
        "defaults": {"CompressionMonitor": 50, "GradientHistogram": 500, "BoundCheck": 100},
        "rows": rows,
        "wall_overhead_pct": main_row["wall_overhead_pct"],
        "cpu_overhead_pct": main_row["cpu_overhead_pct"],
        "inside_hooks_pct": main_row["inside_hooks_pct"],
        "target_pct": TARGET_PCT,
        "meets_target": main_row["wall_overhead_pct"] < TARGET_PCT,
    }
    if args.json:
        print(json.dumps(summary, indent=2))
        return
    print(f"{summary['setup']}; {summary['timed_steps']} timed steps per fit, {args.repeats} repeats (alternating)")
    print(
        f"{'callbacks':<20} {'wall ms/step':>12} {'wall':>7} {'CPU ms/step':>12} {'CPU':>7} {'in hooks':>9}"
        "   wall overhead per repeat"
    )
    for r in rows:
        each = " ".join(f"{p:+.1f}%" for p in r["wall_overhead_pct_per_repeat"])
        print(
            f"{r['variant']:<20} {statistics.median(r['wall_ms_per_step']):>12.3f} {r['wall_overhead_pct']:>+6.1f}% "
            f"{statistics.median(r['cpu_ms_per_step_both_ranks']):>12.3f} {r['cpu_overhead_pct']:>+6.1f}% "
            f"{r['inside_hooks_pct']:>8.2f}%   {each}"
        )
    by_callback = main_row["inside_hooks_pct_by_callback"]
    print("time inside the hooks, all three: " + ", ".join(f"{k} {v:.2f}%" for k, v in by_callback.items()))
    verdict = "meets" if summary["meets_target"] else "misses"
    print(
        f"all three at default frequencies: wall {main_row['wall_overhead_pct']:+.1f}% ({verdict} the "
        f"< {TARGET_PCT:g}% target), CPU {main_row['cpu_overhead_pct']:+.1f}%, "
        f"{main_row['inside_hooks_pct']:.2f}% of rank 0's step time inside their hooks"
    )


if __name__ == "__main__":
    main()
