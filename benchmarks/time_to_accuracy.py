"""Time to accuracy: how soon each method reaches plain DDP's accuracy on a slow link.

Two measurements, combined:

1. ``train``: P real gloo processes on loopback train ``--model`` on MNIST with every method
   (plain DDP, PyTorch's fp16 and PowerSGD hooks, every named strategy, the variants of
   ``methods.py``), once per seed; a seed fixes the initial weights, the batch order and the
   compressors' random streams, and is the same for every method (paired runs). The validation
   accuracy is taken every ``--eval-every`` steps: a curve of accuracy against steps.
2. ``benchmarks/network.py --model M --batch B --ranks P``: the seconds per step of every method
   on links shaped to 100 Mbit/s and 1 Gbit/s, measured in one launch.

``report`` reads both: a method's *steps to target* is the first evaluated step at which its
validation accuracy reaches the target (per seed), and its *time to target* is those steps times
its seconds per step on the link (a density warm-up's first steps at their own measured mean). This
is valid because what a step computes does not depend on the link: the same seed gives the same
compressed payloads, the same averages and the same weights on a 100 Mbit/s link as on loopback
(the hook's arithmetic and random streams are functions of the gradients, the seed, the rank and
the step only); the link changes how long a step takes, and
in steady state every step of a method takes the same time. Evaluation is not counted.

    python benchmarks/time_to_accuracy.py train --model lenet --seeds 0 1 2 3 4 --json results/tta_lenet.json
    sudo python benchmarks/network.py --model lenet --ranks 4 --batch 32 --rate 100mbit --rate 1gbit \\
        --json results/network_lenet.json
    python benchmarks/time_to_accuracy.py report --curves results/tta_lenet.json \\
        --network results/network_lenet.json --png results/tta_lenet.png
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any

import workloads
from methods import (
    DEFAULT_METHODS,
    HSDP_METHODS,
    LOCAL_SGD_VARIANTS,
    VARIANTS,
    LocalSGD,
    attach,
    check_methods,
    compressed_adam,
    hsdp_model,
    is_compressed_adam,
    is_local_sgd,
    powersgd_start,
    sync_interval,
)
from paired import paired_difference, verdict
from workloads import CONTEXT, LANGUAGE_MODELS, MODELS, STDLIB_CONTEXT, build_model, markov_corpus

from lightning_gradcomp import COMPRESSED_ADAM_PRESETS

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DATA = ROOT.parent / "shared" / "data" / "mnist"
DEFAULT_TRAIN_METHODS = ",".join((DEFAULT_METHODS, *VARIANTS))
#: Windows of ``CONTEXT + 1`` tokens the language model's corpus holds (train and validation).
LM_WINDOWS = 8192

# ---------------------------------------------------------------- training curves (real ranks)


def _mnist(data_dir: str, holdout: int) -> tuple[Any, Any]:
    """(train, validation) tensors: the first images of t10k for training, the last ``holdout`` for validation."""
    from lightning_gradcomp.examples.mnist import MNISTDataModule

    data = MNISTDataModule(data_dir, train_split="t10k", holdout=holdout)
    data.setup("fit")
    return data.train_set.tensors, data.val_set.tensors


def _text(holdout: int) -> tuple[Any, Any]:
    """(train, validation) windows of the generated corpus (``workloads.markov_corpus``): inputs and next tokens,
    ``holdout`` windows of ``CONTEXT + 1`` tokens kept for validation."""
    tokens = markov_corpus(LM_WINDOWS * (CONTEXT + 1)).reshape(LM_WINDOWS, CONTEXT + 1)
    train, val = tokens[:-holdout], tokens[-holdout:]
    return (train[:, :-1], train[:, 1:]), (val[:, :-1], val[:, 1:])


def _stdlib_text(holdout: int) -> tuple[tuple[Any, Any], tuple[Any, Any], dict]:
    """(train, validation) windows of the standard library's source (``stdlib-lm``), as bytes: inputs and next bytes,
    the first ``holdout`` windows of the held-out files for validation; and the corpus's summary (what it is)."""
    from lightning_gradcomp.examples.stdlib_corpus import read_stdlib_corpus, windows

    corpus = read_stdlib_corpus()
    train, val = windows(corpus.train, STDLIB_CONTEXT), windows(corpus.validation, STDLIB_CONTEXT)[:holdout]
    return (train[:, :-1], train[:, 1:]), (val[:, :-1], val[:, 1:]), corpus.summary


