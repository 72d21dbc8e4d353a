"""How to gather every rank's payload bytes over gloo: its allgather, or one broadcast from each rank into its row.

The allgather aggregator gathers each rank's packed payload into a kept buffer of rows. Gloo's allgather writes a
flat temporary of the whole output and copies it out, so each call allocates two to three times the output (freed
again: the allocator keeps some of it from step to step). A broadcast from each rank into its own row of the
kept buffer allocates nothing, and this rank's row can be the payload itself. This script times both, in real
processes on loopback (one thread each, ``P`` ranks), for rows of 16 KiB to 12 MiB, and counts the bytes each call
allocates (torch's profiler). Both give the same rows (checked before timing).

    python benchmarks/gather.py --json benchmarks/results/gather_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.profiler import ProfilerActivity, profile

# torch 2.13 renamed all_gather_into_tensor (now deprecated) to all_gather_single.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

ROW_BYTES = (1 << 14, 1 << 16, 1 << 18, 1 << 20, 4 << 20, 12 << 20)


def _allocated_mib(fn: Callable[[], None]) -> float:
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return sum(max(0, e.cpu_memory_usage) for e in prof.events()) / 2**20


def _best_ms(fn: Callable[[], None], calls: int, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        dist.barrier()
        best = min(best, (time.perf_counter() - start) / calls)
    return 1e3 * best


def _allgather(gathered: torch.Tensor, mine: torch.Tensor) -> None:
    _all_gather_single(gathered, mine)


def _broadcasts(rows: list[torch.Tensor]) -> None:
    for work in [dist.broadcast(row, src=r, async_op=True) for r, row in enumerate(rows)]:
        work.wait()


def _worker(rank: int, world: int, store: str, repeats: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))  # fmt: skip
    rows = []
    for nbytes in ROW_BYTES:
        gathered = torch.zeros(world * nbytes, dtype=torch.uint8)
        gathered[rank * nbytes : (rank + 1) * nbytes].fill_(rank + 1)
        row_views = list(gathered.view(world, nbytes))
        row = {"world": world, "row_bytes": nbytes}
        for name, fn in (("allgather", partial(_allgather, gathered, row_views[rank])),
                         ("broadcasts", partial(_broadcasts, row_views))):  # fmt: skip
            for other in range(world):
                if other != rank:
                    row_views[other].zero_()
            fn()
            assert all(bool((row_views[r] == r + 1).all()) for r in range(world)), f"{name} gathered wrong rows"
            row[f"{name}_allocated_mib"] = _allocated_mib(fn)
            row[f"{name}_ms"] = _best_ms(fn, max(3, min(50, (64 << 20) // (world * nbytes))), repeats)
        rows.append(row)
    if rank == 0:
        Path(out).write_text(json.dumps(rows))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 3, 4])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    os.environ.update(OMP_NUM_THREADS="1")
    results = []
    for world in args.worlds:
        with tempfile.TemporaryDirectory() as folder:
            out = str(Path(folder) / "rows.json")
            mp.spawn(_worker, args=(world, str(Path(folder) / "store"), args.repeats, out), nprocs=world)
            results += json.loads(Path(out).read_text())
    print(f"{'ranks':>5}{'row KiB':>9}{'allgather ms':>14}{'broadcasts ms':>15}{'ratio':>7}{'allocated MiB':>20}")
    for r in results:
        ratio = r["broadcasts_ms"] / r["allgather_ms"]
        allocated = f"{r['allgather_allocated_mib']:.2f} / {r['broadcasts_allocated_mib']:.2f}"
        print(f"{r['world']:>5}{r['row_bytes'] // 1024:>9}{r['allgather_ms']:>14.3f}{r['broadcasts_ms']:>15.3f}"
              f"{ratio:>7.2f}{allocated:>20}")  # fmt: skip
    if args.json:
        setup = {"torch": torch.__version__, "machine": platform.processor() or platform.machine(), **vars(args)}
        args.json.write_text(json.dumps({"setup": setup | {"json": str(args.json)}, "rows": results}, indent=1))


if __name__ == "__main__":
    main()
