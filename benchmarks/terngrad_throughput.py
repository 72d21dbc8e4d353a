"""TernGrad ternarize + pack throughput, side by side with a plain copy of the same tensor.

Target: at 10M elements, ``compress(x).to_bytes()`` (clip statistics, Bernoulli draws, 2-bit
packing) takes at most 8x the time of ``x.clone()``. Every repeat times each operation once, in
turn, so load on a shared machine hits all of them alike; the table reports medians.

``x.clone()`` allocates: at 10M elements (40 MB) its time swings by 10x with how the kernel backs
fresh memory (huge pages or not), and the compressor's temporaries pay the same price. So the
table also gives the ratio to ``out.copy_(x)`` into a preallocated buffer, the pure bandwidth cost.

    python benchmarks/terngrad_throughput.py [--sizes 1000000 10000000] [--repeats 9] [--threads 1] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch

from lightning_gradcomp.core.compressors.quantizer import BlockQuantizer
from lightning_gradcomp.core.compressors.terngrad import TernGradCompressor

TARGET_RATIO = 8.0
CLONE = "copy (x.clone())"
COPY_INTO = "copy into a preallocated buffer"


def operations(x: torch.Tensor, generator: torch.Generator) -> dict[str, Callable[[], object]]:
    """The timed operations on ``x``: the copy baseline first."""
    terngrad, quantizer = TernGradCompressor(), BlockQuantizer()
    payload = terngrad.compress(x, generator)
    wire = payload.to_bytes()
    shared = terngrad.local_scale(x)
    out = torch.empty_like(x)
    return {
        CLONE: x.clone,
        COPY_INTO: lambda: out.copy_(x),
        "torch.rand alone (one uniform per element)": lambda: torch.rand(x.numel(), generator=generator),
        "random bytes alone (one per element, the draws the encoder makes)": lambda: torch.empty(
            -(-x.numel() // 8), dtype=torch.int64
        ).random_(-(2**63), None, generator=generator),
        "terngrad ternarize": lambda: terngrad.compress(x, generator),
        "terngrad ternarize+pack": lambda: terngrad.compress(x, generator).to_bytes(),
        "terngrad shared-scale ternarize+pack": lambda: terngrad.compress(x, generator, shared).to_bytes(),
        "terngrad unpack+decode": lambda: terngrad.decompress(terngrad.unpack(wire, x.shape, x.dtype)),
        "quantizer (inf, 1024) quantize+pack": lambda: quantizer.compress(x, generator).to_bytes(),
    }


def measure(numel: int, repeats: int) -> list[dict[str, float | int | str]]:
    """Median seconds of each operation on a random fp32 tensor of ``numel`` elements."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(numel, generator=generator)
    ops = operations(x, generator)
    for op in ops.values():  # warm-up: allocator, lazy initialisation
        op()
    times: dict[str, list[float]] = {name: [] for name in ops}
    for _ in range(repeats):
        for name, op in ops.items():
            start = time.perf_counter()
            op()
            times[name].append(time.perf_counter() - start)
    clone, copy_into = statistics.median(times[CLONE]), statistics.median(times[COPY_INTO])
    rows = []
    for name, samples in times.items():
        seconds = statistics.median(samples)
        rows.append(
            {
                "numel": numel,
                "operation": name,
                "median_ms": seconds * 1e3,
                "gb_per_s": numel * 4 / seconds / 1e9,
                "ratio_to_clone": seconds / clone,
                "ratio_to_copy_into": seconds / copy_into,
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1_000_000, 10_000_000])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = [row for numel in args.sizes for row in measure(numel, args.repeats)]
    summary = {
        "threads": args.threads,
        "repeats": args.repeats,
        "torch": torch.__version__,
        "target_ratio_at_largest": TARGET_RATIO,
        "rows": rows,
    }
    largest = max(args.sizes)
    key = next(r for r in rows if r["numel"] == largest and r["operation"] == "terngrad ternarize+pack")
    ratio = key["ratio_to_clone"]
    summary["ternarize_pack_ratio_to_clone_at_largest"] = ratio
    summary["ternarize_pack_ratio_to_copy_into_at_largest"] = key["ratio_to_copy_into"]
    summary["meets_target"] = ratio <= TARGET_RATIO
    if args.json:
        print(json.dumps(summary, indent=2))
        return
    print(f"torch {torch.__version__}, {args.threads} thread(s), median of {args.repeats} repeats, fp32 input")
    print(f"{'numel':>10}  {'operation':<38} {'median ms':>10} {'GB/s':>7} {'x clone':>8} {'x copy_':>8}")
    for r in rows:
        print(
            f"{r['numel']:>10}  {r['operation']:<38} {r['median_ms']:>10.2f} {r['gb_per_s']:>7.2f} "
            f"{r['ratio_to_clone']:>8.2f} {r['ratio_to_copy_into']:>8.2f}"
        )
    verdict = "meets" if summary["meets_target"] else "misses"
    print(
        f"ternarize+pack at {largest}: {ratio:.2f}x x.clone() ({verdict} the {TARGET_RATIO:g}x target), "
        f"{key['ratio_to_copy_into']:.2f}x a copy into a preallocated buffer"
    )


if __name__ == "__main__":
    main()