def _batches(seed: int, n: int, global_batch: int, steps: int):
    """Indices of each step's global batch: a fresh permutation of the ``n`` images per epoch, from ``seed``."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    order, position = torch.randperm(n, generator=gen), 0
    for _ in range(steps):
        if position + global_batch > n:
            order, position = torch.randperm(n, generator=gen), 0
        yield order[position : position + global_batch]
        position += global_batch


def _validate(model, name: str, val, rank: int, world: int) -> float:
    """Validation accuracy in percent (the language model: mean loss per token, nats): every rank scores its
    share, the sums are summed."""
    import torch
    import torch.distributed as dist

    x, y = val[0][rank::world], val[1][rank::world]
    model.eval()
    with torch.no_grad():
        if name in LANGUAGE_MODELS:
            score = sum(float(workloads.loss(name, model(x[i : i + 64]), y[i : i + 64])) * y[i : i + 64].numel()
                        for i in range(0, len(x), 64))  # fmt: skip
            counts = torch.tensor([score, y.numel()], dtype=torch.float64)
        else:
            correct = sum(int((model(x[i : i + 500]).argmax(1) == y[i : i + 500]).sum()) for i in range(0, len(x), 500))
            counts = torch.tensor([correct, len(x)], dtype=torch.float64)
    model.train()
    dist.all_reduce(counts)
    return float(counts[0] / counts[1]) * (1.0 if name in LANGUAGE_MODELS else 100.0)


def metric_sign(curves: dict) -> float:
    """+1 when the curves' metric is an accuracy (higher is better), -1 for a validation loss."""
    return -1.0 if curves.get("metric") == "loss" else 1.0


def _parameter_groups(model, hook, momentum: float) -> list[dict]:
    """One group with ``momentum``; under momentum correction the compressed parameters get none
    (the hook's memory applies it before sparsifying)."""
    if hook is None or not getattr(hook.memory, "momentum", 0.0):
        return [{"params": list(model.parameters()), "momentum": momentum}]
    compressed = {name for unit in hook.units if unit.compressed for name in unit.names}
    named = list(model.named_parameters())
    return [{"params": [p for n, p in named if n in compressed], "momentum": 0.0},
            {"params": [p for n, p in named if n not in compressed], "momentum": momentum}]  # fmt: skip


