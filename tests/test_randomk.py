"""random-k: exact selection and scaling, unbiasedness and its variance (d/k - 1) ||x||^2 measured,
wire size, arguments; on real ranks with error feedback (the invariant) and DIANA (ranks identical)."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from ranks import run_ranks
from test_hook import RecordingErrorFeedback, _make_hook, _train
from test_terngrad import Z_LIMIT, assert_unbiased

from lightning_gradcomp import GradCompStrategy
from lightning_gradcomp.core.compressors import RandomKCompressor, SparsePayload
from lightning_gradcomp.core.compressors.randomk import sample_indices
from lightning_gradcomp.core.memory import Diana


@pytest.mark.parametrize("bad", [0, -0.1, 1.5, math.nan, "0.1", True])
def test_bad_density_is_rejected(bad: object) -> None:
    with pytest.raises(ValueError, match=r"density must be a number in \(0, 1\], got"):
        RandomKCompressor(density=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [1, 0, "yes", None])
def test_bad_scaled_is_rejected(bad: object) -> None:
    message = r"^scaled must be True or False \(True: unbiased, values x d/k; False: for error feedback\), got "
    with pytest.raises(ValueError, match=message):
        RandomKCompressor(scaled=bad)  # type: ignore[arg-type]


def test_keeps_k_distinct_coordinates_scaled_by_d_over_k() -> None:
    x = torch.randn(40, 25, generator=torch.Generator().manual_seed(0))
    for scaled, factor in ((True, 1000 / 50), (False, 1.0)):
        payload = RandomKCompressor(0.05, scaled=scaled).compress(x, torch.Generator().manual_seed(1))
        assert payload.k == 50 and payload.indices.unique().numel() == 50
        assert torch.equal(payload.values, x.reshape(-1)[payload.indices] * factor)
    # the same stream draws the same coordinates, another stream others
    draw = RandomKCompressor(0.05).compress
    assert torch.equal(draw(x, torch.Generator().manual_seed(1)).indices, payload.indices)
    assert not torch.equal(draw(x, torch.Generator().manual_seed(2)).indices, payload.indices)
    # density 1 sends everything, unscaled
    everything = RandomKCompressor(1.0).compress(x, torch.Generator().manual_seed(1))
    assert torch.equal(RandomKCompressor(1.0).decompress(everything), x.reshape(-1))


@pytest.mark.parametrize(("d", "k"), [(8, 2), (6, 3)])
def test_every_k_subset_is_equally_likely(d: int, k: int) -> None:
    """Chi-square over all C(d, k) subsets, for the sampler of first distinct draws (k <= d / 4) and the
    permutation (k > d / 4); the 0.9999 quantile bounds the statistic of a uniform law (a test that
    fails once in 10^4 runs by chance; the seed is fixed, so it never flakes)."""
    subsets = {s: i for i, s in enumerate(itertools.combinations(range(d), k))}
    trials, gen = 1000 * len(subsets), torch.Generator().manual_seed(d)
    counts = torch.zeros(len(subsets))
    for _ in range(trials):
        indices = sample_indices(d, k, gen, torch.device("cpu"))
        assert indices.numel() == k and indices.unique().numel() == k
        counts[subsets[tuple(sorted(indices.tolist()))]] += 1
    expected = trials / len(subsets)
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    df = len(subsets) - 1  # the chi-square 0.9999 quantile, Wilson-Hilferty (within 1% at these df)
    limit = df * (1 - 2 / (9 * df) + 3.719 * math.sqrt(2 / (9 * df))) ** 3
    assert chi2 < limit, (chi2, limit)


def test_scaled_is_unbiased_with_the_exact_variance_bound() -> None:
    d, trials = 64, 20_000
    x = torch.randn(d, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    compressor = RandomKCompressor(0.125)  # k = 8
    gen = torch.Generator().manual_seed(4)
    total, errors = torch.zeros(d, dtype=torch.float64), torch.empty(trials, dtype=torch.float64)
    for t in range(trials):
        decoded = compressor.decompress(compressor.compress(x, gen))
        total += decoded
        errors[t] = (decoded - x).pow(2).sum()
    # each coordinate is (d/k) x_j with probability k/d, else 0
    assert_unbiased(total, x, x.abs() * 8, trials)
    omega = compressor.omega(d)
    assert omega == 64 / 8 - 1
    expected = omega * float(x.pow(2).sum())  # an equality for random-k, not only a bound
    tolerance = Z_LIMIT * float(errors.std()) / math.sqrt(trials)
    assert abs(float(errors.mean()) - expected) <= tolerance, (float(errors.mean()), expected, tolerance)
    assert compressor.unbiased and compressor.bias_reason is None
    unscaled = RandomKCompressor(0.125, scaled=False)
    assert not unscaled.unbiased and "scaled=False" in unscaled.bias_reason


def test_wire_size_is_k_indices_and_values() -> None:
    x = torch.randn(3000, generator=torch.Generator().manual_seed(5))
    compressor = RandomKCompressor(0.01)
    payload = compressor.compress(x, torch.Generator().manual_seed(6))
    wire = payload.to_bytes()
    # the count, 30 Elias-Fano indices below 3000 (l = 6: 23 bytes of low bits, 10 of high parts), 30 float32 values
    assert wire.numel() == payload.nbytes == compressor.payload_nbytes(x.shape, x.dtype) == 8 + 23 + 10 + 30 * 4
    back = compressor.unpack(wire, x.shape, x.dtype)
    assert isinstance(back, SparsePayload)
    assert torch.equal(compressor.decompress(back), compressor.decompress(payload))


def test_diana_takes_its_shift_step_from_the_variance_and_refuses_the_unscaled_form() -> None:
    strategy = GradCompStrategy(compressor="randomk", memory="diana", aggregator="allgather", density=0.1)
    assert isinstance(strategy.memory, Diana)
    assert strategy.memory.alpha_for(1000) == pytest.approx(1 / (1000 / 100))  # 1 / (omega + 1) = k / d
    with pytest.raises(ValueError, match="scaled=False"):
        GradCompStrategy(compressor="randomk", memory="diana", compressor_kwargs={"scaled": False})


def _with_error_feedback(rank: int, world_size: int) -> dict:
    memory = RecordingErrorFeedback()
    model, _ = _train(rank, world_size, _make_hook(RandomKCompressor(0.05, scaled=False), memory, "layer", warmup=1))
    return {"log": memory.log, "weights": model.state_dict()}


def _with_diana(rank: int, world_size: int) -> dict:
    hook_factory = _make_hook(RandomKCompressor(0.1), Diana(variance_bound=RandomKCompressor(0.1).omega), "layer")
    model, hook = _train(rank, world_size, hook_factory)
    return {"weights": model.state_dict(), "compressed": sum(s.compressed for s in hook.history)}


@pytest.mark.parametrize("world_size", [2, 3])
def test_on_real_ranks_error_feedback_is_exact_and_ranks_agree(world_size: int) -> None:
    results = run_ranks(_with_error_feedback, world_size)
    for r in results:
        assert r["log"], "the compressed path never ran"
        for e in r["log"]:
            old = torch.zeros_like(e["grad"]) if e["old"] is None else e["old"]
            assert torch.equal(e["sent"] + e["new"], e["grad"] + old)
            assert int(e["sent"].count_nonzero()) <= math.ceil(0.05 * e["grad"].numel())
    # each rank drew its own coordinates, yet every rank applied the same average
    assert not torch.equal(results[0]["log"][0]["sent"] != 0, results[1]["log"][0]["sent"] != 0)
    for r in results[1:]:
        for name, value in r["weights"].items():
            assert torch.equal(value, results[0]["weights"][name]), name
    diana = run_ranks(_with_diana, world_size)
    assert diana[0]["compressed"] > 0
    for r in diana[1:]:
        for name, value in r["weights"].items():
            assert torch.equal(value, diana[0]["weights"][name]), name
