"""How noisy each unbiased compressor is on real gradients: exact variance along a dense LeNet-5 run.

For an unbiased compressor ``C``, ``omega`` is the ratio ``E||C(g) - g||^2 / ||g||^2``: averaged
over ``n`` ranks, compression adds about ``omega / n`` times the gradient's energy as noise, and
the step sizes of the analyses shrink with it (DIANA, Mishchenko et al. 2019, Theorem 2:
``gamma <= 1 / (L (1 + 2 omega / n))``; unbiased compressed SGD in general). The bounds the
compressors state are worst cases; this script computes the *exact* expectation, in closed form,
for the gradients one rank actually compresses:

* DIANA's ternary quantizer (inf-norm per block of ``b``): element ``x`` of a block with maximum
  ``m`` is sent as ``m sign(x)`` with probability ``|x| / m``, so its variance is ``m |x| - x^2``;
* QSGD with ``s`` levels (2-norm ``N`` per block; Alistarh et al. 2017, Sec. 3.1): with
  ``f`` the fractional part of ``s |x| / N``, the variance is ``(N / s)^2 f (1 - f)``;
* spectral ATOMO with budget ``s`` (Wang et al. 2018, Sec. 3): ``sum_i sigma_i^2 (1 / p_i - 1)``
  over the singular values, with the variance-optimal ``p_i`` the compressor uses;
* TernGrad (Wen et al. 2017, Sec. 3.1, with its clipping of Sec. 3.3): with the layer's scaler
  ``s = min(max|x|, 2.5 sigma)`` and ``x_c`` the gradient clipped to ``[-s, s]``, the ternary
  variance ``s |x_c| - x_c^2`` plus the clipping's bias ``(x_c - x)^2``: biased, so the ratio is a
  mean squared error, not a variance. With this rank's own scaler: sharing the largest over the
  ranks can only add to it;
* EF-SignSGD's scaled sign (Karimireddy et al. 2019, Sec. 3): ``(||x||_1 / d) sign(x)`` misses
  ``||x||^2 - ||x||_1^2 / d`` of ``x``, deterministically: what its error feedback carries to the
  next step.

The model trains densely (SGD as ``time_to_accuracy.py``: global batch ``ranks x batch``, lr 0.05,
momentum 0.9, the same batches for a seed); every ``--every`` steps the first rank's share of the
batch gives the gradient each compressor would see, layer by layer, for the layers the presets
compress (1,024 elements or more, the logits layer excluded).

    python benchmarks/variance.py --steps 600 --every 20 --json benchmarks/results/variance_lenet.json

``--model quickstart`` measures the README's quickstart instead (``recipes/quickstart.yaml``: the
teacher task's 64-512-10 MLP, 2 ranks x 32 examples, lr 0.05, momentum 0.9, 300 steps):

    python benchmarks/variance.py --model quickstart --ranks 2 --steps 300 \
        --json benchmarks/results/variance_quickstart.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
from time_to_accuracy import DEFAULT_DATA, _batches, _mnist
from workloads import build_model

from lightning_gradcomp.core.compressors.atomo import AtomoCompressor, atomo_probabilities, sampling_variance
from lightning_gradcomp.core.compressors.qsgd import DEFAULT_LEVELS, DEFAULT_QSGD_BLOCK
from lightning_gradcomp.core.compressors.quantizer import DEFAULT_BLOCK_SIZE


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    """``x`` flattened into rows of ``block`` elements, the last one padded with zeros (which add no variance)."""
    flat = x.detach().double().reshape(-1)
    pad = (-flat.numel()) % block
    return torch.cat([flat, flat.new_zeros(pad)]).view(-1, block)


def ternary_variance(x: torch.Tensor, block: int = DEFAULT_BLOCK_SIZE) -> float:
    """``E||Q(x) - x||^2`` of the inf-norm ternary quantizer: ``sum m |x| - x^2`` per block of maximum ``m``."""
    rows = _blocks(x, block)
    m = rows.abs().amax(dim=1, keepdim=True)
    return float((m * rows.abs() - rows.pow(2)).sum())


def qsgd_variance(x: torch.Tensor, levels: int = DEFAULT_LEVELS, block: int = DEFAULT_QSGD_BLOCK) -> float:
    """``E||Q(x) - x||^2`` of QSGD: ``sum (N / s)^2 f (1 - f)``, ``f`` the fractional part of ``s |x| / N``."""
    rows = _blocks(x, block)
    norms = rows.norm(dim=1, keepdim=True)
    u = torch.where(norms > 0, levels * rows.abs() / norms.clamp_min(1e-300), torch.zeros_like(rows))
    f = u - u.floor()
    return float(((norms / levels).pow(2) * f * (1 - f)).sum())


def atomo_variance(x: torch.Tensor, budget: float = 3) -> float:
    """``E||C(x) - x||^2`` of spectral ATOMO: ``sum sigma_i^2 (1 / p_i - 1)`` (0 where the layer travels dense)."""
    matrix = AtomoCompressor(budget).matrix_shape(x.shape, x.dtype)
    if matrix is None:
        return 0.0
    sigma = torch.linalg.svdvals(x.detach().double().reshape(matrix))
    return float(sampling_variance(sigma, atomo_probabilities(sigma, budget)))


def terngrad_error(x: torch.Tensor, clip_sigma: float = 2.5) -> float:
    """``E||T(x) - x||^2`` of TernGrad with this rank's scaler: ternary variance of the clipped ``x`` plus the bias."""
    g = x.detach().double().reshape(-1)
    scale = min(float(g.abs().max()), clip_sigma * float(g.std(correction=0)))
    clipped = g.clamp(-scale, scale)
    return float((scale * clipped.abs() - clipped.pow(2)).sum() + (clipped - g).pow(2).sum())