def _train_one(method: str, seed: int, args: argparse.Namespace, data, rank: int, world: int) -> dict:
    """One run of ``method``: DDP with its hook; DiLoCo (``methods.LOCAL_SGD``: no DDP, each rank's own share of the
    step's global batch with the same optimizer as its inner one, synchronising every ``--sync-every`` steps; evaluated
    right after a synchronisation, ``--eval-every`` being a multiple of it, where every rank holds the same weights);
    or HSDP (``methods.HSDP_METHODS``: the model sharded over half the ranks, two replicas, as two nodes would)."""
    import torch
    from torch.nn.parallel import DistributedDataParallel

    from lightning_gradcomp.examples.gpt import warmup_cosine

    (train_x, train_y), val = data
    torch.manual_seed(seed)
    model = build_model(args.model)
    local_sgd, adam = is_local_sgd(method), is_compressed_adam(method)
    exchange = hook = None
    if method in HSDP_METHODS:
        forward, exchange = hsdp_model(method, model, 2, world // 2)
    else:
        forward = model if local_sgd else DistributedDataParallel(model)
        hook = None if local_sgd or adam else attach(method, forward, model, seed=seed, steps=args.steps)
    if args.model == "stdlib-lm":  # a GPT: AdamW (betas 0.9, 0.95; weight decay on matrices), warm-up, cosine decay
        groups = [{"params": [p for p in model.parameters() if p.dim() >= 2], "weight_decay": 0.1},
                  {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0}]  # fmt: skip
        optimizer = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95))
    elif args.model == "lm":  # a Transformer: AdamW, as such models are trained
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    else:
        optimizer = torch.optim.SGD(_parameter_groups(model, hook, args.momentum), lr=args.lr)
    # linear learning-rate warm-up (Goyal et al., 2017, Sec. 2.2): 0 -> lr over the first --lr-warmup steps; with
    # --lr-schedule cosine, then a cosine decay to a tenth of lr at the last step (Loshchilov and Hutter, 2017)
    warmup = max(args.lr_warmup, 0)
    if args.lr_schedule == "cosine":
        factor = partial(warmup_cosine, warmup=warmup, total=args.steps)
    else:
        factor = lambda t: min(1.0, (t + 1) / warmup) if warmup else 1.0  # noqa: E731
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
    local = LocalSGD(method, model, optimizer, args.sync_every, seed) if local_sgd else None
    # compressed Adam takes the optimizer's step: built after the optimizer (and the schedule, which it keeps)
    exchange = compressed_adam(method, optimizer, forward, seed) if adam else exchange
    curve, start = [], time.perf_counter()
    try:
        for step, indices in enumerate(_batches(seed, len(train_x), world * args.batch, args.steps), start=1):
            mine = indices[rank * args.batch : (rank + 1) * args.batch]
            optimizer.zero_grad()
            workloads.loss(args.model, forward(train_x[mine]), train_y[mine]).backward()
            optimizer.step()
            if local is not None:
                local.step()
            schedule.step()
            if step % args.eval_every == 0 or step == args.steps:
                curve.append((step, _validate(model, args.model, val, rank, world)))
    finally:
        if local is not None:
            local.close()
    recorder = next((r for r in (hook, local, exchange) if r is not None), None)
    history = list(recorder.history if recorder is not None else [])
    compressed = [s for s in history if not s.warmup]  # DiLoCo: every inner step, its synchronisations' bytes spread
    return {
        # over every step of the run, warm-up and dense steps included (what the run sent in all)
        "run_bytes_sent_per_step": statistics.mean(s.bytes_sent for s in history) if history else None,
        "run_dense_bytes_per_step": statistics.mean(s.dense_bytes for s in history) if history else None,
        **({"freeze_step": exchange.freeze_step} if adam else {}),
        "curve": curve,
        "phases": phases(history) if hook is not None else None,
        "final": curve[-1][1],
        "seconds": time.perf_counter() - start,
        **({"sync_every": local.sync_every} if local is not None else {}),
        "bytes_sent_per_step": statistics.mean(s.bytes_sent for s in compressed) if compressed else None,
        "dense_bytes_per_step": statistics.mean(s.dense_bytes for s in compressed) if compressed else None,
    }


def phases(history) -> list[list]:
    """The run's steps as consecutive phases ``[regime, compressed, planned density, steps, mean bytes sent]``
    (``StepStats``' fields): which steps ran at which level, for the time model and the decisions' plot."""
    out: list[list] = []
    for s in history:
        key = [s.regime, s.compressed, s.planned_density]
        if out and out[-1][:3] == key:
            out[-1][4] += (s.bytes_sent - out[-1][4]) / (out[-1][3] + 1)
            out[-1][3] += 1
        else:
            out.append([*key, 1, float(s.bytes_sent)])
    return out


def _train_worker(rank: int, world: int, args: argparse.Namespace, store: str) -> None:
    import torch
    import torch.distributed as dist

    from lightning_gradcomp.ddp.torch_ddp import destroy_process_group

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=args.timeout))  # fmt: skip
    failure = None
    try:
        corpus = None
        if args.model == "stdlib-lm":
            *data, corpus = _stdlib_text(args.holdout)
        else:
            data = _text(args.holdout) if args.model == "lm" else _mnist(args.data_dir, args.holdout)
        settings = ("model", "ranks", "batch", "lr", "lr_warmup", "lr_schedule", "momentum", "steps", "eval_every",
                    "seeds", "sync_every")  # fmt: skip
        report: dict[str, Any] = {key: getattr(args, key) for key in settings}
        report["metric"] = "loss" if args.model in LANGUAGE_MODELS else "accuracy"
        if corpus is not None:
            report["corpus"] = corpus
        report["holdout"], report["runs"] = args.holdout, {}
        for seed in args.seeds:
            for method in args.methods.split(","):
                result = _train_one(method, seed, args, data, rank, world)
                if rank == 0:
                    report["runs"].setdefault(method, {})[str(seed)] = result
                    print(f"{method} seed {seed}: {result['final']:.3f} ({result['seconds']:.0f} s)",
                          file=sys.stderr, flush=True)  # fmt: skip
                    Path(args.json).write_text(json.dumps(report, indent=1))  # after every run: partial results kept
    except Exception:
        failure = traceback.format_exc()  # the text: a live traceback would keep the run's DDP wrappers alive
    destroy_process_group()  # after the frames that held DDP wrappers are gone (see its docstring)
    if failure is not None:
        raise RuntimeError(f"rank {rank} failed:\n{failure}")


