"""Each codec's encode and decode time per bucket on one device, and ``torch.topk(sorted=False)`` at the same sizes.

A bucket of ``n`` fp32 elements (a normal gradient) is encoded as the hook does it: error feedback's compensation
where the method keeps a residual, the compressor's payload and the bytes that travel, the residual's update;
decoding is those bytes back to a dense tensor. Times are CUDA-event medians of ``--repeats`` after a warm-up call
that compiles the kernels (its time is reported as the cold call), with the codec kernels compiled by
``torch.compile`` in the process (``compiled``) and, side by side, eager; ``--modes ahead`` adds the CPU's kernels built
ahead of time in a child process and loaded (what ``GRADCOMP_CODECS=auto`` runs there), ``--modes generator`` the eager
codecs drawing from a ``torch.Generator`` (the library's streams before the counter hash). Reading a bucket once is
the floor: ``4 n`` bytes at the device's memory bandwidth. Each row also counts the host's waits for the device in
one call.

    PYTHONPATH=. python benchmarks/gpu/codecs.py --out results/ [--sizes 1e6 1e7 1e8 1e9] [--device cuda]

writes ``codecs_<device type>.json`` and ``.md`` into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from lightning_gradcomp.core.comm.aggregators import local_part
from lightning_gradcomp.core.compressors import (
    GaussianKCompressor,
    IdentityCompressor,
    QSGDCompressor,
    ScaledSignCompressor,
    TernGradCompressor,
    TopKCompressor,
    WirePrecision,
)
from lightning_gradcomp.core.fused import set_codec_mode
from lightning_gradcomp.core.host_waits import host_waits
from lightning_gradcomp.core.memory import ErrorFeedback, NoMemory
from lightning_gradcomp.core.randomness import CounterStream


def selecting_by(compressor: TopKCompressor, way: str) -> TopKCompressor:
    """``compressor`` selecting off the CPU by ``way`` (``TopKCompressor.device_selection``) instead of its default
    ``torch.topk`` (to compare them)."""
    compressor.device_selection = way
    return compressor


#: ``name -> (compressor, memory)``: the codecs the targets name (Top-k and Gaussian_k at 1%, 4-bit QSGD).
CODECS: dict[str, Callable[[], tuple[object, object]]] = {
    "topk_ef_1pct": lambda: (TopKCompressor(density=0.01), ErrorFeedback()),
    "topk_ef_1pct_by_radix": lambda: (selecting_by(TopKCompressor(density=0.01), "radix"), ErrorFeedback()),
    "topk_ef_1pct_by_levels": lambda: (selecting_by(TopKCompressor(density=0.01), "levels"), ErrorFeedback()),
    "gaussiank_ef_1pct": lambda: (GaussianKCompressor(density=0.01), ErrorFeedback()),
    "efsign": lambda: (ScaledSignCompressor(), ErrorFeedback()),
    "terngrad": lambda: (TernGradCompressor(), NoMemory()),
    "qsgd_4bit": lambda: (QSGDCompressor(levels=7), NoMemory()),
    "bf16_cast": lambda: (WirePrecision(IdentityCompressor(), "bf16"), NoMemory()),
}
#: The codecs run unless ``--codecs`` names others (the ladder's Top-k left out: 5.72 ms against ``torch.topk``'s 3.69
#: for 1e8 elements on an H200).
DEFAULT_CODECS = [name for name in CODECS if name != "topk_ef_1pct_by_levels"]


def timed(
    fn: Callable[[], object], device: torch.device, repeats: int, setup: Callable[[], object] | None = None
) -> tuple[float, float]:
    """``(cold, median)`` milliseconds of ``fn``: its first call (compiles), then the median of ``repeats``;
    ``setup`` runs before each call, outside the time."""

    def once() -> float:
        if setup is not None:
            setup()
        if device.type == "cuda":
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            stop.record()
            stop.synchronize()
            return start.elapsed_time(stop)
        began = time.perf_counter()
        fn()
        return (time.perf_counter() - began) * 1e3

    cold = once()
    return cold, statistics.median(once() for _ in range(repeats))


def measure(name: str, n: int, device: torch.device, repeats: int, generator: bool = False) -> dict:
    """One codec's times on a bucket of ``n`` elements: encode (compensation, compression, the bytes that travel,
    the residual's update) and decode (those bytes averaged into a kept dense tensor, as the allgather aggregator
    averages: the fused mean where the codec has one). The bucket is refilled outside the time."""
    compressor, memory = CODECS[name]()
    grad = torch.randn(n, device=device)
    work, mean = torch.empty_like(grad), torch.empty_like(grad)
    shape = torch.Size([n])
    steps = iter(range(10**9))
    sent: list[torch.Tensor] = []

    def encode() -> None:
        compensated = memory.compensate_("unit", work)
        step = next(steps)
        draws = torch.Generator(device).manual_seed(step) if generator else CounterStream(step, device)
        payload = compressor.compress(compensated, draws)
        sent[:] = [payload.to_bytes()]
        if not isinstance(memory, NoMemory):
            memory.settle_("unit", compensated, local_part(compressor, payload), n)

    def decode() -> None:  # as the allgather aggregator averages (one rank's payload), into a kept tensor
        compressor.average_all([compressor.unpack(sent[0], shape, grad.dtype)], mean, 1)

    def refill() -> None:
        work.copy_(grad)

    cold, encode_ms = timed(encode, device, repeats, refill)
    _, decode_ms = timed(decode, device, repeats)
    refill()
    syncs = host_waits(encode, device), host_waits(decode, device)
    return {"codec": name, "numel": n, "encode_ms": encode_ms, "decode_ms": decode_ms, "encode_cold_ms": cold,
            "encode_syncs": syncs[0], "decode_syncs": syncs[1]}  # fmt: skip


def write(result: dict, path: Path) -> None:
    """``result`` as JSON at ``path`` and as a Markdown table beside it."""
    path.write_text(json.dumps(result, indent=1))
    lines = [
        f"# Codec times on {result['device']} (torch {result['torch']}), medians of {result['repeats']}",
        "",
        "| codec | mode | elements | encode ms | decode ms | cold encode ms | host syncs (encode, decode) |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        cells = [f"{row[k]:.3f}" if isinstance(row.get(k), float) else str(row.get(k, row.get("error", "")))
                 for k in ("encode_ms", "decode_ms", "encode_cold_ms")]  # fmt: skip
        syncs = f"{row['encode_syncs']}, {row['decode_syncs']}" if row.get("encode_syncs") is not None else ""
        lines.append(f"| {row['codec']} | {row['mode']} | {row['numel']:,} | " + " | ".join(cells) + f" | {syncs} |")
    path.with_suffix(".md").write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--sizes", type=float, nargs="+", default=[1e6, 1e7, 1e8, 1e9])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--codecs", nargs="+", default=DEFAULT_CODECS, choices=list(CODECS))
    parser.add_argument(
        "--modes", nargs="+", default=["compiled", "eager"], choices=["compiled", "ahead", "eager", "generator"]
    )
    args = parser.parse_args(argv)
    if args.repeats < 1 or any(s < 1 for s in args.sizes):
        parser.error(f"--repeats and --sizes must be >= 1, got {args.repeats} and {args.sizes}")
    device = torch.device(args.device)
    args.out.mkdir(parents=True, exist_ok=True)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    rows: list[dict] = []
    result = {"device": name, "torch": torch.__version__, "repeats": args.repeats, "rows": rows}
    path = args.out / f"codecs_{device.type}.json"
    for size in args.sizes:
        n = int(size)
        x = torch.randn(n, device=device)
        _, ms = timed(lambda x=x, n=n: torch.topk(x.abs(), max(1, n // 100), sorted=False), device, args.repeats)
        rows.append({"codec": "torch.topk_1pct_unsorted", "mode": "eager", "numel": n, "encode_ms": ms})
        _, ms = timed(lambda x=x: x.sum(), device, args.repeats)
        rows.append({"codec": "read_once(sum)", "mode": "eager", "numel": n, "encode_ms": ms})
        del x
        for mode in args.modes:
            set_codec_mode("eager" if mode == "generator" else mode)
            for codec in args.codecs:
                try:
                    rows.append({**measure(codec, n, device, args.repeats, mode == "generator"), "mode": mode})
                except Exception as error:  # a codec that fails (out of memory, say) is a row
                    rows.append({"codec": codec, "mode": mode, "numel": n, "error": repr(error).splitlines()[0][:200]})
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                write(result, path)  # what finished survives a timeout
                print(json.dumps(rows[-1]), flush=True)
    print(path.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
