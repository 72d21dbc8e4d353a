"""Cost of spectral ATOMO compression per layer: SVD + sampling time against a plain copy, bytes against dense.

For every weight (two or more dimensions) of LeNet-5 and ResNet-20 (the project's example models),
times ``AtomoCompressor.compress`` (matrix view, its decomposition (sketched or exact), the water-filling
probabilities, Bernoulli sampling; Wang et al., NeurIPS 2018, Sec. 5) and ``decompress`` on a
random gradient of that shape, against ``Tensor.clone`` of the same tensor (the cost of handing it
to a dense allreduce), and reports the mean payload bytes over the draws against the dense bytes
and the expectation ``min(s, rank) (m + n + 1) * 4``. Random Gaussian gradients have a flat spectrum
(the worst case for ATOMO's variance, not for its bytes: ``E[atoms] = min(s, rank)`` whatever the
spectrum). Parameters under the strategy's ``min_compress_numel`` (1024 by default) are marked: the
hook averages them densely and never calls the compressor.

    python benchmarks/atomo_cost.py [--budget 3] [--repeats 30] [--draws 200] [--threads 1] [--device cpu]
                                    [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable

import torch
from torch import nn

from lightning_gradcomp.core.compressors.atomo import AtomoCompressor, AtomoPayload
from lightning_gradcomp.examples.models import LeNet5, ResNet20

MIN_COMPRESS_NUMEL = 1024


def _median_seconds(fn: Callable[[], object], repeats: int, device: torch.device) -> float:
    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _weight_shapes(model: nn.Module) -> list[tuple[tuple[int, ...], int]]:
    """Distinct shapes of the model's weights with two or more dimensions, with how often each occurs."""
    counts: dict[tuple[int, ...], int] = {}
    for p in model.parameters():
        if p.dim() >= 2:
            counts[tuple(p.shape)] = counts.get(tuple(p.shape), 0) + 1
    return list(counts.items())


def _layer_row(atomo: AtomoCompressor, x: torch.Tensor, seed: int, repeats: int, draws: int) -> dict:
    device = x.device
    gen = torch.Generator(device=device).manual_seed(seed)
    matrix = atomo.matrix_shape(x.shape, x.dtype)
    payloads = [atomo.compress(x, gen) for _ in range(draws)]
    mean_bytes = sum(p.nbytes for p in payloads) / draws
    expected = mean_bytes
    if matrix is not None:
        m, n = matrix
        expected = min(atomo.budget, min(m, n)) * (m + n + 1) * 4
    payload = payloads[0]
    return {
        "shape": list(x.shape),
        "matrix": list(matrix) if matrix is not None else None,
        "hook_compresses": x.numel() >= MIN_COMPRESS_NUMEL,
        "compress_ms": 1e3 * _median_seconds(lambda: atomo.compress(x, gen), repeats, device),
        "svd_ms": 1e3 * _median_seconds(lambda: atomo.decompose(x), repeats, device) if matrix else 0.0,
        "decompress_ms": 1e3 * _median_seconds(lambda: atomo.decompress(payload), repeats, device),
        "copy_ms": 1e3 * _median_seconds(x.clone, repeats, device),
        "mean_atoms": sum(p.atoms for p in payloads if isinstance(p, AtomoPayload)) / draws,
        "mean_bytes": mean_bytes,
        "expected_bytes": expected,
        "dense_bytes": x.numel() * x.element_size(),
    }


def measure(
    model_name: str, model: nn.Module, budget: float, repeats: int, draws: int, device: torch.device
) -> list[dict]:
    """One row per distinct weight shape of ``model``: times (median of ``repeats``), bytes (mean of ``draws``)."""
    atomo = AtomoCompressor(budget)
    rows = []
    for i, (shape, count) in enumerate(_weight_shapes(model)):
        x = torch.randn(shape, generator=torch.Generator().manual_seed(i)).to(device)
        rows.append({"model": model_name, "count": count, **_layer_row(atomo, x, i, repeats, draws)})
    return rows


def _table(rows: list[dict]) -> str:
    header = (
        f"{'model':<10}{'shape':<18}{'n':>3} {'matrix':<12}{'hook':>6}{'compress ms':>12}{'svd ms':>8}"
        f"{'decomp ms':>10}{'copy ms':>9}{'atoms':>7}{'bytes':>10}{'s(m+n+1)*4':>12}{'dense':>9}{'ratio':>7}"
    )
    lines = [header, "-" * len(header)]
    for r in rows:
        matrix = "dense" if r["matrix"] is None else "x".join(map(str, r["matrix"]))
        lines.append(
            f"{r['model']:<10}{'x'.join(map(str, r['shape'])):<18}{r['count']:>3} {matrix:<12}"
            f"{'yes' if r['hook_compresses'] else 'dense':>6}{r['compress_ms']:>12.3f}{r['svd_ms']:>8.3f}"
            f"{r['decompress_ms']:>10.3f}{r['copy_ms']:>9.4f}{r['mean_atoms']:>7.2f}{r['mean_bytes']:>10.0f}"
            f"{r['expected_bytes']:>12.0f}{r['dense_bytes']:>9}{r['dense_bytes'] / max(r['mean_bytes'], 1):>7.1f}"
        )
    for model in dict.fromkeys(r["model"] for r in rows):
        used = [r for r in rows if r["model"] == model and r["hook_compresses"]]
        compress = sum(r["count"] * r["compress_ms"] for r in used)
        copy = sum(r["count"] * r["copy_ms"] for r in used)
        sent = sum(r["count"] * r["mean_bytes"] for r in used)
        dense = sum(r["count"] * r["dense_bytes"] for r in used)
        lines.append(
            f"{model}: layers the hook compresses: compress {compress:.2f} ms/step vs copy {copy:.3f} ms/step; "
            f"{sent:.0f} payload bytes vs {dense} dense ({dense / max(sent, 1):.1f}x)"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budget", type=float, default=3.0, help="ATOMO sparsity budget s (expected atoms per layer)")
    parser.add_argument("--repeats", type=int, default=30, help="timed repetitions per layer (median reported)")
    parser.add_argument("--draws", type=int, default=200, help="compressions per layer averaged for the bytes")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--device", default="cpu", help="device of the gradients (cpu, cuda)")
    parser.add_argument("--json", metavar="PATH", help="also write the rows and settings as JSON ('-': stdout)")
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.draws < 1:
        parser.error(f"--repeats and --draws must be >= 1, got {args.repeats} and {args.draws}")
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    rows = []
    for name, model in (("LeNet-5", LeNet5()), ("ResNet-20", ResNet20())):
        rows += measure(name, model, args.budget, args.repeats, args.draws, device)
    print(f"ATOMO budget s={args.budget}, {args.threads} thread(s), device {device}, torch {torch.__version__}")
    print(_table(rows))
    if args.json:
        report = {
            "budget": args.budget,
            "threads": args.threads,
            "device": str(device),
            "torch": torch.__version__,
            "repeats": args.repeats,
            "draws": args.draws,
            "rows": rows,
        }
        text = json.dumps(report, indent=2)
        if args.json == "-":
            print(text)
        else:
            with open(args.json, "w") as f:
                f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