def train(args: argparse.Namespace) -> int:
    import torch.multiprocessing as mp

    check_methods(args.methods.split(","))
    if "dense" not in args.methods.split(","):
        raise SystemExit("--methods must include dense: the targets are relative to plain DDP's accuracy")
    os.environ["OMP_NUM_THREADS"] = "1"
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_train_worker, args=(args.ranks, args, str(Path(tmp) / "store")), nprocs=args.ranks)
    return 0


# ---------------------------------------------------------------- combining curves and step times


def steps_to_target(curve: list[tuple[int, float]], target: float, sign: float = 1.0) -> int | None:
    """The first evaluated step whose validation accuracy is at least ``target`` (``None``: never); with
    ``sign=-1``, whose validation loss is at most ``target``."""
    return next((step for step, value in curve if sign * value >= sign * target), None)


def elapsed_seconds(measured: dict, steps: int, phases: list[list] | None = None) -> float:
    """Wall-clock seconds of a method's first ``steps`` steps from network.py's row ``measured``.

    ``steps * s/step``, except that a method with dense steps or a density warm-up spends its first
    ``D + W`` steps (``D`` dense, then the warm-up; they send more) at their own measured mean, and
    that under Accordion each step takes its regime's time: the run's ``phases`` (:func:`phases`) say
    which steps were critical, timed at ``critical_seconds_per_step``, the others at ``seconds_per_step``.
    """
    if phases is not None and measured.get("critical_seconds_per_step"):
        total, left = 0.0, steps
        for regime, _, _, count, _ in phases:
            taken = min(left, count)
            rate = measured["critical_seconds_per_step"] if regime == "critical" else measured["seconds_per_step"]
            total, left = total + taken * rate, left - taken
        return total + left * measured["seconds_per_step"]
    early = measured.get("dense_steps", 1) + measured.get("density_warmup_steps", 0)
    phase = early if measured.get("warmup_seconds_per_step") else 0
    early = min(steps, phase)
    return early * (measured.get("warmup_seconds_per_step") or 0.0) + (steps - early) * measured["seconds_per_step"]


def measurements(network: dict, rate: str, steps: int) -> dict[str, dict]:
    """``method -> network.py's row`` on ``rate``, for the methods it timed; ``powersgd:start-10pct`` (the same
    steady state as ``powersgd``, dense for its first 10% of ``steps``) from the rows of both."""
    rows = {r["method"]: r for r in network["rates"][rate] if r["seconds_per_step"]}
    for variant, (base, _) in LOCAL_SGD_VARIANTS.items():  # another outer step costs the same time
        if base in rows and variant not in rows:
            rows[variant] = {**rows[base], "method": variant}
    for name, row in list(rows.items()):  # compressed Adam's warm-up: dense steps, at plain DDP's time
        if is_compressed_adam(name) and "dense" in rows:
            freeze = sync_interval(name)[1] or COMPRESSED_ADAM_PRESETS[sync_interval(name)[0].split(":")[0]][1].get(
                "freeze_step", 100
            )
            rows[name] = {**row, "dense_steps": freeze, "warmup_seconds_per_step": rows["dense"]["seconds_per_step"]}
    if "powersgd" in rows and "dense" in rows:
        start = powersgd_start("powersgd:start-10pct", steps)
        rows["powersgd:start-10pct"] = {**rows["powersgd"], "method": "powersgd:start-10pct", "dense_steps": start,
                                        "warmup_seconds_per_step": rows["dense"]["seconds_per_step"]}  # fmt: skip
    return rows


