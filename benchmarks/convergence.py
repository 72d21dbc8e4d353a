"""Accuracy against dense through the Trainer: LeNet-5 on MNIST with every named strategy, paired seeds.

Runs ``gradcomp fit`` on ``recipes/lenet_mnist_topk.yaml`` once per (method, seed), the recipe's
strategy replaced by a named one (``--trainer.strategy=ddp_topk``, ...; ``dense`` is Lightning's
own ``ddp``), with the same seeds, batches and steps for all: the presets as a user gets them,
end to end (``time_to_accuracy.py`` trains the same presets on hand-made DDP, faster, for its
curves). By default it trains on the first 8,000 images of the MNIST test set and validates on
the last 2,000 (the files in ../shared/data/mnist); ``--data-dir`` with the full dataset and
``--full`` use the standard split instead.

    python benchmarks/convergence.py --seeds 0 1 2 3 --steps 500 --json benchmarks/results/convergence_lenet.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from paired import paired_difference, verdict

from lightning_gradcomp import NAMED_STRATEGIES

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "lenet_mnist_topk.yaml"
DEFAULT_DATA = ROOT.parent / "shared" / "data" / "mnist"

#: The named strategies compared with plain DDP (``dense``); ``ddp_gradcomp_dense`` is dense by construction.
METHODS = ("dense", *sorted(set(NAMED_STRATEGIES) - {"ddp_gradcomp_dense"}))
#: Points of accuracy a method may lose against dense.
TOLERANCE = 0.5


def run(method: str, seed: int, args: argparse.Namespace, out: Path) -> dict:
    summary = out / f"{method}-{seed}.json"
    command = [sys.executable, "-m", "lightning_gradcomp.cli", "fit", "--config", str(RECIPE),
               f"--seed_everything={seed}", f"--trainer.max_steps={args.steps}", "--trainer.max_epochs=-1",
               f"--trainer.val_check_interval={args.steps}", "--trainer.check_val_every_n_epoch=null",
               f"--trainer.default_root_dir={out / 'runs'}", "--trainer.logger=false",
               "--trainer.enable_checkpointing=false", "--trainer.enable_progress_bar=false",
               f"--data.init_args.data_dir={args.data_dir}", f"--summary.path={summary}"]  # fmt: skip
    if not args.full:
        command += ["--data.init_args.train_split=t10k", "--data.init_args.holdout=2000"]
    command.append(f"--trainer.strategy={'ddp' if method == 'dense' else method}")
    start = time.monotonic()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT, timeout=args.timeout)
    if done.returncode != 0 or not summary.exists():
        raise SystemExit(f"{method} seed {seed} failed:\n{done.stderr[-3000:]}")
    result = json.loads(summary.read_text())
    result["wall_seconds"] = time.monotonic() - start
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated, from {list(METHODS)}")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--data-dir", default=str(DEFAULT_DATA))
    parser.add_argument("--full", action="store_true", help="train on train-*, validate on t10k-*")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per run")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    methods = args.methods.split(",")
    unknown = sorted(set(methods) - set(METHODS))
    if unknown:
        parser.error(f"unknown methods {unknown}; choose from {list(METHODS)}")

    from rich.console import Console
    from rich.table import Table

    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for method in ["dense", *[m for m in methods if m != "dense"]]:
            runs = [run(method, seed, args, Path(tmp)) for seed in args.seeds]
            accuracies = [100 * r["val_acc"] for r in runs]
            rows[method] = {
                "accuracy_by_seed": dict(zip(args.seeds, accuracies, strict=True)),
                "mean": statistics.mean(accuracies),
                "stdev": statistics.stdev(accuracies) if len(accuracies) > 1 else 0.0,
                "bytes_sent_per_step": statistics.mean(r["bytes_sent_per_step"] or 0 for r in runs),
                "dense_bytes_per_step": statistics.mean(r["dense_bytes_per_step"] or 0 for r in runs),
            }
            print(f"{method}: {rows[method]['mean']:.2f} +- {rows[method]['stdev']:.2f}", file=sys.stderr, flush=True)
    dense = rows["dense"]
    table = Table(title=f"LeNet-5 / MNIST, 2 CPU processes, {args.steps} steps, seeds {args.seeds}, "
                        "differences paired by seed")  # fmt: skip
    for column in ("method", "val acc % (mean +- sd)", "vs dense (points)", "95% interval", "per seed",
                   "bytes/step", "ratio", "verdict"):  # fmt: skip
        table.add_column(column, justify="left" if column in ("method", "per seed", "verdict") else "right")
    for method, row in rows.items():
        gap, half, _ = paired_difference(row["accuracy_by_seed"], dense["accuracy_by_seed"])
        row["gap_points"], row["half_width"] = gap, half
        row["verdict"] = "" if method == "dense" else verdict(gap, half, TOLERANCE)
        ratio = row["dense_bytes_per_step"] / row["bytes_sent_per_step"] if row["bytes_sent_per_step"] else None
        table.add_row(method, f"{row['mean']:.2f} +- {row['stdev']:.2f}", f"{gap:+.2f}",
                      "-" if method == "dense" else f"[{gap - half:+.2f}, {gap + half:+.2f}]",
                      " ".join(f"{a:.2f}" for a in row["accuracy_by_seed"].values()),
                      f"{row['bytes_sent_per_step']:,.0f}", f"{ratio:.1f}x" if ratio else "-",
                      f"{row['verdict']} (tolerance {TOLERANCE})" if row["verdict"] else "")  # fmt: skip
    Console().print(table)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"steps": args.steps, "seeds": args.seeds, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
