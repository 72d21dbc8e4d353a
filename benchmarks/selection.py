"""Time Top-k selection: exact ``torch.topk``, Gaussian_k and DGC sampling, against a plain copy of the tensor.

Shi et al. (2019, Sec. 5) motivate Gaussian_k by the cost of exact Top-k; this script measures
that cost on this machine. For each size it times, on the same tensor, the selection of each
method (indices only: what ``compress`` needs before gathering values) and ``x.clone()``, and
prints each as a ratio to ``torch.topk`` (above 1: faster) and to the copy (the memory-bound
floor: any selection reads the tensor at least once). Timings are the best of ``--repeats``
runs (the least disturbed by other processes on a shared machine), medians are in the JSON.

    python benchmarks/selection.py                 # 1M, 10M, 25M elements, density 0.001
    python benchmarks/selection.py --json out.json --sizes 1000000 10000000
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable

import torch

from lightning_gradcomp.core.compressors import TopKCompressor
from lightning_gradcomp.core.compressors.dgc import DGCCompressor
from lightning_gradcomp.core.compressors.gaussiank import GaussianKCompressor
from lightning_gradcomp.core.compressors.topk import k_for


def _times(fn: Callable[[], object], repeats: int) -> list[float]:
    fn()  # warm-up: first-call allocations and dispatch
    out = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return out


def _data(kind: str, numel: int, generator: torch.Generator) -> torch.Tensor:
    if kind == "normal":
        return torch.randn(numel, generator=generator)
    # Student-t with 3 degrees of freedom: heavier tails than the Gaussian model assumes
    chi2 = torch.randn(3, numel, generator=generator).square_().sum(0).div_(3)
    return torch.randn(numel, generator=generator).div_(chi2.sqrt_())


def run(sizes: list[int], density: float, repeats: int, data: str, seed: int) -> dict:
    """Time every method at every size; returns the JSON document."""
    generator = torch.Generator().manual_seed(seed)
    topk, gaussiank, dgc = TopKCompressor(density), GaussianKCompressor(density), DGCCompressor(density)
    dgc_generator = torch.Generator().manual_seed(seed + 1)
    rows = []
    for numel in sizes:
        x = _data(data, numel, generator)
        methods: dict[str, Callable[[], torch.Tensor]] = {
            "copy": x.clone,
            "torch.topk": lambda x=x: topk.select(x),
            "gaussiank": lambda x=x: gaussiank.select(x),
            "dgc": lambda x=x: dgc.select(x, dgc_generator),
        }
        timings = {name: _times(fn, repeats) for name, fn in methods.items()}
        best = {name: min(t) for name, t in timings.items()}
        k = k_for(numel, density)
        for name in methods:
            rows.append(
                {
                    "numel": numel,
                    "k": k,
                    "method": name,
                    "selected": None if name == "copy" else int(methods[name]().numel()),
                    "best_ms": 1e3 * best[name],
                    "median_ms": 1e3 * statistics.median(timings[name]),
                    "speedup_vs_topk": best["torch.topk"] / best[name],
                    "time_vs_copy": best[name] / best["copy"],
                }
            )
        del x
    return {
        "benchmark": "selection",
        "density": density,
        "data": data,
        "repeats": repeats,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "machine": platform.processor() or platform.machine(),
        "rows": rows,
    }


def _table(doc: dict) -> str:
    lines = [
        f"selection at density {doc['density']} on {doc['data']} data, best of {doc['repeats']}, "
        f"{doc['threads']} thread(s), torch {doc['torch']}",
        f"{'numel':>11} {'method':>11} {'selected':>9} {'best ms':>9} {'median ms':>10} {'vs topk':>8} {'vs copy':>8}",
    ]
    for r in doc["rows"]:
        selected = "" if r["selected"] is None else f"{r['selected'] / r['k']:.2f}k"
        lines.append(
            f"{r['numel']:>11,} {r['method']:>11} {selected:>9} {r['best_ms']:>9.2f} {r['median_ms']:>10.2f} "
            f"{r['speedup_vs_topk']:>7.1f}x {r['time_vs_copy']:>7.2f}x"
        )
    lines.append("vs topk: torch.topk time / method time (higher is faster); vs copy: method time / x.clone() time")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1_000_000, 10_000_000, 25_000_000])
    parser.add_argument("--density", type=float, default=0.001)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--data", choices=["normal", "student_t"], default="normal")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    if any(n < 1 for n in args.sizes):
        parser.error(f"--sizes must be positive, got {args.sizes}")
    torch.set_num_threads(args.threads)
    doc = run(args.sizes, args.density, args.repeats, args.data, args.seed)
    print(_table(doc))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=2)
    return doc


if __name__ == "__main__":
    main()