def check_same_setting(curves: dict, network: dict) -> None:
    """Refuse to combine measurements of different models, batches or world sizes."""
    for key in ("model", "batch", "ranks"):
        if curves.get(key) != network.get(key):
            raise ValueError(
                f"the curves and the step times measure different settings: {key} is {curves.get(key)!r} in the "
                f"curves and {network.get(key)!r} in the network results"
            )


def final_accuracy(curve: list[tuple[int, float]], window: int) -> float:
    """The mean validation accuracy of the evaluations in the last ``window`` steps (the last one at least).

    At a constant learning rate the last iterate's accuracy swings between evaluations (plain DDP's
    LeNet-5, seed 0: 98.25, 97.60, 98.30 at steps 460-500); the mean over the run's end measures
    where a method has converged to, not where its last step happened to land.
    """
    last = curve[-1][0]
    return statistics.mean(accuracy for step, accuracy in curve if step > last - window or step == last)


def dense_targets(curves: dict, below: float, window: int = 0) -> dict[str, float]:
    """``seed -> plain DDP's final accuracy with that seed minus below`` (a loss: plus ``below``): each seed's
    target is set by the dense run it is paired with."""
    sign = metric_sign(curves)
    return {seed: final_accuracy(run["curve"], window) - sign * below for seed, run in curves["runs"]["dense"].items()}


def time_to_target(curves: dict, network: dict, rate: str, targets: dict[str, float]) -> dict[str, dict]:
    """Per method: steps and seconds to ``targets[seed]`` per seed on ``rate``, and their means.

    ``seconds[seed] = elapsed_seconds(steps[seed])`` (``steps * s/step`` in steady state); the means
    are over seeds, ``None`` unless every seed reached the target (a mean over the lucky seeds would
    flatter a method).
    """
    measured = measurements(network, rate, curves["steps"])
    table = {}
    for method, runs in curves["runs"].items():
        if method not in measured:
            continue
        steps = {seed: steps_to_target(run["curve"], targets[seed], metric_sign(curves)) for seed, run in runs.items()}
        seconds = {seed: None if s is None else elapsed_seconds(measured[method], s, runs[seed].get("phases"))
                   for seed, s in steps.items()}  # fmt: skip
        reached = [s for s in seconds.values() if s is not None]
        table[method] = {
            "seconds_per_step": measured[method]["seconds_per_step"],
            "steps": steps,
            "seconds": seconds,
            "reached": len(reached),
            "mean_steps": statistics.mean(steps.values()) if len(reached) == len(steps) else None,
            "mean_seconds": statistics.mean(reached) if len(reached) == len(seconds) else None,
        }
    dense = table.get("dense", {}).get("mean_seconds")
    for row in table.values():
        row["speedup_vs_dense"] = dense / row["mean_seconds"] if dense and row["mean_seconds"] else None
    return table


def finals(curves: dict, window: int = 0) -> dict[str, dict[int, float]]:
    """``method -> {seed: final validation accuracy}`` (:func:`final_accuracy` over ``window`` steps)."""
    return {m: {int(s): final_accuracy(run["curve"], window) for s, run in runs.items()}
            for m, runs in curves["runs"].items()}  # fmt: skip


def parity(curves: dict, tolerance: float, window: int = 0) -> dict[str, dict]:
    """Final accuracy of every method against plain DDP's, paired by seed, with the 95% interval and verdict (for a
    loss, the difference is dense's loss minus the method's: negative is worse, as for an accuracy)."""
    accuracy = finals(curves, window)
    sign = metric_sign(curves)
    rows = {}
    for method, by_seed in accuracy.items():
        values = list(by_seed.values())
        signed = {s: sign * v for s, v in by_seed.items()}
        mean, half, n = paired_difference(signed, {s: sign * v for s, v in accuracy["dense"].items()})
        rows[method] = {
            "mean": statistics.mean(values),
            "stdev": statistics.stdev(values) if len(values) > 1 else 0.0,
            "difference": mean,
            "half_width": half,
            "seeds": n,
            "verdict": "" if method == "dense" else verdict(mean, half, tolerance),
        }
    return rows


