"""The one-process DDP step with each named strategy against plain DDP, on one device: the codecs' and the hook's
cost with no network in the way (a 1-rank world's collectives are copies).

A 25.2M-parameter MLP (4096-wide layers, the CPU benchmarks' large model) at batch 64; each strategy compresses from
its second step (warm-ups and adaptive schedules off), and the time is the median of ``--steps`` steps after
``--warmup`` (CUDA events around forward, backward and the optimizer's step), as a ratio to plain DDP measured in the
same process.

    PYTHONPATH=. python benchmarks/gpu/ddp_step.py --out results/ [--device cuda] [--presets ddp_topk ...]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel

from lightning_gradcomp import NAMED_STRATEGIES, gradcomp_comm_hook, make_hook
from lightning_gradcomp.core.host_waits import host_waits

#: PyTorch's own DDP hooks, the peers of the 16-bit wires and PowerSGD (rank 4, as the ``ddp_powersgd`` preset).
TORCH_HOOKS = {
    "torch:fp16_compress_hook": lambda: (None, default_hooks.fp16_compress_hook),
    "torch:bf16_compress_hook": lambda: (None, default_hooks.bf16_compress_hook),
    "torch:powerSGD_hook": lambda: (
        powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=4, start_powerSGD_iter=2),
        powerSGD_hook.powerSGD_hook,
    ),
}


DEFAULT_PRESETS = [
    "ddp_fp16", "ddp_bf16", "ddp_topk", "ddp_gtopk", "ddp_gaussiank", "ddp_terngrad", "ddp_diana", "ddp_efsign",
    "ddp_atomo", "ddp_powersgd", "ddp_int8", *TORCH_HOOKS,
]  # fmt: skip


def model(width: int = 4096) -> nn.Module:
    return nn.Sequential(nn.Linear(1024, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 1024))


def step_ms(preset: str | None, device: torch.device, steps: int, warmup: int) -> tuple[float, int | None]:
    """The median step in milliseconds, and how many times the step after the warm-up made the host wait for the
    device (``torch.cuda.set_sync_debug_mode``'s warnings, from the backward thread too; ``None`` off CUDA)."""
    torch.manual_seed(0)
    net = model().to(device)
    ddp = DistributedDataParallel(net, device_ids=[device] if device.type == "cuda" else None)
    if preset in TORCH_HOOKS:
        state, hook = TORCH_HOOKS[preset]()
        ddp.register_comm_hook(state, hook)
    elif preset is not None:
        overrides = {"warmup_steps": 1, "min_compress_numel": 100}
        if "adaptive" in NAMED_STRATEGIES[preset][1]:
            overrides["adaptive"] = "none"
        ddp.register_comm_hook(make_hook(ddp, preset, **overrides), gradcomp_comm_hook)
    optimizer = torch.optim.SGD(net.parameters(), lr=1e-3)
    x, y = torch.randn(64, 1024, device=device), torch.randn(64, 1024, device=device)
    times, syncs = [], None

    def one_step() -> None:
        optimizer.zero_grad()
        nn.functional.mse_loss(ddp(x), y).backward()
        optimizer.step()

    for step in range(warmup + steps + 1):
        if step == warmup + steps:  # one more step, counting the host's waits (None off CUDA)
            syncs = host_waits(one_step, device)
            break
        began = time.perf_counter()
        if device.type == "cuda":
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        one_step()
        if device.type == "cuda":
            stop.record()
            stop.synchronize()
            elapsed = start.elapsed_time(stop)
        else:
            elapsed = (time.perf_counter() - began) * 1e3
        if warmup <= step < warmup + steps:
            times.append(elapsed)
    return statistics.median(times), syncs


def write(result: dict, path: Path, steps: int) -> None:
    """``result`` as JSON at ``path`` and as a Markdown table beside it."""
    path.write_text(json.dumps(result, indent=1))
    lines = [f"# One-process DDP step on {result['device']} (torch {result['torch']}), 25.2M-parameter MLP, batch 64 "
             f"(median of {steps})", "", "| strategy | step ms | ratio to plain DDP | host syncs in a step |",
             "|---|---|---|---|"]  # fmt: skip
    for r in result["rows"]:
        if "error" in r:
            lines.append(f"| {r['preset']} | {r['error']} | | |")
        else:
            lines.append(f"| {r['preset']} | {r['step_ms']:.2f} | {r['ratio']:.2f} | {r['host_syncs']} |")
    path.with_suffix(".md").write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--device", default="cuda")
    choices = [*sorted(NAMED_STRATEGIES), *TORCH_HOOKS]
    parser.add_argument("--presets", nargs="+", default=DEFAULT_PRESETS, choices=choices)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    args = parser.parse_args(argv)
    if args.steps < 1 or args.warmup < 2:
        parser.error(f"--steps must be >= 1 and --warmup >= 2 (compression starts at step 2), got {args}")
    device = torch.device(args.device)
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as directory:
        store = dist.FileStore(os.path.join(directory, "store"), 1)
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, store=store, rank=0, world_size=1, timeout=timedelta(seconds=300))
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        rows: list[dict] = []
        result = {"device": name, "torch": torch.__version__, "rows": rows}
        try:
            plain, syncs = step_ms(None, device, args.steps, args.warmup)
            rows.append({"preset": "plain DDP", "step_ms": plain, "ratio": 1.0, "host_syncs": syncs})
            for preset in args.presets:
                try:
                    ms, syncs = step_ms(preset, device, args.steps, args.warmup)
                    rows.append({"preset": preset, "step_ms": ms, "ratio": ms / plain, "host_syncs": syncs})
                except Exception as error:  # a strategy that fails is a row, not the end
                    rows.append({"preset": preset, "error": repr(error).splitlines()[0][:200]})
                write(result, args.out / f"ddp_step_{device.type}.json", args.steps)  # survives a timeout
                print(json.dumps(rows[-1]), flush=True)
        finally:
            dist.destroy_process_group()
    print((args.out / f"ddp_step_{device.type}.md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
