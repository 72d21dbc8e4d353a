"""What a compressed step costs next to plain DDP's, on a link that is not slow: the hook's own overhead.

Two ranks over gloo on loopback, one thread each, train the same model on the same batches with
plain DDP, PyTorch's own ``fp16_compress_hook`` and ``powerSGD_hook`` (rank 4, compressed from
step 2; the fp16 hook registered as it is, PowerSGD's completed bucket by bucket, see
``methods.attach``), the dense baseline through the hook (``ddp_gradcomp_dense``) and every named
strategy, one after the other in ONE launch, so the ratios are measured side by side. Each
strategy runs with the hook ``GradCompStrategy`` installs for it (``build_hook``) on a hand-made
DDP, after its warm-ups (compressed from step 2, at its final density: a preset's dense first
steps are plain DDP's; the steady state is what this measures). Reported
per method: ms/step (best of ``--repeats`` timed runs of ``--steps`` steps, after warm-up), the
ratio to plain DDP (best run against best run; with ``--interleave``, where every method runs once per
turn, the median over the turns of each turn's ratio, and their range), the hook's own breakdown
(``StepStats``: compress, communicate, decompress; ms/step, rank 0) and each rank's peak resident
memory while the method ran (memory freed by the methods before it is handed back to the system
first, ``malloc_trim``).

    python benchmarks/overhead.py --model mlp --model resnet20 --json benchmarks/results/overhead_mlp_resnet20.json
    python benchmarks/overhead.py --model mlp25m --steps 5 --repeats 1
    python benchmarks/overhead.py --model mlp25m --isolate --methods ddp,ddp_topk   # peak memory, a process pair each
    python benchmarks/overhead.py --model mlp25m --interleave --repeats 5   # time ratios, every method in turns
    python benchmarks/overhead.py --device cuda --ranks 1 --model mlp25m --interleave   # a GPU per rank, NCCL
    python benchmarks/overhead.py --model mlp25m --interleave --methods ddp,ddp_terngrad,ddp_terngrad+eager

A method ``NAME+eager`` is NAME with its codec kernels run eagerly, ``NAME+compiled`` with them compiled by
``torch.compile`` in the training process, beside NAME itself, whose kernels run compiled as the library ships them (on
the CPU built ahead of time in a child process and loaded; the first steps, untimed, build or load them).

With ``--device cuda`` each rank trains on its own GPU over NCCL (``--ranks`` at most the GPUs present; one GPU:
``--ranks 1``, where the hook's compression still runs in full and the collectives have no peer), every step is
timed to its end on the device, and the peak is the device memory allocated (``torch.cuda.max_memory_allocated``)
instead of the process's RSS.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).resolve().parent))

from machine import describe
from methods import AFTER_WARMUPS, OURS, UNNAMED_METHODS, attach
from workloads import build_model

from lightning_gradcomp.core.fused import set_codec_mode
from lightning_gradcomp.examples.models import ResNet20

#: model name -> (builder, input shape, classes, batch size)
MODELS = {
    "mlp": (lambda: build_model("mlp", 512), (3, 32, 32), 10, 32),
    "lenet": (lambda: build_model("lenet"), (1, 28, 28), 10, 32),
    "resnet20": (ResNet20, (3, 32, 32), 10, 32),
    "mlp25m": (
        lambda: nn.Sequential(nn.Linear(4096, 4096), nn.ReLU(), nn.Linear(4096, 2048), nn.ReLU(), nn.Linear(2048, 10)),
        (4096,),
        10,
        16,
    ),
}
METHODS = ("ddp", "fp16", "powersgd", *OURS, *UNNAMED_METHODS)


def _kib(field: str) -> int:
    return int(re.search(rf"{field}:\s+(\d+)", Path("/proc/self/status").read_text()).group(1))


@dataclass
class _Trial:
    """One method's DDP on one model, warmed up and ready to step; ``runs``: its timed runs (s/step), in order."""

    method: str
    hook: object
    step: Callable[[], None]
    runs: list[float] = field(default_factory=list)

    @property
    def best(self) -> float:
        return min(self.runs)


def _device(args: argparse.Namespace, rank: int) -> torch.device:
    return torch.device("cuda", rank) if args.device == "cuda" else torch.device("cpu")


#: A method named ``NAME+eager`` runs NAME with the codec kernels eager (``set_codec_mode``), ``NAME+compiled`` with
#: them compiled by ``torch.compile`` in the process, beside NAME as it ships (``auto``: on the CPU, built ahead).
CODEC_SUFFIXES = {"+eager": "eager", "+compiled": "compiled"}