# What makes two train runs comparable, with the value files written before the key existed had.
_SETTING_KEYS = {
    "model": None,
    "ranks": None,
    "batch": None,
    "lr": None,
    "momentum": 0.9,
    "lr_warmup": 0,
    "steps": None,
    "eval_every": None,
    "holdout": None,
}


def load_curves(paths: list[str]) -> dict:
    """The curves of several ``train`` runs of the same setting, merged by method and seed.

    Methods may have different seeds (a run stopped early, variants run on fewer seeds): every
    comparison pairs a method with plain DDP on the seeds the method has, and says how many. A
    (method, seed) in several files must have the same curve there (runs are deterministic):
    otherwise the files measured different code, and ``ValueError`` says which.
    """
    curves = json.loads(Path(paths[0]).read_text())
    for path in paths[1:]:
        more = json.loads(Path(path).read_text())
        for key, default in _SETTING_KEYS.items():
            if more.get(key, default) != curves.get(key, default):
                raise ValueError(f"{path} has {key}={more.get(key)!r}, {paths[0]} {curves.get(key)!r}: not comparable")
        for method, runs in more["runs"].items():
            for seed, run in runs.items():
                known = curves["runs"].setdefault(method, {}).setdefault(seed, run)
                if [list(point) for point in known["curve"]] != [list(point) for point in run["curve"]]:
                    raise ValueError(f"{method} seed {seed} has different curves in {path} and an earlier file")
    missing = sorted(set().union(*(set(runs) for runs in curves["runs"].values())) - set(curves["runs"]["dense"]))
    if missing:
        raise ValueError(f"plain DDP has no run for seeds {missing}: nothing to pair those with")
    curves["seeds"] = sorted(int(s) for s in curves["runs"]["dense"])
    return curves