def scaled_sign_error(x: torch.Tensor) -> float:
    """``||C(x) - x||^2`` of the scaled sign: ``||x||^2 - ||x||_1^2 / d`` (no randomness)."""
    g = x.detach().double().reshape(-1)
    return float(g.pow(2).sum() - g.abs().sum().pow(2) / g.numel())


#: ``label -> variance of one tensor``: the compressors of the presets, and the variants measured beside them.
COMPRESSORS = {
    "ternary quantizer, blocks of 1024 (ddp_diana:ternary)": ternary_variance,
    "ternary quantizer, blocks of 128": lambda x: ternary_variance(x, 128),
    "QSGD s = 7, blocks of 512 (ddp_diana)": qsgd_variance,
    "ATOMO budget 3 (ddp_atomo)": atomo_variance,
    "ATOMO budget 8": lambda x: atomo_variance(x, 8),
    "TernGrad, 2.5 sigma, own scaler (ddp_terngrad; biased)": terngrad_error,
    "scaled sign (ddp_efsign; biased, error feedback)": scaled_sign_error,
}


def _model_and_data(args: argparse.Namespace) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    """The model (from the current torch seed) and its training inputs and labels."""
    if args.model == "quickstart":
        from lightning_gradcomp.examples.teacher import MLPClassifier, teacher_dataset

        data = teacher_dataset(8192, 64, 10, seed=0)  # recipes/quickstart.yaml's TeacherDataModule
        return MLPClassifier(features=64, hidden=512, classes=10, lr=args.lr), *data.tensors
    (train_x, train_y), _ = _mnist(args.data_dir, args.holdout)
    return build_model("lenet"), train_x, train_y


def measure(args: argparse.Namespace) -> dict:
    """``omega`` per compressor, layer and measured step, on the first rank's gradient."""
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    model, train_x, train_y = _model_and_data(args)
    named = list(model.named_parameters())
    last = named[-2][0]  # the logits layer's weight: every compressed preset keeps it dense
    layers = [n for n, p in named if p.numel() >= 1024 and n != last]
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    omegas: dict[str, dict[str, list[float]]] = {c: {n: [] for n in [*layers, "all"]} for c in COMPRESSORS}
    steps = []
    batches = _batches(args.seed, len(train_x), args.ranks * args.batch, args.steps)
    for step, indices in enumerate(batches, start=1):
        if step % args.every == 0:
            mine = indices[: args.batch]
            model.zero_grad()
            torch.nn.functional.cross_entropy(model(train_x[mine]), train_y[mine]).backward()
            grads = {n: p.grad.detach().clone() for n, p in named if n in layers}
            energy = sum(float(g.double().pow(2).sum()) for g in grads.values())
            for label, variance in COMPRESSORS.items():
                total = 0.0
                for name, g in grads.items():
                    v = variance(g)
                    omegas[label][name].append(v / float(g.double().pow(2).sum()))
                    total += v
                omegas[label]["all"].append(total / energy)
            steps.append(step)
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(train_x[indices]), train_y[indices]).backward()
        optimizer.step()
    return {"model": args.model, "steps": steps, "layers": layers, "ranks": args.ranks, "batch": args.batch,
            "lr": args.lr, "momentum": args.momentum, "seed": args.seed, "omega": omegas}  # fmt: skip


def show(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    n = result["ranks"]
    title = (f"exact omega = E||C(g) - g||^2 / ||g||^2 on one rank's gradient ({result.get('model', 'lenet')}, "
             f"{result['batch']} examples), median / max over {len(result['steps'])} steps of a dense run")  # fmt: skip
    table = Table(title=title)
    table.add_column("compressor")
    for column in [*result["layers"], "all compressed", f"1 + 2 omega / n (n = {n})"]:
        table.add_column(column, justify="right")
    for label, by_layer in result["omega"].items():
        cells = [f"{statistics.median(v):.2f} / {max(v):.2f}" for v in by_layer.values()]
        table.add_row(label, *cells, f"{1 + 2 * statistics.median(by_layer['all']) / n:.2f}")
    Console(width=200).print(table)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=("lenet", "quickstart"), default="lenet")
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--every", type=int, default=20, help="measure every this many steps")
    parser.add_argument("--ranks", type=int, default=4, help="ranks of the run emulated (global batch ranks x batch)")
    parser.add_argument("--batch", type=int, default=32, help="images per rank")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--data-dir", default=str(DEFAULT_DATA))
    parser.add_argument("--holdout", type=int, default=2000)
    parser.add_argument("--json", help="write the measurements here")
    args = parser.parse_args(argv)
    result = measure(args)
    show(result)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
