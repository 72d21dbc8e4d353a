"""What per-unit random streams cost: a counter stream derived for every unit at every step, and its draws.

The hook derives each unit's stream from (seed, rank, step, unit) instead of consuming one generator across units
(``lightning_gradcomp.core.randomness``). This measures, side by side in one run, the cost of that derivation per unit
(SplitMix64 mixes) and per step for the units of real models, against what the draws themselves cost: one uniform per
compressed element from the counter hash, eagerly and compiled, and from a ``torch.Generator`` (the streams before).

    python benchmarks/streams.py [--device cuda] [--json benchmarks/results/streams_mlp_resnet20.json]

Draws in microseconds per step over all compressed elements; ratio is deriving over the compiled draws.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from workloads import build_model

from lightning_gradcomp.core.fused import fused
from lightning_gradcomp.core.randomness import UnitStreams, hash_counters, key_block, uniform_of
from lightning_gradcomp.core.units import plan_units
from lightning_gradcomp.examples.models import ResNet20


def _best_of(fn, repeats: int, inner: int, device: torch.device) -> float:
    """Best-of-``repeats`` mean seconds of ``fn`` over ``inner`` calls."""
    best = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        for _ in range(inner):
            fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, (time.perf_counter() - start) / inner)
    return best


@fused
def _uniforms(block: torch.Tensor, count: int) -> torch.Tensor:
    return uniform_of(hash_counters(block, count))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    device = torch.device(args.device)
    streams = UnitStreams(seed=0, rank=0)
    counter = iter(range(10**9))
    per_unit = _best_of(lambda: streams.generator(device, next(counter), 12345), repeats=5, inner=2000, device=device)
    rows = []
    for label, model in (("MLP 3072-512-512-10", build_model("mlp", 512)), ("ResNet-20", ResNet20())):
        units = [u for u in plan_units(list(model.named_parameters()), "layer", 1024) if u.compressed]
        numel = sum(u.numel for u in units)
        buffer = torch.empty(numel, device=device)
        generator = torch.Generator(device=device).manual_seed(0)
        old = _best_of(lambda b=buffer, g=generator: b.uniform_(generator=g), repeats=5, inner=10, device=device)
        block = key_block(7, 0, device)
        eager = _best_of(partial(_uniforms.eager, block, numel), repeats=5, inner=10, device=device)
        compiled = _best_of(partial(_uniforms.compiled, block, numel), repeats=5, inner=10, device=device)
        seeding = per_unit * len(units)
        rows.append({"model": label, "units": len(units), "elements": numel, "seeding_us_per_step": seeding * 1e6,
                     "draws_us_per_step": compiled * 1e6, "eager_draws_us_per_step": eager * 1e6,
                     "generator_draws_us_per_step": old * 1e6, "seeding_over_draws": seeding / compiled})  # fmt: skip
    print(f"device {device}, one thread: deriving one unit's stream {per_unit * 1e6:.2f} us")
    print(f"{'model':<22}{'units':>6}{'elements':>11}{'derive us/step':>16}{'compiled draws':>16}"
          f"{'eager draws':>13}{'torch.Generator':>17}{'ratio':>8}")  # fmt: skip
    for r in rows:
        print(f"{r['model']:<22}{r['units']:>6}{r['elements']:>11}{r['seeding_us_per_step']:>16.1f}"
              f"{r['draws_us_per_step']:>16.1f}{r['eager_draws_us_per_step']:>13.1f}"
              f"{r['generator_draws_us_per_step']:>17.1f}{r['seeding_over_draws']:>8.4f}")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps({"device": str(device), "per_unit_us": per_unit * 1e6, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
