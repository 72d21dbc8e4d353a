"""What the one-thread kernel benchmarks share: the best of several timed calls, and their command line."""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path

import torch


def best_ms(fn: Callable[[], object], repeats: int, device: torch.device) -> float:
    """The fastest of ``repeats`` calls after two untimed ones (compiling, faulting memory in), in milliseconds; on
    CUDA each call is timed to its end on the device."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return 1e3 * min(times)


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