def report(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    curves = load_curves(args.curves)
    network = json.loads(Path(args.network).read_text()) if args.network else None
    if network is not None:
        check_same_setting(curves, network)
    window = args.final_window
    console, out = Console(width=170), {"parity": parity(curves, args.tolerance, window), "links": {}}
    dense_final = statistics.mean(finals(curves, window)["dense"].values())
    sign = metric_sign(curves)
    targets = [dense_final - sign * below for below in args.below]  # for the plot: the mean of the per-seed targets
    what, unit = ("validation loss", "nats") if sign < 0 else ("accuracy", "points")
    seeds = len(curves["seeds"])

    table = Table(title=f"{curves['model']}, {curves['ranks']} ranks x {curves['batch']}, {curves['steps']} "
                        f"steps: final {what} (mean over the last {window} steps) against plain DDP "
                        f"({seeds} seeds), paired by seed")  # fmt: skip
    for column in ("method", "seeds", f"final {what} (mean +- sd)", f"vs dense ({unit}, + better)", "95% interval",
                   "verdict"):  # fmt: skip
        table.add_column(column, justify="left" if column in ("method", "verdict") else "right")
    for method, row in out["parity"].items():
        low, high = row["difference"] - row["half_width"], row["difference"] + row["half_width"]
        table.add_row(method, str(row["seeds"]), f"{row['mean']:.2f} +- {row['stdev']:.2f}",
                      f"{row['difference']:+.2f}",
                      f"[{low:+.2f}, {high:+.2f}]" if method != "dense" else "-",
                      f"{row['verdict']} (tolerance {args.tolerance})" if row["verdict"] else "")  # fmt: skip
    console.print(table)
    if args.decisions_png:
        plot_decisions(curves, args.decisions_png)
    if network is None:
        _write(args, out)
        return 0

    for rate in [r for r in network["rates"] if r != "none" or args.loopback]:
        out["links"][rate] = {f"{b}": time_to_target(curves, network, rate, dense_targets(curves, b, window))
                              for b in args.below}  # fmt: skip
        table = Table(title=f"Time to accuracy, links shaped to {rate}: steps to target x s/step measured by "
                            f"network.py; target: plain DDP's final {what} with the same seed (mean "
                            f"{dense_final:.3f}) {'minus' if sign > 0 else 'plus'} {' or '.join(map(str, args.below))} "
                            f"{unit}")  # fmt: skip
        table.add_column("method", justify="left")
        table.add_column("s/step", justify="right")
        for b in args.below:
            for column in (f"steps to -{b}", f"s to -{b}", "x dense"):
                table.add_column(column, justify="right")
        table.add_column(f"final {what}", justify="right")
        first = out["links"][rate][f"{args.below[0]}"]
        for method in first:
            cells = [method, f"{first[method]['seconds_per_step']:.3f}"]
            for b in args.below:
                row = out["links"][rate][f"{b}"][method]
                missed = f"{len(row['steps']) - row['reached']}/{len(row['steps'])} never"
                cells += [f"{row['mean_steps']:.0f}" if row["mean_steps"] is not None else missed,
                          f"{row['mean_seconds']:.1f}" if row["mean_seconds"] is not None else "-",
                          f"{row['speedup_vs_dense']:.2f}" if row["speedup_vs_dense"] else "-"]  # fmt: skip
            p = out["parity"][method]
            cells.append(f"{p['mean']:.2f} +- {p['stdev']:.2f}")
            table.add_row(*cells)
        console.print(table)
    if args.png:
        plot(curves, network, targets, args.png, args.loopback)
    _write(args, out)
    return 0


def plot_decisions(curves: dict, path: str) -> None:
    """Bytes each rank sent per step against the step, one line per method with recorded phases (the first seed's
    run): where a schedule (a warm-up, Accordion's regimes) compressed less, and for how long."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(11, 5))
    colors = plt.get_cmap("tab20").colors
    for i, (method, runs) in enumerate(curves["runs"].items()):
        run = runs[min(runs, key=int)]
        if not run.get("phases"):
            continue
        steps, sent, start = [], [], 1
        for _, _, _, count, mean_bytes in run["phases"]:
            steps += [start, start + count - 1]
            sent += [mean_bytes, mean_bytes]
            start += count
        ax.plot(steps, sent, label=method, color=colors[i % len(colors)], linewidth=1.4)
    ax.set_yscale("log")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("bytes sent per rank per step (mean of each phase)")
    ax.set_title(f"{curves['model']}, {curves['ranks']} ranks: what each schedule sent (seed {min(curves['seeds'])})")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def _write(args: argparse.Namespace, out: dict) -> None:
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=1, default=lambda v: None if v == math.inf else v))


def plot(curves: dict, network: dict, targets: list[float], path: str, loopback: bool) -> None:
    """Validation accuracy (mean over seeds) against wall-clock seconds on each link, one curve per method
    (PyTorch's hooks, the named strategies and DiLoCo's outer-momentum variants; the DDP presets' variants,
    ``preset:what``, are in the tables only)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = [r for r in network["rates"] if r != "none" or loopback]
    fig, axes = plt.subplots(1, len(rates), figsize=(7 * len(rates), 6), squeeze=False)
    methods = [m for m in curves["runs"] if ":" not in m or m in LOCAL_SGD_VARIANTS]
    colors = dict(zip(methods, plt.get_cmap("tab20").colors, strict=False))
    for ax, rate in zip(axes[0], rates, strict=True):
        measured = measurements(network, rate, curves["steps"])
        for method in methods:
            runs = curves["runs"][method]
            if method not in measured:
                continue
            by_step: dict[int, list[float]] = {}
            seconds: dict[int, list[float]] = {}
            for run in runs.values():
                for step, accuracy in run["curve"]:
                    by_step.setdefault(step, []).append(accuracy)
                    seconds.setdefault(step, []).append(elapsed_seconds(measured[method], step, run.get("phases")))
            steps = sorted(by_step)
            ax.plot([statistics.mean(seconds[s]) for s in steps], [statistics.mean(by_step[s]) for s in steps],
                    label=method, linewidth=2.2 if method == "dense" else 1.2,
                    color="black" if method == "dense" else colors[method])  # fmt: skip
        for t in targets:
            ax.axhline(t, color="grey", linestyle="--", linewidth=0.8)
        ax.set_xscale("log")
        if metric_sign(curves) > 0:
            ax.set_ylim(max(0.0, min(targets) - 8), 100)
            ax.set_ylabel("validation accuracy %")
        else:
            ax.set_ylim(min(targets) - 0.3, max(targets) + 1.5)
            ax.set_ylabel("validation loss (nats per token)")
        ax.set_xlabel(f"wall-clock seconds on {rate} links (steps x s/step)")
        ax.set_title(f"{curves['model']}, {curves['ranks']} ranks, {rate}")
        ax.grid(True, which="both", alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, fontsize=8, loc="lower center", ncol=min(7, len(labels)))
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    t = commands.add_parser("train", help="accuracy curves of every method and seed (real gloo ranks)")
    t.add_argument("--model", default="lenet", choices=["lenet", "mnist-mlp", "lm", "stdlib-lm"])
    t.add_argument("--methods", default=DEFAULT_TRAIN_METHODS)
    t.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    t.add_argument("--ranks", type=int, default=4)
    t.add_argument("--batch", type=int, default=32, help="images per rank per step (network.py's default)")
    t.add_argument("--steps", type=int, default=600, help="optimizer steps (600: the tables' setting)")
    t.add_argument("--eval-every", type=int, default=20)
    t.add_argument("--sync-every", type=int, default=10,
                   help="DiLoCo's H: inner steps per synchronisation (--eval-every a multiple of it)")  # fmt: skip
    t.add_argument("--lr", type=float, default=0.05)
    t.add_argument("--momentum", type=float, default=0.9)
    t.add_argument("--lr-warmup", type=int, default=0, help="steps of linear learning-rate warm-up from 0")
    t.add_argument("--lr-schedule", choices=["constant", "cosine"], default="constant",
                   help="after the warm-up: constant, or a cosine decay to a tenth at the last step")  # fmt: skip
    t.add_argument("--data-dir", default=str(DEFAULT_DATA))
    t.add_argument("--holdout", type=int, default=2000,
                   help="last images of t10k (lm: windows of the corpus) used for validation")  # fmt: skip
    t.add_argument("--timeout", type=float, default=600, help="process group timeout, seconds")
    t.add_argument("--json", required=True)
    r = commands.add_parser("report", help="combine curves with network.py's step times; tables and a PNG")
    r.add_argument("--curves", required=True, nargs="+", help="JSONs written by train (same setting)")
    r.add_argument("--network", help="the JSON written by network.py for the same model, batch and ranks")
    r.add_argument("--below", type=float, nargs="+", default=[0.5, 2.0],
                   help="targets: points below plain DDP's final accuracy with the same seed")  # fmt: skip
    r.add_argument("--tolerance", type=float, default=0.5, help="points of accuracy a method may lose")
    r.add_argument("--final-window", type=int, default=200,
                   help="final accuracy: mean of the evaluations in the last N steps (0: the last one)")  # fmt: skip
    r.add_argument("--loopback", action="store_true", help="also report the unshaped links ('none')")
    r.add_argument("--png")
    r.add_argument("--decisions-png", help="bytes per step against the step for every method with recorded phases")
    r.add_argument("--json")
    args = parser.parse_args(argv)
    if args.command == "train":
        if args.ranks < 2 or args.steps < 1 or args.eval_every < 1 or len(set(args.seeds)) != len(args.seeds):
            parser.error("--ranks must be >= 2, --steps and --eval-every >= 1, --seeds distinct")
        if args.model not in MODELS:
            parser.error(f"--model must be one of {list(MODELS)}")
        methods = [m for m in args.methods.split(",") if is_local_sgd(m)]  # compressed Adam's @F is a step
        intervals = {args.sync_every} | {h for m in methods if (h := sync_interval(m)[1]) is not None}
        if min(intervals) < 1 or any(args.eval_every % h or args.steps % h for h in intervals):
            parser.error(
                f"--sync-every and every DiLoCo method's @H must be >= 1 and divide --eval-every and --steps (it is "
                f"evaluated after a sync); got {sorted(intervals)}"
            )
        return train(args)
    if args.final_window < 0:
        parser.error(f"--final-window must be >= 0 steps, got {args.final_window}")
    return report(args)


if __name__ == "__main__":
    raise SystemExit(main())
