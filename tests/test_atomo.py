"""Spectral ATOMO (Wang et al., NeurIPS 2018): optimal probabilities, unbiasedness, wire format, bytes on real ranks.

Statistical tests derive their tolerances from the estimator's exact variance (computable from the
singular values and the probabilities) and use fixed seeds, so they are deterministic.
"""

from __future__ import annotations

import copy
import itertools
import math
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from ranks import run_ranks
from test_terngrad import assert_unbiased
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from lightning_gradcomp.core.comm import AllgatherAggregator, Collectives, Contribution
from lightning_gradcomp.core.compressors import DensePayload
from lightning_gradcomp.core.compressors import atomo as atomo_module
from lightning_gradcomp.core.compressors.atomo import (
    AtomoCompressor,
    AtomoPayload,
    atomo_probabilities,
    one_pass_probabilities,
    sampling_variance,
    spectral_decomposition,
)
from lightning_gradcomp.core.compressors.draws import uniform
from lightning_gradcomp.core.compressors.spectral import sketched_atoms
from lightning_gradcomp.core.memory import NoMemory
from lightning_gradcomp.ddp.hook import GradCompHook, gradcomp_comm_hook

Z = 5.0  # tolerance in standard deviations of the quantity tested


def _orthonormal(rows: int, cols: int, gen: torch.Generator) -> torch.Tensor:
    return torch.linalg.qr(torch.randn(rows, cols, generator=gen, dtype=torch.float64))[0]


def _with_spectrum(m: int, n: int, sigma: torch.Tensor, seed: int) -> torch.Tensor:
    """An ``(m, n)`` float32 matrix whose singular values are ``sigma``."""
    gen = torch.Generator().manual_seed(seed)
    r = sigma.numel()
    return (_orthonormal(m, r, gen) * sigma.double() @ _orthonormal(n, r, gen).T).float()


SPECTRA = {
    "flat": (torch.ones(20), 3.0),
    "geometric": (0.5 ** torch.arange(20.0), 3.0),
    "one dominant": (torch.tensor([1000.0] + [1.0] * 19), 3.0),
    "steps": (torch.tensor([9.0, 8.0, 1.0, 1.0, 0.5, 0.5, 0.1]), 2.5),
    "budget above rank": (0.7 ** torch.arange(6.0), 9.0),
    "zeros, budget above nonzeros": (torch.tensor([3.0, 0.0, 1.0, 0.0, 2.0]), 4.0),
    "shuffled with zeros": (torch.tensor([0.3, 0.0, 5.0, 0.01, 2.0, 0.0, 0.3, 1.0, 7.0]), 3.5),
}


