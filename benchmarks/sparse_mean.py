"""How a sparse mean should divide by the world size: entry by entry, the whole tensor, or not at all.

The mean of the ranks' Top-k payloads is written over the tensor: zeroed, every rank's entries added, then divided by
the world size. Dividing only where entries landed skips a streamed pass over the tensor but reads and writes each
entry at a random place. Over a power-of-two number of ranks the entries are added times ``1 / world`` instead, which
needs no division at all. This script times the three for a 25.2M-entry tensor (the MLP of the step benchmarks: one
flat tensor, and the same entries in its six parameters' pieces, as DDP's buckets hold them) and two ranks' payloads,
at several densities, on one CPU thread (or ``--device cuda``), and says which one the library takes (scaled over
two ranks; over others, entrywise up to ``SPARSE_DIVISION``). All give the same tensor (checked before timing).

    python benchmarks/sparse_mean.py --json benchmarks/results/sparse_mean_cpu.json
"""

from __future__ import annotations

import json
import platform

import torch
from timing import best_ms, kernel_device, kernel_parser

from lightning_gradcomp.core.compressors import TopKCompressor
from lightning_gradcomp.core.compressors.base import Compressor
from lightning_gradcomp.core.compressors.segments import Segments
from lightning_gradcomp.core.compressors.sparse import SPARSE_DIVISION
from lightning_gradcomp.core.randomness import CounterStream

#: The parameters of the 25.2M-parameter MLP (``benchmarks/workloads.py``, ``mlp25m``).
SIZES = (4096 * 3072, 3072, 3072 * 3072, 3072, 3072 * 1024, 1024)
DENSITIES = (0.0005, 0.001, 0.002, 0.004, 0.01, 0.02)


def measure(density: float, generator: torch.Generator, repeats: int, device: torch.device) -> dict[str, object]:
    """Both divisions of two ranks' payloads at ``density``, into one flat tensor and into pieces."""
    numel = sum(SIZES)
    codec = TopKCompressor(density)
    payloads = []
    for rank in range(2):
        sent = codec.compress(torch.randn(numel, generator=generator).to(device), CounterStream(rank, device))
        payloads.append(codec.unpack(sent.to_bytes(), torch.Size([numel]), torch.float32))

    def entrywise(out: torch.Tensor | Segments) -> torch.Tensor | Segments:
        return codec.average_where_landed(payloads, out, 2)

    def streamed(out: torch.Tensor | Segments) -> torch.Tensor | Segments:
        return Compressor.average_all(codec, payloads, out, 2)

    def scaled(out: torch.Tensor | Segments) -> torch.Tensor | Segments:
        return codec.average_scaled(payloads, out, 2)

    flat = torch.empty(numel, device=device)
    pieces = Segments([torch.empty(n, device=device) for n in SIZES])
    expected = streamed(flat).clone()
    assert torch.equal(entrywise(flat), expected), "the entrywise division differs from the streamed one"
    assert torch.equal(torch.cat(entrywise(pieces).parts), expected), "the pieces' mean differs"
    assert torch.equal(scaled(flat), expected), "the scaled entries differ from the streamed division"
    assert torch.equal(torch.cat(scaled(pieces).parts), expected), "the pieces' scaled mean differs"
    landed = sum(p.indices.numel() for p in payloads) / numel
    row: dict[str, object] = {"density": density, "landed": landed}
    row["library divides, 3 ranks"] = "entrywise" if landed <= SPARSE_DIVISION else "streamed"
    row["library divides, 2 ranks"] = "scaled"
    for name, out in (("flat", flat), ("pieces", pieces)):
        row[f"{name}, entrywise ms"] = best_ms(lambda out=out: entrywise(out), repeats, device)
        row[f"{name}, streamed ms"] = best_ms(lambda out=out: streamed(out), repeats, device)
        row[f"{name}, scaled ms"] = best_ms(lambda out=out: scaled(out), repeats, device)
    return row


def main() -> None:
    args = kernel_parser(__doc__.splitlines()[0], json=True).parse_args()
    device = kernel_device(args)
    generator = torch.Generator().manual_seed(0)
    rows = []
    for density in DENSITIES:
        row = measure(density, generator, args.repeats, device)
        rows.append(row)
        print(
            f"density {density}: {row['landed']:.2%} landed; flat {row['flat, entrywise ms']:.1f} entrywise, "
            f"{row['flat, streamed ms']:.1f} streamed, {row['flat, scaled ms']:.1f} scaled; pieces "
            f"{row['pieces, entrywise ms']:.1f} entrywise, {row['pieces, streamed ms']:.1f} streamed, "
            f"{row['pieces, scaled ms']:.1f} scaled (library: {row['library divides, 3 ranks']} over 3 ranks)",
            flush=True,
        )
    where = "one CPU thread" if device.type == "cpu" else torch.cuda.get_device_name(device)
    print(f"{sum(SIZES)} entries, 2 ranks' Top-k payloads, {where}, torch {torch.__version__}, best of {args.repeats}")
    if args.json:
        machine = {"device": where, "torch": torch.__version__, "machine": platform.machine()}
        header = {"entries": sum(SIZES), "pieces": list(SIZES), "ranks": 2, "sparse_division": SPARSE_DIVISION}
        args.json.write_text(json.dumps({**header, **machine, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
