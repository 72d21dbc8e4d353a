"""The kernel-level costs behind issue 32's changes, on one CPU thread: why the hook keeps its buffers and streams.

Each line times two ways of doing the same thing on a 25M-element tensor (the 25.2M MLP's gradient) or a
4096 x 4096 layer (its largest), best of ``--repeats``:

* a multiply into a fresh tensor against the same multiply into a kept one (page faults of a new
  allocation against the arithmetic);
* PowerSGD's second product ``M^T P`` computed as written against ``(P^T M)^T``;
* Top-k's candidates ``|x| >= thr`` at density 0.01 through per-block maxima against one streamed pass.

    python benchmarks/kernels.py
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from lightning_gradcomp.compressors import blocks
from lightning_gradcomp.compressors.blocks import MagnitudeBlocks, streamed_above
from lightning_gradcomp.compressors.topk import TopKCompressor


def best_ms(fn: Callable[[], object], repeats: int) -> float:
    """The fastest of ``repeats`` calls after one untimed call, in milliseconds."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * min(times)


def blocks_copied_out(x: torch.Tensor, thr: float) -> torch.Tensor:
    """``MagnitudeBlocks.above`` with its switch to a streamed pass turned off: every passing block copied out."""
    switch = blocks.STREAM_FRACTION
    blocks.STREAM_FRACTION = 0
    try:
        return MagnitudeBlocks(x).above(thr, inclusive=True)
    finally:
        blocks.STREAM_FRACTION = switch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=25_000_000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(args.numel, generator=generator)
    kept = torch.empty_like(x)
    matrix = torch.randn(4096, 4096, generator=generator)
    p = torch.randn(4096, 4, generator=generator)
    thr = TopKCompressor(0.01).sample_threshold(x, generator)
    assert thr is not None
    pairs = [
        (
            f"multiply {args.numel} floats",
            ("into a fresh tensor", lambda: x * 0.5),
            ("into a kept tensor", lambda: torch.mul(x, 0.5, out=kept)),
        ),
        (
            "PowerSGD's M^T P, 4096 x 4096, rank 4",
            ("torch.matmul(M.T, P)", lambda: torch.matmul(matrix.T, p)),
            ("torch.matmul(P.T, M).T", lambda: torch.matmul(p.T, matrix).T.contiguous()),
        ),
        (
            "Top-k candidates |x| >= thr at density 0.01",
            ("block maxima, blocks copied out", lambda: blocks_copied_out(x, thr)),
            ("one streamed pass", lambda: streamed_above(x, thr, torch.ge)),
        ),
    ]
    print(f"one thread, best of {args.repeats} (ms)")
    for what, (slow_name, slow), (fast_name, fast) in pairs:
        slow_ms, fast_ms = best_ms(slow, args.repeats), best_ms(fast, args.repeats)
        print(f"{what}: {slow_name} {slow_ms:.1f}, {fast_name} {fast_ms:.1f} ({slow_ms / fast_ms:.1f}x)")


if __name__ == "__main__":
    main()