@pytest.mark.parametrize("name", list(SPECTRA))
def test_probabilities_spend_the_budget_and_beat_the_one_pass_shortcut(name: str) -> None:
    magnitudes, budget = SPECTRA[name]
    a = magnitudes.double()
    p = atomo_probabilities(a, budget)
    nonzero = a > 0
    assert p.dtype == a.dtype and p.shape == a.shape
    assert math.isclose(float(p.sum()), min(budget, int(nonzero.sum())), rel_tol=1e-12)
    assert bool((p[nonzero] > 0).all() and (p <= 1).all() and (p[~nonzero] == 0).all())
    one_pass = one_pass_probabilities(a, budget)
    optimal, shortcut = float(sampling_variance(a, p)), float(sampling_variance(a, one_pass))
    assert optimal <= shortcut * (1 + 1e-12)
    print(f"{name:>30}: s={budget} variance water-filling {optimal:.6g}, one-pass {shortcut:.6g}, "
          f"one-pass spends {float(one_pass.sum()):.4f} of {min(budget, int(nonzero.sum()))}")  # fmt: skip
    # KKT conditions of min sum a^2/p s.t. sum p = s, 0 < p <= 1: p_i = min(1, c a_i) for one c > 0
    free = nonzero & (p < 1)
    if free.any():
        c = p[free] / a[free]
        torch.testing.assert_close(c, torch.full_like(c, float(c.mean())), rtol=1e-12, atol=0)
        assert bool((c[0] * a[nonzero & ~free] >= 1 - 1e-12).all())
    # permutation equivariance
    perm = torch.randperm(a.numel(), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(atomo_probabilities(a[perm], budget), p[perm], rtol=1e-14, atol=0)


def test_one_pass_shortcut_underspends_when_it_clips() -> None:
    a, budget = SPECTRA["one dominant"]
    one_pass = one_pass_probabilities(a.double(), budget)
    assert float(one_pass.sum()) < 1.06  # 1 (clipped) + 19 * 3/1019: two atoms of budget wasted
    assert float(atomo_probabilities(a.double(), budget).sum()) == pytest.approx(3.0, rel=1e-12)


def _brute_force(a: torch.Tensor, budget: float) -> tuple[float, torch.Tensor]:
    """min over every set K of atoms with p = 1 of the best proportional allocation of the rest."""
    best, best_p = math.inf, None
    r = a.numel()
    for size in range(r + 1):
        for saturated in itertools.combinations(range(r), size):
            rest = [i for i in range(r) if i not in saturated]
            left = budget - size
            if left < 0 or (not rest and left > 1e-12) or (rest and left <= 0):
                continue
            p = torch.ones(r, dtype=torch.float64)
            if rest:
                p[rest] = a[rest] * left / a[rest].sum()
            if bool((p <= 1 + 1e-15).all()):
                variance = float((a**2 / p).sum())
                if variance < best:
                    best, best_p = variance, p
    assert best_p is not None
    return best, best_p


@pytest.mark.parametrize("seed", range(6))
def test_probabilities_equal_a_brute_force_optimum_on_small_cases(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    r = 3 + seed % 5
    a = torch.rand(r, generator=gen, dtype=torch.float64) ** 4 * 10 + 1e-3  # heavy spread: several saturate
    for budget in (0.5, 1.0, 1.7, 2.0, r - 0.5):
        variance, reference = _brute_force(a, budget)
        p = atomo_probabilities(a, budget)
        assert float((a**2 / p).sum()) == pytest.approx(variance, rel=1e-12)
        torch.testing.assert_close(p, reference, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("budget", [0, -1, math.nan, math.inf, True, "3", None])
def test_bad_budgets_are_rejected(budget: object) -> None:
    with pytest.raises(ValueError, match="budget must be a finite number > 0"):
        AtomoCompressor(budget)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="budget"):
        atomo_probabilities(torch.ones(3), budget)  # type: ignore[arg-type]


def test_matrix_views_and_dense_fallbacks() -> None:
    atomo = AtomoCompressor(budget=3)
    assert atomo.name == "atomo" and atomo.unbiased and atomo.preferred_aggregator(4) == "allgather"
    f32 = torch.float32
    assert atomo.matrix_shape(torch.Size([64, 32, 3, 3]), f32) == (64, 288)  # conv: (out, in*kh*kw)
    assert atomo.matrix_shape(torch.Size([120, 400]), f32) == (120, 400)  # linear stays (out, in)
    assert atomo.matrix_shape(torch.Size([4096]), f32) is None  # 1-D (bias, or a whole bucket) travels dense
    assert atomo.matrix_shape(torch.Size([2, 1000]), f32) is None  # 2 atoms * 1003 floats >= 2000: no gain
    assert atomo.matrix_shape(torch.Size([0, 5]), f32) is None
    assert atomo.payload_nbytes(torch.Size([4096]), torch.bfloat16) == 8192
    assert atomo.payload_nbytes(torch.Size([120, 400]), f32) is None
    bias = torch.randn(4096)
    payload = atomo.compress(bias, torch.Generator())
    assert isinstance(payload, DensePayload) and torch.equal(atomo.decompress(payload), bias)


def _draws(atomo: AtomoCompressor, x: torch.Tensor, count: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.stack([atomo.decompress(atomo.compress(x, gen)).double() for _ in range(count)])


@pytest.mark.parametrize(
    ("shape", "sigma", "budget", "sketch_rank"),
    [
        ((12, 20), 2.0 ** -torch.arange(12.0) * 4, 3.0, None),  # decaying spectrum: the top atoms saturate
        ((8, 3, 3, 3), None, 2.5, None),  # a conv kernel with a random (flat-ish) spectrum
        # a rank-4 sketch of a rank-30 matrix, accepted whatever its residual: the 44 residual atoms are drawn too
        ((48, 80), 0.7 ** torch.arange(30.0), 3.0, 4),
    ],
)
def test_atomo_is_unbiased_with_the_predicted_variance(
    shape: tuple, sigma: torch.Tensor | None, budget: float, sketch_rank: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    if sigma is None:
        x = torch.randn(shape, generator=torch.Generator().manual_seed(3))
    else:
        x = _with_spectrum(*shape, sigma, seed=4)
    if sketch_rank is None:
        atomo = AtomoCompressor(budget)
    else:
        monkeypatch.setattr(atomo_module, "SKETCH_SLACK", math.inf)
        atomo = AtomoCompressor(budget, sketch_rank=sketch_rank)
    u, s, vh = (t.double() for t in atomo.decompose(x))
    if sketch_rank is not None:  # the sketch's residual atoms are not singular ones: their magnitudes sum to more
        nuclear = float(torch.linalg.svdvals(x.double()).sum())
        assert float(s.sum()) > 1.01 * nuclear and bool((s[sketch_rank:] > 0).all())
    p = atomo.probabilities(s)
    assert float(p.sum()) == pytest.approx(budget, rel=1e-9) and bool((p < 1).any())
    # entry (j, k) of g_hat is sum_i (s_i t_i / p_i) u_ji v_ik with independent t_i ~ Bernoulli(p_i)
    per_atom = s**2 * (1 / p - 1)
    entry_variance = torch.einsum("i,ji,ik->jk", per_atom, u**2, vh**2).reshape(-1)
    count = 3000
    draws = _draws(atomo, x, count, seed=5)
    target = x.double().reshape(-1)
    error = draws.mean(0) - target
    tolerance = Z * (entry_variance / count).sqrt() + 1e-5
    assert bool((error.abs() <= tolerance).all()), float((error.abs() / tolerance).max())
    # total variance: E||g_hat - g||^2 = sum_i s_i^2 (1/p_i - 1), estimated from the same draws
    squared = (draws - target).pow(2).sum(1)
    predicted = float(sampling_variance(s, p))
    worst = float((error.abs() / (entry_variance / count).sqrt()).max())
    print(f"{shape} s={budget}: max |mean - g| / sd(mean) = {worst:.2f}; E||g_hat - g||^2 predicted "
          f"{predicted:.4f}, measured {float(squared.mean()):.4f} over {count} draws")  # fmt: skip
    assert float(squared.mean()) == pytest.approx(predicted, abs=Z * float(squared.std()) / math.sqrt(count))
    # the atoms kept average to the budget
    atoms = [atomo.compress(x, torch.Generator().manual_seed(i)).atoms for i in range(500)]
    var_atoms = float((p * (1 - p)).sum())
    assert sum(atoms) / 500 == pytest.approx(budget, abs=Z * math.sqrt(var_atoms / 500))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("shape", [(16, 6, 5, 5), (40, 30), (3000,), (2, 1000)])
def test_wire_round_trip_is_exact(dtype: torch.dtype, shape: tuple) -> None:
    x = torch.randn(shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    atomo = AtomoCompressor(budget=4)
    payload = atomo.compress(x, torch.Generator().manual_seed(2))
    wire = payload.to_bytes()
    assert wire.dtype == torch.uint8 and wire.numel() == payload.nbytes
    shifted = torch.cat([torch.zeros(3, dtype=torch.uint8), wire])[3:]  # misaligned parts must read back
    back = atomo.unpack(shifted, x.shape, dtype)
    assert type(back) is type(payload) and back.dtype == dtype and back.shape == x.shape
    assert torch.equal(atomo.decompress(back), atomo.decompress(payload))
    if isinstance(payload, AtomoPayload):
        m, n = atomo.matrix_shape(x.shape, dtype)  # type: ignore[misc]
        atom_bytes = 8 if dtype == torch.float64 else 4
        assert payload.nbytes == payload.atoms * (m + n + 1) * atom_bytes
        assert payload.atoms >= 1 and isinstance(back, AtomoPayload)
        assert torch.equal(back.u, payload.u) and torch.equal(back.v, payload.v)
        assert torch.equal(back.coefficients, payload.coefficients)
        with pytest.raises(ValueError, match="whole number"):
            atomo.unpack(wire[:-1], x.shape, dtype)
    else:
        assert payload.nbytes == x.numel() * x.element_size() == atomo.payload_nbytes(x.shape, dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_gradients_decompose_in_float32_without_nan(dtype: torch.dtype) -> None:
    x = _with_spectrum(64, 96, 3.0 ** -torch.arange(64.0) * 50, seed=6).to(dtype)
    atomo = AtomoCompressor(budget=3)
    half = atomo.compress(x, torch.Generator().manual_seed(0))
    full = atomo.compress(x.float(), torch.Generator().manual_seed(0))
    assert isinstance(half, AtomoPayload) and isinstance(full, AtomoPayload)
    assert half.coefficients.dtype == torch.float32 and half.dtype == dtype
    assert torch.equal(half.u, full.u) and torch.equal(half.v, full.v)
    assert torch.equal(half.coefficients, full.coefficients)
    out = atomo.decompress(half)
    assert out.dtype == dtype and bool(torch.isfinite(out).all())
    assert torch.equal(out, atomo.decompress(full).to(dtype))
    # a flat spectrum of large entries: sigma / p exceeds the float16 range, the decompressed layer does not
    big = (torch.randn(64, 96, generator=torch.Generator().manual_seed(7)) * 2000).to(dtype)
    payload = atomo.compress(big, torch.Generator().manual_seed(1))
    assert isinstance(payload, AtomoPayload) and float(payload.coefficients.max()) > 65504
    assert bool(torch.isfinite(atomo.decompress(payload)).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_all_zero_gradients_send_no_atom_and_decompress_to_zero(dtype: torch.dtype) -> None:
    atomo = AtomoCompressor()
    x = torch.zeros(16, 6, 5, 5, dtype=dtype)
    payload = atomo.compress(x, torch.Generator())
    assert isinstance(payload, AtomoPayload) and payload.atoms == 0 and payload.nbytes == 0
    assert payload.to_bytes().numel() == 0
    back = atomo.unpack(payload.to_bytes(), x.shape, dtype)
    assert torch.equal(atomo.decompress(back), torch.zeros(x.numel(), dtype=dtype))
    # rank-deficient: zero singular values are never sampled, nothing is NaN
    low_rank = torch.zeros(40, 30)
    low_rank[:, 0] = 1.0
    out = atomo.decompress(atomo.compress(low_rank, torch.Generator()))
    torch.testing.assert_close(out.view(40, 30), low_rank, rtol=1e-5, atol=1e-5)


def test_non_finite_gradients_stay_non_finite() -> None:
    x = torch.randn(40, 30).half()
    x[3, 4] = math.inf
    out = AtomoCompressor().decompress(AtomoCompressor().compress(x, torch.Generator()))
    assert bool(torch.isnan(out).all())  # a GradScaler sees the overflow and skips the step


# ---------------------------------------------------------------- real ranks: bytes on the wire

LAYERS = {  # shape -> singular values (None: dense, a 1-D bias)
    (16, 6, 5, 5): 0.6 ** torch.arange(16.0),
    (120, 400): torch.linspace(1.0, 0.1, 120),
    (10, 84): torch.tensor([5.0, 1.0, *([0.2] * 8)]),
    (120,): None,
}
BUDGET = 3.0
STEPS = 150


def _layer_inputs() -> list[torch.Tensor]:
    out = []
    for i, (shape, sigma) in enumerate(LAYERS.items()):
        if sigma is None:
            out.append(torch.randn(shape, generator=torch.Generator().manual_seed(i)))
        else:
            out.append(_with_spectrum(shape[0], math.prod(shape[1:]), sigma, seed=10 + i).reshape(shape))
    return out


def _exchange(rank: int, world_size: int) -> dict:
    torch.set_num_threads(1)
    atomo = AtomoCompressor(BUDGET)
    xs = _layer_inputs()  # the same gradients on every rank, drawn with independent generators
    gen = torch.Generator().manual_seed(1000 + rank)
    record: dict = {"bytes_sent": [], "calls": [], "payload_bytes": [], "atoms": []}
    for step in range(STEPS):
        payloads = [atomo.compress(x, gen) for x in xs]
        collectives = Collectives()
        results = AllgatherAggregator().aggregate([Contribution(atomo, p) for p in payloads], collectives)
        record["bytes_sent"].append(collectives.counter.bytes_sent)
        record["calls"].append(collectives.counter.calls)
        record["payload_bytes"].append([p.nbytes for p in payloads])
        record["atoms"].append([p.atoms if isinstance(p, AtomoPayload) else 0 for p in payloads])
        if step == 0:
            record["means"] = [r.mean for r in results]
            record["sents"] = [r.sent for r in results]
    return record


def _max_distribution(weights_and_probs: list[tuple[int, torch.Tensor]], world_size: int) -> tuple[float, float]:
    """Mean and std of max over ``world_size`` i.i.d. ranks of ``sum_l w_l K_l``, ``K_l`` Poisson-binomial."""
    total = {0: 1.0}
    for weight, p in weights_and_probs:
        counts = torch.zeros(p.numel() + 1, dtype=torch.float64)
        counts[0] = 1.0
        for pi in p.tolist():  # Poisson-binomial pmf of the number of atoms kept
            counts[1:] = counts[1:] * (1 - pi) + counts[:-1] * pi
            counts[0] *= 1 - pi
        merged: dict[int, float] = {}
        for value, mass in total.items():
            for k, pk in enumerate(counts.tolist()):
                if pk * mass > 1e-18:
                    merged[value + weight * k] = merged.get(value + weight * k, 0.0) + pk * mass
        total = merged
    values = sorted(total)
    cdf = torch.tensor([total[v] for v in values], dtype=torch.float64).cumsum(0).clamp(max=1.0)
    below = torch.cat([torch.zeros(1, dtype=torch.float64), cdf[:-1]])
    pmf_max = cdf**world_size - below**world_size
    v = torch.tensor(values, dtype=torch.float64)
    mean = float((pmf_max * v).sum())
    return mean, math.sqrt(max(0.0, float((pmf_max * v**2).sum()) - mean**2))


@pytest.mark.parametrize("world_size", [2])  # variable counts per rank: the padded allgather path
def test_bytes_counted_on_real_ranks_match_the_expected_atoms(world_size: int) -> None:
    results = run_ranks(_exchange, world_size)
    atomo = AtomoCompressor(BUDGET)
    xs = _layer_inputs()
    # the average of the decompressed payloads, identical on every rank
    for i in range(len(xs)):
        expected = sum(r["sents"][i] for r in results) / world_size
        for r in results:
            assert torch.equal(r["means"][i], results[0]["means"][i])
            torch.testing.assert_close(r["means"][i], expected, rtol=1e-5, atol=1e-6)
    layers = len(xs)
    dense_bytes = sum(x.numel() * 4 for x, sigma in zip(xs, LAYERS.values(), strict=True) if sigma is None)
    weights_and_probs = []
    for i, x in enumerate(xs):
        if LAYERS[tuple(x.shape)] is None:
            continue
        m, n = atomo.matrix_shape(x.shape, x.dtype)  # type: ignore[misc]
        p = atomo.probabilities(atomo.decompose(x)[1])
        weight = (m + n + 1) * 4
        weights_and_probs.append((weight, p))
        # this rank's payload bytes, averaged over steps and ranks: E[atoms] (m + n + 1) * 4
        sizes = torch.tensor([step[i] for r in results for step in r["payload_bytes"]], dtype=torch.float64)
        atoms = torch.tensor([step[i] for r in results for step in r["atoms"]], dtype=torch.float64)
        assert torch.equal(sizes, atoms * weight)
        expected_mean, expected_std = float(p.sum()) * weight, math.sqrt(float((p * (1 - p)).sum())) * weight
        assert float(p.sum()) == pytest.approx(min(BUDGET, min(m, n)), rel=1e-9)
        print(f"P={world_size} layer {tuple(x.shape)} as ({m}, {n}): mean {float(sizes.mean()):.1f} bytes/step, "
              f"expected s(m+n+1)*4 = {expected_mean:.1f} (dense {m * n * 4})")  # fmt: skip
        assert float(sizes.mean()) == pytest.approx(expected_mean, abs=Z * expected_std / math.sqrt(sizes.numel()))
    # what the comm layer counted, per step: one size exchange (int64 per layer) + the gather padded to the
    # longest rank's bytes; on average 8 L + dense + E[max over ranks of the spectral bytes]
    for step in range(STEPS):
        longest = max(sum(r["payload_bytes"][step]) for r in results)
        for r in results:
            assert r["calls"][step] == 2
            assert r["bytes_sent"][step] == 8 * layers + longest
    counted = torch.tensor(results[0]["bytes_sent"], dtype=torch.float64)
    mean_max, std_max = _max_distribution(weights_and_probs, world_size)
    expected = 8 * layers + dense_bytes + mean_max
    print(f"P={world_size}: counted {float(counted.mean()):.1f} bytes sent/step, expected {expected:.1f} "
          f"(mean payload {8 * layers + dense_bytes + sum(float(p.sum()) * w for w, p in weights_and_probs):.1f} "
          f"before padding to the longest rank)")  # fmt: skip
    assert float(counted.mean()) == pytest.approx(expected, abs=Z * std_max / math.sqrt(STEPS))


# ---------------------------------------------------------------- Lightning end to end

MNIST_STEPS, MNIST_SEEDS, MNIST_BUDGET = 250, (0, 1, 2), 10


def test_atomo_fit_on_mnist_is_within_one_and_a_half_points_of_dense(mnist_fit: Callable[..., dict]) -> None:
    # One seed's gap to dense spreads by about a point (seeds 0-6: -2.6 to +0.5 points), so the claim is on the mean
    # of three seeds, whose spread is about 0.6 points.
    gaps, ratios = [], []
    for seed in MNIST_SEEDS:
        dense = mnist_fit({"compressor": "none", "memory": "none"}, steps=MNIST_STEPS, seed=seed)
        atomo = mnist_fit(
            {"compressor": AtomoCompressor(budget=MNIST_BUDGET), "memory": "none", "aggregator": "allgather"},
            steps=MNIST_STEPS,
            seed=seed,
        )
        print(f"MNIST LeNet-5, {MNIST_STEPS} steps, seed {seed}: dense {dense['val_acc']:.4f}, "
              f"ATOMO s={MNIST_BUDGET} {atomo['val_acc']:.4f}; bytes/step {atomo['bytes_sent']:.0f} "
              f"vs dense {atomo['dense_bytes']:.0f}")  # fmt: skip
        gaps.append(atomo["val_acc"] - dense["val_acc"])
        ratios.append(atomo["bytes_sent"] / atomo["dense_bytes"])
    assert sum(gaps) / len(gaps) >= -0.015
    assert max(ratios) < 1 / 4


@pytest.mark.parametrize("shape", [(64, 576), (576, 64), (64, 64), (10, 512), (7, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_spectral_decomposition_reconstructs_to_working_precision_and_matches_the_svd(
    shape: tuple[int, int], dtype: torch.dtype
) -> None:
    a = torch.randn(*shape, generator=torch.Generator().manual_seed(0), dtype=dtype)
    u, sigma, vh = spectral_decomposition(a)
    eps = torch.finfo(dtype).eps
    r = min(shape)
    assert u.shape == (shape[0], r) and sigma.shape == (r,) and vh.shape == (r, shape[1])
    # the sum of all atoms is the matrix (what makes the sampled estimator unbiased), to working precision
    assert float((u @ torch.diag(sigma) @ vh - a).norm() / a.norm()) < 50 * eps
    # the basis is orthonormal and the singular values are the SVD's, to eps * ||A||
    basis = u if shape[0] <= shape[1] else vh.T
    assert float((basis.T @ basis - torch.eye(r, dtype=dtype)).abs().max()) < 50 * eps
    svd = torch.linalg.svdvals(a)
    assert float((sigma - svd).abs().max()) < 50 * eps * float(svd[0])
    assert bool((sigma[:-1] >= sigma[1:]).all())


def test_spectral_decomposition_of_a_rank_deficient_matrix_keeps_every_atom_exact() -> None:
    gen = torch.Generator().manual_seed(1)
    a = torch.randn(40, 3, generator=gen, dtype=torch.float64) @ torch.randn(3, 300, generator=gen, dtype=torch.float64)
    u, sigma, vh = spectral_decomposition(a)
    assert float((u @ torch.diag(sigma) @ vh - a).norm() / a.norm()) < 1e-13
    assert float(sigma[3:].max()) < 1e-12 * float(sigma[0])  # the null directions carry (almost) nothing
    assert torch.isfinite(vh).all()
    zero = spectral_decomposition(torch.zeros(4, 9))
    assert torch.equal(zero[1], torch.zeros(4)) and torch.equal(zero[2], torch.zeros(4, 9))


def _raising_eigh(*args: object, **kwargs: object) -> None:
    raise torch.linalg.LinAlgError("linalg.eigh: The algorithm failed to converge")


def _nan_eigh(a: torch.Tensor, *args: object, **kwargs: object) -> object:
    values, vectors = _REAL_EIGH(a)
    return torch.return_types.linalg_eigh((values.fill_(math.nan), vectors.fill_(math.nan)))


_REAL_EIGH = torch.linalg.eigh


@pytest.mark.parametrize("failing_eigh", [_raising_eigh, _nan_eigh], ids=["raises", "returns-nan"])
def test_spectral_decomposition_falls_back_to_the_svd_when_the_eigensolver_fails(
    monkeypatch: pytest.MonkeyPatch, failing_eigh: object
) -> None:
    # LAPACK's syevd failed to converge on a LeNet-5 gradient's Gram matrix during a 600-step run, and
    # on another returned NaN without raising (MKL, one thread)
    gen = torch.Generator().manual_seed(0)
    for shape in ((12, 40), (40, 12)):
        matrix = torch.randn(*shape, generator=gen, dtype=torch.float64)
        expected = torch.linalg.svdvals(matrix)
        with monkeypatch.context() as patch:
            patch.setattr(torch.linalg, "eigh", failing_eigh)
            u, s, vh = spectral_decomposition(matrix)
        torch.testing.assert_close(u @ torch.diag(s) @ vh, matrix, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(s, expected, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(u.T @ u, torch.eye(u.shape[1], dtype=torch.float64), rtol=0, atol=1e-12)


def test_the_gradient_whose_gram_matrix_mkl_returned_nan_for_compresses_to_finite_unbiased_atoms() -> None:
    """A LeNet-5 fc1 gradient (rank 0 of 4, seed 7, step 145 of a ddp_atomo run: 38 dead units) on
    which MKL's one-thread ``eigh`` of the Gram matrix gives NaN eigenvectors and no error: ATOMO's
    NaN reached every rank's average and the run fell to chance accuracy.

    Catches: a biased draw (atoms scaled by 0.9 fail both the atoms kept with certainty and the chi-square)."""
    fixture = torch.load(Path(__file__).parent / "data" / "lenet_fc1_gradient_eigh_nan.pt", weights_only=True)
    x = torch.zeros(int(fixture["shape"].prod())).index_put_((fixture["indices"].long(),), fixture["values"])
    x = x.reshape(fixture["shape"].tolist())
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        u, sigma, vh = spectral_decomposition(x)
        compressor, gen = AtomoCompressor(3), torch.Generator().manual_seed(0)
        draws = 400
        # each draw's coefficient on every atom u_i v_i^T (orthonormal atoms: a projection reads it back exactly)
        total = torch.zeros(sigma.numel(), dtype=torch.float64)
        for _ in range(draws):
            estimate = compressor.decompress(compressor.compress(x, gen)).double().reshape(x.shape)
            total += torch.einsum("ji,jk,ik->i", u.double(), estimate, vh.double())
    finally:
        torch.set_num_threads(threads)
    torch.testing.assert_close(u @ torch.diag(sigma) @ vh, x, rtol=0, atol=1e-6)
    torch.testing.assert_close(sigma, torch.linalg.svdvals(x.double()).float(), rtol=0, atol=1e-6)
    # unbiased: atom i's coefficient is (sigma_i / p_i) Bernoulli(p_i) (Wang et al., Sec. 3), tested by the
    # chi-square and the sum of the standardised means at the suite's false-alarm rate; atoms kept with
    # p_i = 1 must come back as sigma_i (to float32's precision of the decoded sum)
    s = sigma.double()
    p = atomo_probabilities(s, 3)
    alive = p > 0
    assert bool((p[alive] == 1).any()) and bool((p[alive] < 1).any())  # both kinds of atom are tested
    assert_unbiased(total[alive], s[alive], s[alive] / p[alive], draws, exact_rtol=1e-5)


# ---------------------------------------------------------------- sketched decomposition


def _low_rank(m: int, n: int, rank: int, noise: float, dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(m, rank, generator=gen, dtype=torch.float64) @ torch.randn(
        rank, n, generator=gen, dtype=torch.float64
    )
    return (a + noise * torch.randn(m, n, generator=gen, dtype=torch.float64)).to(dtype)


def _spy_sketches(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int, bool]]:
    """Record ``(rank, power iterations, accepted)`` of every sketch the compressor tries."""
    tried: list[tuple[int, int, bool]] = []

    def spy(
        matrix: torch.Tensor, test_matrix: torch.Tensor, slack: float, power_iterations: int, out: object
    ) -> object:
        atoms = sketched_atoms(matrix, test_matrix, slack, power_iterations, out)
        tried.append((test_matrix.shape[1], power_iterations, atoms is not None))
        return atoms

    monkeypatch.setattr(atomo_module, "sketched_atoms", spy)
    return tried


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(("shape", "noise"), [((200, 600), 0.0), ((600, 200), 0.0), ((200, 600), 1e-5)])
def test_sketched_atoms_sum_to_the_matrix_with_magnitudes_within_the_slack_of_the_nuclear_norm(
    shape: tuple[int, int], noise: float, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a linear layer's gradient has rank <= the samples in the batch: 20 here, under the first sketch's 32
    x = _low_rank(*shape, 20, noise, dtype, seed=2)
    tried = _spy_sketches(monkeypatch)
    u, sigma, vh = AtomoCompressor(3).decompose(x)
    assert tried == [(32, 0, True)]  # no power iteration: the sketch's range is the matrix's
    eps = torch.finfo(dtype).eps
    side = min(shape)
    assert u.shape == (shape[0], side) and sigma.shape == (side,) and vh.shape == (side, shape[1])
    assert float((u @ torch.diag(sigma) @ vh - x).norm() / x.norm()) < 100 * eps  # unbiased: the atoms sum to x
    basis = u if shape[0] <= shape[1] else vh.T
    assert float((basis.T @ basis - torch.eye(side, dtype=dtype)).abs().max()) < 100 * eps
    svd = torch.linalg.svdvals(x.double())
    assert float(sigma.double().sum()) <= (1 + atomo_module.SKETCH_SLACK) * float(svd.sum())
    # the top atoms are the singular ones of the projection P A onto the sketch: by Weyl's inequality for
    # A^T A = A^T P A + A^T (I - P) A, sigma_i(A)^2 - ||(I - P) A||^2 <= sigma_i(P A)^2 <= sigma_i(A)^2, and the
    # residual atoms are (I - P) A's rows in an orthonormal basis
    top, residual = sigma[:20].double(), float(sigma[32:].double().pow(2).sum())
    rounding = 100 * eps * float(svd[0]) ** 2
    assert bool((top.pow(2) <= svd[:20].pow(2) + rounding).all())
    assert bool((svd[:20].pow(2) - top.pow(2) <= residual + rounding).all())
    # the variance at ATOMO's probabilities is within the slack's reach of the exact decomposition's
    exact = AtomoCompressor(3, decomposition="full")
    variance = float(sampling_variance(sigma, atomo_probabilities(sigma.double(), 3)))
    exact_sigma = exact.decompose(x)[1]
    exact_variance = float(sampling_variance(exact_sigma, atomo_probabilities(exact_sigma.double(), 3)))
    bound = (1 + atomo_module.SKETCH_SLACK) ** 2 * float(svd.sum()) ** 2 / 3 - float(svd.pow(2).sum())
    assert exact_variance * (1 - 1e-4) <= variance <= bound


def test_the_sketch_rank_doubles_until_the_residual_is_small_and_the_exact_decomposition_takes_over(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    tried = _spy_sketches(monkeypatch)
    rank_40 = _low_rank(300, 500, 40, 0.0, torch.float32, seed=3)
    u, sigma, vh = AtomoCompressor(3, sketch_rank=16).decompose(rank_40)
    assert tried == [(16, 0, False), (16, 1, False), (32, 0, False), (32, 1, False), (64, 0, True)]
    assert float((u @ torch.diag(sigma) @ vh - rank_40).norm() / rank_40.norm()) < 1e-5
    tried.clear()
    flat = torch.randn(300, 500, generator=torch.Generator().manual_seed(4))
    atoms = AtomoCompressor(3, sketch_rank=16).decompose(flat)
    assert [(rank, accepted) for rank, _, accepted in tried] == [(r, False) for r in (16, 16, 32, 32, 64, 64)]
    # 4 * 128 > 300: the exact decomposition
    for got, want in zip(atoms, spectral_decomposition(flat), strict=True):
        assert torch.equal(got, want)
    tried.clear()
    full = AtomoCompressor(3, decomposition="full").decompose(rank_40)
    assert tried == [] and torch.equal(full[1], spectral_decomposition(rank_40)[1])
    # small sides never sketch: 4 * 32 > 120 (LeNet-5's fc1)
    AtomoCompressor(3).decompose(torch.randn(120, 400))
    assert tried == []


def test_a_power_iteration_rescues_a_decaying_spectrum_the_plain_sketch_misses(monkeypatch: pytest.MonkeyPatch) -> None:
    # full rank, singular values 0.85^i: the plain sketch leaves 6% of the top atoms' sum in its residual, one
    # power iteration 2% (under the 5% slack)
    x = _with_spectrum(200, 600, 0.85 ** torch.arange(200.0), seed=6)
    tried = _spy_sketches(monkeypatch)
    u, sigma, vh = AtomoCompressor(3).decompose(x)
    assert tried == [(32, 0, False), (32, 1, True)]
    assert float((u @ torch.diag(sigma) @ vh - x).norm() / x.norm()) < 1e-5


@pytest.mark.parametrize("shape", [(256, 700), (700, 256)])
def test_the_atoms_formed_from_a_sketchs_factors_are_its_full_decompositions(shape: tuple[int, int]) -> None:
    """What the payload carries (only the atoms drawn, formed from the basis's factors) against the same sketch's
    atoms in full: top atoms (below the sketch's rank) and residual ones, in a wide and a tall layer, equal to the
    rounding of the products that form them (float64: one part in 1e12 of a unit vector's entries)."""
    x = _low_rank(*shape, 40, 1e-3, torch.float64, seed=9)
    side = x if shape[0] <= shape[1] else x.T
    test_matrix = torch.randn(side.shape[1], 32, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    atoms = sketched_atoms(side, test_matrix, slack=10.0, power_iterations=0)
    assert atoms is not None
    u, sigma, vh = atoms.dense()
    assert float((u @ torch.diag(sigma) @ vh - side).abs().max()) < 1e-10 * float(side.abs().max())
    kept = torch.tensor([0, 5, 31, 32, 33, 100, side.shape[0] - 1])
    u_rows, vh_rows = atoms.rows(kept)
    assert u_rows.shape == (7, side.shape[0]) and vh_rows.shape == (7, side.shape[1])
    assert float((u_rows - u[:, kept].T).abs().max()) < 1e-12
    assert float((vh_rows - vh[kept]).abs().max()) < 1e-12
    nothing = atoms.rows(torch.empty(0, dtype=torch.long))
    assert nothing[0].shape == (0, side.shape[0]) and nothing[1].shape == (0, side.shape[1])
    # the payload's atoms are those rows of the layer's own decomposition (a tall one's through its transpose)
    compressor, layer = AtomoCompressor(3), x.float()
    payload = compressor.compress(layer, torch.Generator().manual_seed(5))
    full_u, full_sigma, full_vh = compressor.decompose(layer)
    p = compressor.probabilities(full_sigma)
    drawn = torch.nonzero(uniform(torch.Generator().manual_seed(5), p.numel(), p.device, p.dtype) < p).reshape(-1)
    assert payload.atoms == drawn.numel() > 0
    assert torch.allclose(payload.u, full_u[:, drawn].T, atol=1e-5)
    assert torch.allclose(payload.v, full_vh[drawn], atol=1e-5)


@pytest.mark.parametrize("shape", [(256, 700), (700, 256)])
def test_payloads_own_their_atoms_while_the_sketch_buffers_are_reused(shape: tuple[int, int]) -> None:
    atomo = AtomoCompressor(3)
    first_x, second_x = (_low_rank(*shape, 10, 0.0, torch.float32, seed=s) for s in (7, 8))
    first = atomo.compress(first_x, torch.Generator().manual_seed(1))
    sent = first.to_bytes().clone()
    decomposed = [t.clone() for t in atomo.decompose(first_x)]
    atomo.compress(second_x, torch.Generator().manual_seed(2))  # the same shape: the same buffers
    assert torch.equal(first.to_bytes(), sent)
    assert all(torch.equal(a, b) for a, b in zip(decomposed, atomo.decompose(first_x), strict=True))
    assert len(atomo._workspaces) == 1
    again = AtomoCompressor(3).compress(first_x, torch.Generator().manual_seed(1))  # fresh buffers, same atoms
    assert torch.equal(again.to_bytes(), sent)


def test_accumulating_atoms_in_place_equals_adding_their_dense_matrix() -> None:
    x = _low_rank(256, 700, 10, 0.0, torch.float32, seed=9)
    atomo = AtomoCompressor(6)
    payload = atomo.compress(x, torch.Generator().manual_seed(3))
    assert isinstance(payload, AtomoPayload) and payload.atoms >= 2
    base = torch.randn(x.numel(), generator=torch.Generator().manual_seed(4))
    got = atomo.accumulate(payload, base.clone())
    want = base.double() + payload.dense().double().reshape(-1)
    # each entry is base + a dot product of `atoms` terms: float32 rounding of that many terms, relative to their size
    scale = base.abs() + (payload.u.T.abs() @ (payload.coefficients.abs()[:, None] * payload.v.abs())).reshape(-1)
    eps = torch.finfo(torch.float32).eps
    assert bool(((got.double() - want).abs() <= (payload.atoms + 2) * eps * scale.double()).all())
    half = atomo.accumulate(payload, base.half())  # another dtype: the dense matrix, cast, then added
    assert torch.equal(half, base.half() + payload.dense().reshape(-1).half())


def test_sketched_payloads_depend_only_on_the_gradient_and_the_generator() -> None:
    x = _low_rank(256, 700, 10, 1e-6, torch.float32, seed=5)
    first = AtomoCompressor(3).compress(x, torch.Generator().manual_seed(9))
    again = AtomoCompressor(3).compress(x, torch.Generator().manual_seed(9))
    assert isinstance(first, AtomoPayload) and torch.equal(first.to_bytes(), again.to_bytes())


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"decomposition": "svd"}, "decomposition must be one of"),
        ({"decomposition": None}, "decomposition must be one of"),
        ({"sketch_rank": 0}, "sketch_rank"),
        ({"sketch_rank": 2.5}, "sketch_rank"),
        ({"sketch_rank": True}, "sketch_rank"),
    ],
)
def test_bad_decomposition_arguments_are_rejected(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        AtomoCompressor(3, **kwargs)


def _dense_fallback_average(rank: int, world_size: int) -> dict:
    """One step of a layer ATOMO sends dense (a (2, 1000) weight: 2 atoms would cost more than its entries)
    through the hook, memoryless and gathered, against the mean of the ranks' gradients by an allreduce."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1000, 2, bias=False))
    reference = copy.deepcopy(model)
    ddp = DistributedDataParallel(model)
    hook = GradCompHook(
        AtomoCompressor(3),
        NoMemory(),
        "allgather",
        list(model.named_parameters()),
        warmup_steps=0,
        min_compress_numel=0,
    )
    ddp.register_comm_hook(hook, gradcomp_comm_hook)
    x = torch.randn(8, 1000, generator=torch.Generator().manual_seed(rank))
    ddp(x).square().sum().backward()
    reference(x).square().sum().backward()
    expected = reference[0].weight.grad.clone()
    dist.all_reduce(expected)
    return {
        "got": model[0].weight.grad.clone(),
        "expected": expected / world_size,
        "compressed": hook.history[-1].compressed,
    }


def test_a_layer_atomo_sends_dense_averages_to_the_ranks_mean() -> None:
    # catches: the mean decoded over DDP's bucket while this rank's dense payload, a view of it, is still read
    for r in run_ranks(_dense_fallback_average, 2):
        assert r["compressed"]
        torch.testing.assert_close(r["got"], r["expected"], rtol=1e-6, atol=1e-6)
