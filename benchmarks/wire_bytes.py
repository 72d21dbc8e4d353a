"""Bytes per rank per step of gTop-k against the allgather of Top-k sets, as counted by the comm layer.

Shi et al. (ICDCS 2019, Sec. IV) give gTop-k ``2k log2(P)`` words per worker against ``2k(P-1)``
for the allgather. This script measures it on real gloo ranks: one spawn of ``max(P)``
processes, one process group per world size, Top-k payloads at ``--density`` of two workloads
(ResNet-20's 269,722 parameters flattened into one vector, as in the authors' runs, and a
vector of one million elements), aggregated by ``GTopKAggregator`` and ``AllgatherAggregator``.
Every figure is read from ``Collectives.counter`` (bytes handed to, and received from,
collectives and point-to-point messages), never computed from a formula.

Note on what is counted: for an allgather the counter records the input tensor as sent and the
gathered output (``P`` rows) as received, so "received" is where its ``O(P)`` growth shows; gTop-k
sends and receives one message per butterfly round, ``log2(P)`` of them.

    python benchmarks/wire_bytes.py                       # P = 2, 4, 8
    python benchmarks/wire_bytes.py --world-sizes 2 3 4 8 --json out.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_gradcomp.core.comm import AllgatherAggregator, Collectives, Contribution
from lightning_gradcomp.core.comm.gtopk import GTopKAggregator
from lightning_gradcomp.core.compressors import TopKCompressor
from lightning_gradcomp.core.compressors.topk import k_for

#: ResNet-20 (CIFAR-10, He et al. 2016): conv and fc weights, fc bias, batch-norm weights and biases.
RESNET20_NUMEL = 432 + 6 * 2304 + 4608 + 5 * 9216 + 18432 + 5 * 36864 + 640 + 10 + 2 * (7 * 16 + 6 * 32 + 6 * 64)
WORKLOADS = {"resnet20-flat": RESNET20_NUMEL, "vector-1M": 1_000_000}


def _measure(collectives: Collectives, aggregator: object, numel: int, density: float, steps: int) -> dict:
    codec = TopKCompressor(density)
    generator = torch.Generator().manual_seed(collectives.rank)
    counter = collectives.counter
    counter.reset()
    for _ in range(steps):
        x = torch.randn(numel, generator=generator)
        aggregator.aggregate([Contribution(codec, codec.compress(x))], collectives)  # type: ignore[attr-defined]
    return {
        "bytes_sent": counter.bytes_sent / steps,
        "bytes_received": counter.bytes_received / steps,
        "messages": counter.calls / steps,
    }


def _worker(rank: int, world: int, sizes: list[int], density: float, steps: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{out}/store", rank=rank, world_size=world)
    results = {}
    for size in sizes:
        group = dist.new_group(list(range(size)))
        if rank >= size:
            continue
        for workload, numel in WORKLOADS.items():
            for name, aggregator in (("gtopk", GTopKAggregator()), ("allgather", AllgatherAggregator())):
                results[(size, workload, name)] = _measure(Collectives(group), aggregator, numel, density, steps)
    dist.barrier()
    dist.destroy_process_group()
    torch.save(results, Path(out) / f"{rank}.pt")


def run(sizes: list[int], density: float, steps: int) -> dict:
    """Spawn ``max(sizes)`` ranks and measure; returns the JSON document (the largest per-rank figures)."""
    world = max(sizes)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(_worker, args=(world, sizes, density, steps, out), nprocs=world, join=True)
        per_rank = [torch.load(Path(out) / f"{r}.pt") for r in range(world)]
    rows = []
    for size in sizes:
        for workload, numel in WORKLOADS.items():
            row = {"world_size": size, "log2_P": math.log2(size), "workload": workload, "numel": numel}
            row["k"] = k_for(numel, density)
            for name in ("gtopk", "allgather"):
                figures = [per_rank[r][(size, workload, name)] for r in range(size)]
                for key in ("bytes_sent", "bytes_received", "messages"):
                    row[f"{name}_{key}"] = max(f[key] for f in figures)
            rows.append(row)
    return {"benchmark": "wire_bytes", "density": density, "steps": steps, "torch": torch.__version__, "rows": rows}


def _table(doc: dict) -> str:
    lines = [
        f"bytes per rank per step (largest over ranks), Top-k at density {doc['density']}, counted by the comm layer",
        f"{'workload':>14} {'P':>3} {'log2P':>5} {'k':>5} | {'gtopk sent':>10} {'gtopk recv':>10} {'msgs':>4} | "
        f"{'allgather sent':>14} {'allgather recv':>14} {'msgs':>4} | {'recv ratio':>10}",
    ]
    for r in doc["rows"]:
        lines.append(
            f"{r['workload']:>14} {r['world_size']:>3} {r['log2_P']:>5.2f} {r['k']:>5} | "
            f"{r['gtopk_bytes_sent']:>10,.0f} {r['gtopk_bytes_received']:>10,.0f} {r['gtopk_messages']:>4.0f} | "
            f"{r['allgather_bytes_sent']:>14,.0f} {r['allgather_bytes_received']:>14,.0f} "
            f"{r['allgather_messages']:>4.0f} | {r['allgather_bytes_received'] / r['gtopk_bytes_received']:>9.2f}x"
        )
    lines.append("recv ratio: allgather bytes received / gtopk bytes received (gtopk ~ log2 P, allgather ~ P)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--density", type=float, default=0.001)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    args = parser.parse_args(argv)
    if any(p < 1 for p in args.world_sizes):
        parser.error(f"--world-sizes must be >= 1, got {args.world_sizes}")
    if args.steps < 1:
        parser.error(f"--steps must be >= 1, got {args.steps}")
    doc = run(sorted(set(args.world_sizes)), args.density, args.steps)
    print(_table(doc))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=2)
    return doc


if __name__ == "__main__":
    main()