def _codecs_of(method: str) -> tuple[str, str]:
    """The method's name and the codec mode its suffix asks for (``auto`` without one)."""
    for suffix, mode in CODEC_SUFFIXES.items():
        if method.endswith(suffix):
            return method.removesuffix(suffix), mode
    return method, "auto"


def _prepare(method: str, model_name: str, args: argparse.Namespace, rank: int) -> _Trial:
    build, shape, classes, batch = MODELS[model_name]
    name, codecs = _codecs_of(method)
    torch.manual_seed(0)
    device = _device(args, rank)
    model = build().to(device)
    ddp = DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None)
    # PyTorch's hooks as they are (overlapping the backward pass); ours after their warm-ups
    hook = None if name == "ddp" else attach(name, ddp, model, overrides=AFTER_WARMUPS, serial=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    gen = torch.Generator().manual_seed(1000 + rank)
    x = torch.randn(batch, *shape, generator=gen).to(device)
    y = torch.randint(0, classes, (batch,), generator=gen).to(device)

    def step() -> None:
        set_codec_mode(codecs)  # every trial its own: interleaved trials share the process
        optimizer.zero_grad()
        nn.functional.cross_entropy(ddp(x), y).backward()
        optimizer.step()

    for _ in range(args.warmup):
        step()
    return _Trial(method, hook, step)


def _time(trial: _Trial, steps: int) -> None:
    """Time ``steps`` steps between barriers (every rank starts and ends together) and record the run."""
    _synchronize()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(steps):
        trial.step()
    _synchronize()  # a GPU step ends when its kernels do
    dist.barrier()
    trial.runs.append((time.perf_counter() - start) / steps)


def _synchronize() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _row(trial: _Trial, args: argparse.Namespace, peak_rss_mib: float | None) -> dict:
    row = {
        "method": trial.method,
        "ms_per_step": 1e3 * trial.best,
        "runs_ms": [1e3 * run for run in trial.runs],
        "peak_rss_mib": peak_rss_mib,
    }
    hook = trial.hook
    if hook is not None:
        timed = [s for s in hook.history if not s.warmup][-args.steps * args.repeats :]
        for part in ("compress", "communicate", "decompress"):
            row[part] = 1e3 * sum(getattr(s, f"seconds_{part}") for s in timed) / max(1, len(timed))
        row["bytes_sent"] = sum(s.bytes_sent for s in timed) / max(1, len(timed))
        row["collectives"] = sum(s.collectives for s in timed) / max(1, len(timed))
        # what the method must keep (residuals, shifts, warm starts) and what the hook keeps to work in
        state = [*hook.memory.state_dict().values(), *hook.warm_starts.state_dict().values()]
        row["state_mib"] = sum(t.numel() * t.element_size() for t in state) / 2**20
        row["buffers_mib"] = hook.workspace.nbytes / 2**20
    return row


def _run_method(method: str, model_name: str, args: argparse.Namespace, rank: int) -> dict:
    """One method alone: its timed runs back to back, and the peak RSS it reached."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # return what earlier methods freed to the system...
    Path("/proc/self/clear_refs").write_text("5")  # ...and count this method's peak only
    if args.device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    trial = _prepare(method, model_name, args, rank)
    for _ in range(args.repeats):
        _time(trial, args.steps)
    if args.device == "cuda":
        return _row(trial, args, torch.cuda.max_memory_allocated() / 2**20)
    return _row(trial, args, _kib("VmHWM") / 1024)


def _run_interleaved(methods: list[str], model_name: str, args: argparse.Namespace, rank: int) -> list[dict]:
    """Every method at once, timed in turns (one run of each per repeat): a slow spell of the machine falls on
    every method alike, so the ratios hold within the launch. Peak memory then belongs to no one method."""
    trials = [_prepare(method, model_name, args, rank) for method in methods]
    for _ in range(args.repeats):
        for trial in trials:
            _time(trial, args.steps)
    return [_row(trial, args, None) for trial in trials]


def _worker(rank: int, world: int, args: argparse.Namespace, store: str, out: str) -> None:
    torch.set_num_threads(1)
    if args.device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group(
        "nccl" if args.device == "cuda" else "gloo",
        init_method=f"file://{store}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=600),
    )
    results = {}
    methods = args.methods.split(",")
    for model_name in args.model:
        if args.interleave:
            rows = _run_interleaved(methods, model_name, args, rank)
        else:
            rows = [_run_method(method, model_name, args, rank) for method in methods]
        if rank == 0:
            for row in rows:
                print(f"{model_name} {row['method']}: {row['ms_per_step']:.1f} ms/step", file=sys.stderr, flush=True)
        results[model_name] = rows
    torch.save(results, Path(out) / f"{rank}.pt")
    dist.destroy_process_group()


def _ratios(row: dict, base: dict, paired: bool) -> tuple[float, str]:
    """The ratio to plain DDP and its spread: with runs taken in turns (``paired``), the median over the turns of
    each turn's ratio (a slow turn slows both) and their range; else best against best."""
    if not paired:
        return row["ms_per_step"] / base["ms_per_step"], ""
    turns = [run / ddp for run, ddp in zip(row["runs_ms"], base["runs_ms"], strict=True)]
    return statistics.median(turns), f"{min(turns):.2f}-{max(turns):.2f}"


def _table(model_name: str, ranks: list[list[dict]], paired: bool, peak: str = "peak RSS") -> str:
    rows = ranks[0]
    lines = [
        f"\n{model_name}: ms/step (best run), x plain DDP ("
        + ("median over the turns of each turn's ratio, and their range" if paired else "best run against best run")
        + "), the hook's breakdown on rank 0 (ms/step), the method's state and the hook's kept buffers on rank 0"
        f" (MiB), {peak} per rank (MiB)",
        f"{'method':<20}{'ms/step':>9}{'x DDP':>7}{'range':>11}{'compress':>10}{'communicate':>13}{'decompress':>12}"
        f"{'collectives':>13}{'state':>8}{'buffers':>9}{peak:>18}",
    ]
    for i, r in enumerate(rows):
        ratio, spread = _ratios(r, rows[0], paired)
        peaks = "/".join(
            f"{rank_rows[i]['peak_rss_mib']:.0f}" if rank_rows[i]["peak_rss_mib"] is not None else "-"
            for rank_rows in ranks
        )
        parts = "".join(f"{r[p]:>{w}.1f}" if p in r else f"{'':>{w}}" for p, w in
                        (("compress", 10), ("communicate", 13), ("decompress", 12), ("collectives", 13),
                         ("state_mib", 8), ("buffers_mib", 9)))  # fmt: skip
        lines.append(f"{r['method']:<20}{r['ms_per_step']:>9.1f}{ratio:>7.2f}{spread:>11}{parts}{peaks:>18}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", action="append", choices=sorted(MODELS), help="repeatable (default: mlp)")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--isolate",
        action="store_true",
        help="one fresh process pair per method: its peak RSS owes nothing to what earlier methods allocated",
    )
    parser.add_argument(
        "--interleave",
        action="store_true",
        help="every method's model at once, timed in turns: ratios that a slow spell of the machine cannot bend "
        "(no peak RSS per method)",
    )
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cuda: a GPU per rank, over NCCL")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda needs a CUDA device; none is present")
    if args.device == "cuda" and args.ranks > torch.cuda.device_count():
        parser.error(f"--device cuda runs a GPU per rank: --ranks {args.ranks} > {torch.cuda.device_count()} GPUs")
    if args.interleave and args.isolate:
        parser.error("--interleave times every method in one launch; --isolate gives each its own")
    if args.methods.split(",")[0] != "ddp":
        parser.error("--methods must start with ddp: every ratio is to plain DDP")
    args.model = args.model or ["mlp"]
    os.environ.update(OMP_NUM_THREADS="1")
    launches = [[method] for method in args.methods.split(",")] if args.isolate else [args.methods.split(",")]
    ranks: list[dict[str, list[dict]]] = [{model: [] for model in args.model} for _ in range(args.ranks)]
    for methods in launches:
        launch = argparse.Namespace(**{**vars(args), "methods": ",".join(methods)})
        with tempfile.TemporaryDirectory() as out:
            mp.spawn(_worker, args=(args.ranks, launch, str(Path(out) / "store"), out), nprocs=args.ranks)
            for rank, rows in enumerate(
                torch.load(Path(out) / f"{r}.pt", weights_only=True) for r in range(args.ranks)
            ):
                for model in args.model:
                    ranks[rank][model] += rows[model]
    for model_name in args.model:
        peak = "peak device" if args.device == "cuda" else "peak RSS"
        print(_table(model_name, [r[model_name] for r in ranks], args.interleave, peak))
    if args.json:
        setup = vars(args) | {"json": str(args.json), "machine": describe(args.device)}
        args.json.write_text(json.dumps({"setup": setup, "ranks": ranks}, indent=1))


if __name__ == "__main__":
    main()
