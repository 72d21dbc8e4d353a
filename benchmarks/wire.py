"""Bytes per rank per step of every named strategy and the QSGD and random-k variants, as the comm layer counts them.

For P = 2, 4, 8 real gloo ranks and the parameter shapes of ResNet-20 and AlexNet (CIFAR
variants), each named strategy's hook is built exactly as ``GradCompStrategy`` builds it
(``strategy.build_hook``) on a DistributedDataParallel model; a few backward passes later the
hook's ``StepStats`` give the bytes this rank handed to collectives (sent) and got back
(received), for the preset after its warm-ups (dense first steps, density warm-up). Next to
them: the dense figure (what plain DDP hands to allreduce) and the information limit of what
was sent:

* sparse payloads: ``k * (32 + log2 d)`` bits per unit of ``d`` elements with ``k`` entries;
* scaled signs: one bit per element plus one fp32 scale per unit;
* ternary codes (TernGrad, the quantizer): ``log2(3)`` bits per element plus one fp32 scale per
  unit (per block for the quantizer); QSGD's levels: ``log2(2s + 1)`` bits per element plus one
  fp32 norm per block;
* ATOMO and PowerSGD: their payloads (floats have no smaller description here);
* parameters left dense: 32 bits per element.

    python benchmarks/wire.py --json benchmarks/results/wire_resnet20_alexnet.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import tempfile
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from methods import AFTER_WARMUPS, UNNAMED_METHODS, strategy_arguments
from torch.nn.parallel import DistributedDataParallel

from lightning_gradcomp import NAMED_STRATEGIES, GradCompStrategy
from lightning_gradcomp.core.stats import StepStats
from lightning_gradcomp.ddp.hook import gradcomp_comm_hook
from lightning_gradcomp.examples.models import AlexNet, ResNet20

MODELS = {"resnet20": ResNet20, "alexnet": AlexNet}
#: ATOMO's exact SVD of AlexNet's 4096 x 4096 layer takes tens of seconds per rank on a CPU.
SKIP = {("alexnet", "ddp_atomo"): "SVD of 4096x4096 too slow on CPU ranks"}


def information_limit_bits(stats: StepStats, strategy: GradCompStrategy) -> float:
    """The information content of what this rank sent in ``stats`` (see the module docstring)."""
    name = strategy.compressor.name
    bits = 32.0 * (stats.numel - stats.numel_compressed)
    for layer in stats.layers.values():
        if layer.selected is not None:
            bits += layer.selected * (32 + math.log2(layer.numel))
        elif name == "terngrad":
            bits += layer.numel * math.log2(3) + 32
        elif name == "sign":
            bits += layer.numel + 32
        elif name in ("quantizer", "qsgd"):
            block = strategy.compressor.block_size or layer.numel
            symbols = 2 * strategy.compressor.levels + 1 if name == "qsgd" else 3
            bits += layer.numel * math.log2(symbols) + 32 * math.ceil(layer.numel / block)
        else:
            bits += 8 * layer.payload_bytes
    return bits


def _measure(model_name: str, strategy_name: str, world: int, steps: int) -> dict:
    torch.manual_seed(0)
    model = MODELS[model_name]()
    ddp = DistributedDataParallel(model)
    strategy = None
    if strategy_name != "ddp":
        # the preset after its warm-ups (dense first steps, density warm-up): what its compressed steps send
        strategy = GradCompStrategy(**{**strategy_arguments(strategy_name), **AFTER_WARMUPS})
        hook = strategy.build_hook(model)
        hook.track_layers = True
        ddp.register_comm_hook(hook, gradcomp_comm_hook)
    x, y = torch.randn(2, 3, 32, 32), torch.randint(0, 10, (2,))
    for _ in range(steps + strategy.warmup_steps if strategy else 1):
        model.zero_grad()
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
    dense = sum(p.numel() * p.element_size() for p in model.parameters())
    if strategy is None:
        return {"sent": dense, "received": dense, "dense": dense, "limit": dense}
    compressed = [s for s in hook.history if not s.warmup]
    mean = lambda values: sum(values) / len(values)  # noqa: E731
    return {
        "sent": mean([s.bytes_sent for s in compressed]),
        "received": mean([s.bytes_received for s in compressed]),
        "dense": mean([s.dense_bytes for s in compressed]),
        "limit": mean([information_limit_bits(s, strategy) / 8 for s in compressed]),
        "aggregator": hook.aggregator.name,
    }


def _worker(rank: int, world: int, strategies: list[str], models: list[str], steps: int, out: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{out}/store", rank=rank, world_size=world, timeout=timedelta(minutes=10)
    )
    rows = []
    for model_name in models:
        for strategy_name in strategies:
            if (model_name, strategy_name) in SKIP:
                rows.append({"model": model_name, "strategy": strategy_name, "note": SKIP[model_name, strategy_name]})
                continue
            row = _measure(model_name, strategy_name, world, steps)
            rows.append({"model": model_name, "strategy": strategy_name, "note": "", **row})
    if rank == 0:
        Path(out, "rows.json").write_text(json.dumps(rows))
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--strategies", nargs="+", default=["ddp", *sorted(NAMED_STRATEGIES), *UNNAMED_METHODS])
    parser.add_argument("--steps", type=int, default=2, help="compressed steps averaged per strategy")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)

    from rich.console import Console
    from rich.table import Table

    results = {}
    for world in args.world_sizes:
        with tempfile.TemporaryDirectory() as out:
            mp.spawn(_worker, args=(world, args.strategies, args.models, args.steps, out), nprocs=world, join=True)
            results[world] = json.loads(Path(out, "rows.json").read_text())
    for model_name in args.models:
        table = Table(title=f"{model_name}: bytes per rank per step (sent / received by this rank), by world size")
        table.add_column("strategy")
        for world in args.world_sizes:
            for column in ("sent", "received", "ratio", "limit"):
                table.add_column(f"P={world} {column}", justify="right")
        for strategy_name in args.strategies:
            cells = []
            for world in args.world_sizes:
                row = next(r for r in results[world] if r["model"] == model_name and r["strategy"] == strategy_name)
                if row["note"]:
                    cells += ["-", "-", "-", row["note"][:20]]
                    continue
                cells += [f"{row['sent']:,.0f}", f"{row['received']:,.0f}", f"{row['dense'] / row['sent']:.1f}x",
                          f"{row['limit']:,.0f}"]  # fmt: skip
            table.add_row(strategy_name, *cells)
        Console().print(table)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({str(k): v for k, v in results.items()}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
