"""What the one-thread kernel benchmarks share: the best of several timed calls, two calls timed in alternation, and
their command line."""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch


def call_ms(fn: Callable[[], object], device: torch.device) -> float:
    """One call of ``fn`` in milliseconds; on CUDA timed to its end on the device."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return 1e3 * (time.perf_counter() - start)


def best_ms(fn: Callable[[], object], repeats: int, device: torch.device) -> float:
    """The fastest of ``repeats`` calls after two untimed ones (compiling, faulting memory in), in milliseconds; on
    CUDA each call is timed to its end on the device."""
    for _ in range(2):
        fn()
    return min(call_ms(fn, device) for _ in range(repeats))


def paired_ms(
    first: Callable[[], object], second: Callable[[], object], repeats: int, device: torch.device
) -> tuple[float, float, float]:
    """``(median of first, median of second, median of first - second)`` in milliseconds over ``repeats`` rounds that
    call each once, in alternating order, after two untimed rounds: a slow spell of the machine falls on both calls
    of a round, so the paired differences resolve what separate best-of runs do not."""
    for _ in range(2):
        first(), second()
    rounds = []
    for turn in range(repeats):
        if turn % 2:
            b = call_ms(second, device)
            a = call_ms(first, device)
        else:
            a = call_ms(first, device)
            b = call_ms(second, device)
        rounds.append((a, b))
    return (
        statistics.median(a for a, _ in rounds),
        statistics.median(b for _, b in rounds),
        statistics.median(a - b for a, b in rounds),
    )


def kernel_parser(description: str, json: bool = False) -> argparse.ArgumentParser:
    """``--repeats``, ``--device`` (the CPU, one thread, or ``cuda``) and with ``json`` ``--json PATH``, to which a
    script adds its own."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cpu", help="cpu (one thread) or cuda")
    if json:
        parser.add_argument("--json", type=Path, default=None)
    return parser


def kernel_device(args: argparse.Namespace) -> torch.device:
    """The device the arguments name, with torch held to one CPU thread."""
    torch.set_num_threads(1)
    return torch.device(args.device)
