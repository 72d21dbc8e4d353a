"""Gaussian_k (threshold from mean and std, refined) and DGC (sampled threshold, exact k) selection."""

from __future__ import annotations

import pytest
import torch

from lightning_gradcomp.core.compressors import blocks as blocks_module
from lightning_gradcomp.core.compressors import gaussiank as gaussiank_module
from lightning_gradcomp.core.compressors.blocks import MagnitudeBlocks
from lightning_gradcomp.core.compressors.dgc import DGCCompressor
from lightning_gradcomp.core.compressors.gaussiank import GaussianKCompressor, normal_quantile, refitted
from lightning_gradcomp.core.compressors.randomk import RandomKCompressor
from lightning_gradcomp.core.compressors.topk import TopKCompressor, ascending_top_k, k_for
from lightning_gradcomp.core.randomness import CounterStream

D = 200_000


def _is_a_top_set(x: torch.Tensor, indices: torch.Tensor) -> bool:
    """Every selected magnitude is at least every unselected one."""
    chosen = torch.zeros(x.numel(), dtype=torch.bool)
    chosen[indices] = True
    if chosen.all() or not chosen.any():
        return True
    return bool(x[chosen].abs().min() >= x[~chosen].abs().max())


def _laplace(seed: int) -> torch.Tensor:
    torch.manual_seed(seed)
    return torch.distributions.Laplace(0.0, 1.0).sample((D,))


def _error_feedback_like(seed: int, density: float, steps: int = 30) -> torch.Tensor:
    """``grad + residual`` after ``steps`` steps of exact Top-k with error feedback on N(0, 1) gradients."""
    gen, k = torch.Generator().manual_seed(seed), k_for(D, density)
    residual = torch.zeros(D)
    for _ in range(steps):
        acc = torch.randn(D, generator=gen) + residual
        residual = acc.index_fill(0, torch.topk(acc.abs(), k).indices, 0.0)
    return torch.randn(D, generator=gen) + residual


SHAPES = {
    "normal": (lambda seed: torch.randn(D, generator=torch.Generator().manual_seed(seed)) * 0.01, 0.001),
    "laplace": (_laplace, 0.01),
    "error_feedback": (lambda seed: _error_feedback_like(seed, 0.001), 0.001),
    "normal_dense": (lambda seed: torch.randn(D, generator=torch.Generator().manual_seed(seed)), 0.01),
}


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_gaussiank_count_lands_between_half_k_and_k_and_keeps_the_largest(shape: str) -> None:
    make, density = SHAPES[shape]
    k = k_for(D, density)
    for seed in range(3):
        x = make(seed)
        indices = GaussianKCompressor(density).select(x)
        assert k / 2 <= indices.numel() <= k, (shape, seed, indices.numel(), k)
        assert torch.equal(indices.sort().values, indices.unique())
        assert _is_a_top_set(x, indices)  # the largest by magnitude, never the first by position


def _counting_passes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The count each streamed pass of a Gaussian_k selection finds, in order."""
    counts: list[int] = []
    original = gaussiank_module.above_in

    def counted(*args: object, **kwargs: object) -> torch.Tensor:
        found = original(*args, **kwargs)
        counts.append(found.numel())
        return found

    monkeypatch.setattr(gaussiank_module, "above_in", counted)
    return counts


def test_with_a_generator_a_sampled_threshold_replaces_the_refit_and_the_short_pass_is_skipped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On error feedback's accumulated tensors the magnitudes pile up just below the last steps' thresholds: the
    Gaussian threshold keeps far fewer than ``k / 2`` and a Gaussian refitted to that tail overshoots past ``k`` (a
    Top-k of the candidates then). With the unit's stream, a sample shows the first pass short before it is made,
    and the threshold it puts at ``3k/4`` lands in the window: one pass instead of two, no Top-k after it."""
    density, k = 0.01, k_for(D, 0.01)
    counts = _counting_passes(monkeypatch)
    for seed in range(3):
        x = _error_feedback_like(seed, density)
        counts.clear()
        refitted_count = GaussianKCompressor(density).select(x).numel()
        first, refit = counts
        assert first < k / 2 and refit > k and refitted_count == k, (seed, counts)
        counts.clear()
        indices = GaussianKCompressor(density).select(x, CounterStream(seed))
        assert len(counts) == 1 and 0.56 * k <= indices.numel() == counts[0] <= 0.94 * k, (seed, counts)
        assert _is_a_top_set(x, indices)


def test_where_the_gaussian_threshold_keeps_enough_the_sample_changes_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    density, k = 0.01, k_for(D, 0.01)
    counts = _counting_passes(monkeypatch)
    for seed in range(3):
        x = torch.randn(D, generator=torch.Generator().manual_seed(seed))
        without = GaussianKCompressor(density).select(x)
        paper = list(counts)
        counts.clear()
        assert torch.equal(GaussianKCompressor(density).select(x, CounterStream(seed)), without), seed
        assert counts == paper and len(paper) == 1 and paper[0] >= k / 2, (seed, paper)  # the paper's pass alone
        counts.clear()


def test_a_pass_is_skipped_only_when_its_count_is_short_beyond_three_deviations() -> None:
    d, s = 1_000_000, 10_000
    sample = torch.cat([torch.full((60,), 2.0), torch.zeros(s - 60)])
    # 60 of 10,000 sampled above: an upper bound of 60 + 3 sqrt(60) + 3 = 86.2 sampled, 8,620 of a million
    assert gaussiank_module.short_of(sample, 1.0, 8_700, d) and not gaussiank_module.short_of(sample, 1.0, 8_600, d)
    assert not gaussiank_module.short_of(torch.zeros(s), 1.0, 300, d)  # none seen: 3 sampled, 300 of a million
    assert gaussiank_module.short_of(torch.zeros(s), 1.0, 301, d)


@pytest.mark.parametrize("kind", ["student_t_1.5", "normal_cubed", "signed_lognormal"])
@pytest.mark.parametrize("density", [0.001, 0.01])
def test_gaussiank_on_heavy_tails_keeps_the_count_in_the_window(kind: str, density: float) -> None:
    torch.manual_seed(0)
    k = k_for(D, density)
    for seed in range(3):
        x = _heavy(kind, seed)
        indices = GaussianKCompressor(density).select(x)
        assert k / 2 <= indices.numel() <= k, (kind, seed, indices.numel(), k)
        assert _is_a_top_set(x, indices)


def _heavy(kind: str, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if kind == "student_t_1.5":  # Student-t with 1.5 degrees of freedom: infinite variance
        return torch.randn(D, generator=gen) / torch.sqrt(torch.distributions.Chi2(1.5).sample((D,)) / 1.5)
    if kind == "normal_cubed":
        return torch.randn(D, generator=gen) ** 3
    return torch.randn(D, generator=gen).exp() * torch.randn(D, generator=gen).sign()  # signed log-normal


@pytest.mark.parametrize(
    "x",
    [
        torch.full((1000,), 2.0),  # sigma = 0: nothing lies above mu, whatever the refinements
        torch.zeros(1000).index_fill_(0, torch.tensor([5]), 3.0),  # one spike
        torch.where(torch.arange(10_000) % 3 == 0, 1.0, -1.0),  # one magnitude everywhere
        torch.randn(10_000, generator=torch.Generator().manual_seed(0)) * 0.01 - 5.0,  # mean far below zero
        torch.tensor([0.0, -1e-30]),
        torch.tensor([4.0]),
    ],
    ids=["constant", "spike", "plus_minus_one", "negative_mean", "tiny", "single"],
)
@pytest.mark.parametrize("density", [0.001, 0.05])
def test_gaussiank_never_selects_nothing_from_a_nonzero_tensor(x: torch.Tensor, density: float) -> None:
    indices = GaussianKCompressor(density).select(x)
    assert 1 <= indices.numel() <= k_for(x.numel(), density)
    assert _is_a_top_set(x, indices)
    assert torch.equal(GaussianKCompressor(density).select(-x).sort().values, indices.sort().values)


def test_gaussiank_selects_nothing_from_zeros_in_a_fixed_size_payload() -> None:
    codec = GaussianKCompressor(0.01)
    payload = codec.compress(torch.zeros(3, 500))
    k = k_for(1500, 0.01)
    # the count, 15 Elias-Fano indices below 1500 (l = 6: 12 + 5 bytes) and 15 float32 slots, whatever the count
    assert k == 15
    assert payload.k == 0 and payload.nbytes == 8 + 17 + k * 4 == codec.payload_nbytes(
        torch.Size([3, 500]), torch.float32
    )
    assert payload.to_bytes().numel() == payload.nbytes
    assert codec.unpack(payload.to_bytes(), torch.Size([3, 500]), torch.float32).k == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gaussiank_payloads_fill_k_slots_whatever_the_count_and_round_trip(dtype: torch.dtype) -> None:
    codec = GaussianKCompressor(0.001)
    size = codec.payload_nbytes(torch.Size([D]), dtype)
    counts = set()
    for seed in range(4):
        x = _error_feedback_like(seed, 0.001, steps=3 * seed).to(dtype)
        payload = codec.compress(x)
        wire = payload.to_bytes()
        counts.add(payload.k)
        assert wire.numel() == payload.nbytes == size  # fixed: no size exchange in the allgather
        back = codec.unpack(wire, x.shape, dtype)
        order = payload.indices.argsort()  # the wire carries the entries in ascending index order
        assert torch.equal(back.indices, payload.indices[order]) and torch.equal(back.values, payload.values[order])
    with pytest.raises(ValueError, match="expected"):
        codec.unpack(torch.zeros(size - 1, dtype=torch.uint8), torch.Size([D]), dtype)
    bad = torch.zeros(size, dtype=torch.uint8)
    bad[:8] = torch.tensor([10**6], dtype=torch.int64).view(torch.uint8)
    with pytest.raises(ValueError, match="claims 1000000 entries"):
        codec.unpack(bad, torch.Size([D]), dtype)


def test_gaussiank_threshold_is_the_papers_formula_and_payloads_round_trip() -> None:
    x = torch.randn(50, 1000, generator=torch.Generator().manual_seed(3)) + 0.2
    codec = GaussianKCompressor(0.01, refinements=0)
    std, mean = torch.std_mean(x, correction=0)
    z = torch.distributions.Normal(0.0, 1.0).icdf(torch.tensor(1 - 0.01 / 2, dtype=torch.float64))
    assert codec.threshold(x.reshape(-1)) == pytest.approx(float(mean.abs() + z * std), rel=1e-5)
    indices = codec.select(x)
    above = torch.nonzero(x.reshape(-1).abs() > codec.threshold(x.reshape(-1))).reshape(-1)
    assert indices.numel() == min(above.numel(), k_for(x.numel(), 0.01))  # cut to the k largest if more
    assert bool(torch.isin(indices, above).all())
    payload = codec.compress(x)
    back = codec.unpack(payload.to_bytes(), x.shape, x.dtype)
    assert torch.equal(back.indices, payload.indices) and torch.equal(back.values, payload.values)
    assert torch.equal(codec.decompress(payload)[indices], x.reshape(-1)[indices])


def test_gaussiank_follows_a_density_changed_between_epochs() -> None:
    x = torch.randn(D, generator=torch.Generator().manual_seed(4))
    codec = GaussianKCompressor(0.01)
    wide = codec.select(x).numel()
    codec.density = 0.001  # what the strategy's density schedule does at an epoch boundary
    narrow = codec.select(x).numel()
    assert 2 * k_for(D, 0.01) / 3 <= wide <= 4 * k_for(D, 0.01) / 3
    assert 2 * k_for(D, 0.001) / 3 <= narrow <= 4 * k_for(D, 0.001) / 3


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"density": 0.0}, r"density must be a number in \(0, 1\], got 0.0"),
        ({"density": 1.5}, r"density must be a number in \(0, 1\], got 1.5"),
        ({"refinements": -1}, r"refinements must be an integer from 0 to 10, got -1"),
        ({"refinements": 2.0}, r"refinements must be an integer from 0 to 10, got 2.0"),
    ],
)
def test_gaussiank_rejects_bad_arguments(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        GaussianKCompressor(**kwargs)


@pytest.mark.parametrize("numel", [0, 1, 63, 64, 65, 1000, 4097])
def test_magnitude_blocks_find_exactly_the_entries_above_a_threshold(numel: int) -> None:
    x = torch.randn(numel, generator=torch.Generator().manual_seed(numel))
    blocks = MagnitudeBlocks(x)
    for thr in (0.0, 0.5, 2.0, 10.0):
        assert torch.equal(blocks.above(thr), torch.nonzero(x.abs() > thr).reshape(-1))
        assert torch.equal(blocks.above(thr, inclusive=True), torch.nonzero(x.abs() >= thr).reshape(-1))


blocks_module_stream = blocks_module.streamed_above


def test_magnitude_blocks_copy_out_few_passing_blocks_and_stream_over_many_across_chunk_edges(monkeypatch) -> None:
    numel = 2 * blocks_module.STREAM_CHUNK + 77
    x = torch.randn(numel, generator=torch.Generator().manual_seed(5))
    x[blocks_module.STREAM_CHUNK - 1 : blocks_module.STREAM_CHUNK + 1] = 9.0  # hits on both sides of a chunk edge
    streamed = []
    monkeypatch.setattr(
        blocks_module, "streamed_above", lambda *args: streamed.append(args[1]) or blocks_module_stream(*args)
    )
    blocks = MagnitudeBlocks(x)
    for thr in (0.5, 2.5, 3.5, 4.5):  # about 95%, 50%, 3% and 0.02% of the blocks of 64 pass
        assert torch.equal(blocks.above(thr, inclusive=True), torch.nonzero(x.abs() >= thr).reshape(-1))
    assert streamed == [0.5, 2.5]  # past one block in eight: one streamed pass; below it, the blocks copied out


@pytest.mark.parametrize(("numel", "density"), [(D, 0.001), (D, 0.01), (50_000, 0.003), (999, 0.01)])
def test_dgc_selects_exactly_k_with_the_exact_topk_values(numel: int, density: float) -> None:
    codec = DGCCompressor(density)
    x = torch.randn(numel, generator=torch.Generator().manual_seed(1)) ** 3
    k = k_for(numel, density)
    payload = codec.compress(x, torch.Generator().manual_seed(2))
    assert payload.k == k and payload.nbytes == codec.payload_nbytes(x.shape, x.dtype)
    assert torch.equal(payload.values.abs().sort(descending=True).values, torch.topk(x.abs(), k).values)
    again = codec.compress(x, torch.Generator().manual_seed(2))
    assert torch.equal(again.indices, payload.indices)


def test_dgc_sample_margin_makes_the_exact_fallback_rare_and_the_fallback_is_exact() -> None:
    x = torch.randn(D, generator=torch.Generator().manual_seed(5))
    k = k_for(D, 0.001)
    expected = torch.topk(x.abs(), k).values
    short = {}
    for margin in (0.0, 3.0):
        codec = DGCCompressor(0.001, margin=margin)
        short[margin] = 0
        for seed in range(20):
            thr = codec.sample_threshold(x, torch.Generator().manual_seed(seed))
            short[margin] += int((x.abs() >= thr).sum()) < k
            indices = codec.select(x, torch.Generator().manual_seed(seed))
            assert indices.numel() == k
            assert torch.equal(x[indices].abs().sort(descending=True).values, expected)
    assert short[0.0] >= 3  # DGC's plain rank leaves too few candidates about half the time
    assert short[3.0] == 0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"density": -0.1}, r"density must be a number in \(0, 1\], got -0.1"),
        ({"sample_ratio": 0.0}, r"sample_ratio must be a number in \(0, 1\], got 0.0"),
        ({"sample_ratio": 2}, r"sample_ratio must be a number in \(0, 1\], got 2"),
        ({"min_samples": 0}, r"min_samples must be an integer >= 1, got 0"),
        ({"margin": -1.0}, r"margin must be a finite number >= 0, got -1.0"),
        ({"margin": float("inf")}, r"margin must be a finite number >= 0, got inf"),
    ],
)
def test_dgc_rejects_bad_arguments(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        DGCCompressor(**kwargs)


@pytest.mark.parametrize("fraction", [0.0001, 0.001, 0.01, 0.5, 1.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_above_finds_exactly_the_entries_beyond_a_threshold_whichever_way_it_takes(
    fraction: float, dtype: torch.dtype
) -> None:
    # 2.3 chunks of the streamed pass; values equal to the threshold, zeros and negative zeros test both comparisons
    x = torch.randn(int(2.3 * blocks_module.STREAM_CHUNK), generator=torch.Generator().manual_seed(3)).to(dtype)
    x[:64] = 0.0
    x[64:128] = -0.0
    thr = float(torch.quantile(x[:100_000].float().abs(), 1 - fraction).to(dtype)) if fraction < 1 else 0.0
    x[200:230] = -thr
    magnitudes = x.abs()
    for inclusive in (False, True):
        expected = torch.nonzero(magnitudes >= thr if inclusive else magnitudes > thr).reshape(-1)
        assert torch.equal(blocks_module.above(x, thr, fraction, inclusive), expected), inclusive
        assert torch.equal(blocks_module.streamed_above(x, thr, inclusive), expected), inclusive
    assert torch.equal(blocks_module.at_least(x, thr, fraction), torch.nonzero(magnitudes >= thr).reshape(-1))
    assert torch.equal(blocks_module.streamed_above(x, -1.0), torch.arange(x.numel()))


@pytest.mark.parametrize("k", [0, 1, 7, 500, 999, 1000, 1200])
def test_ascending_top_k_keeps_the_k_largest_in_order_ties_included(k: int) -> None:
    gen = torch.Generator().manual_seed(k)
    magnitudes = torch.randint(0, 40, (1000,), generator=gen).float()  # many ties at every cut
    got = ascending_top_k(magnitudes, k)
    assert got.numel() == min(k, 1000) and bool((got[1:] > got[:-1]).all())
    expected = torch.topk(magnitudes, min(k, 1000)).values
    assert torch.equal(magnitudes[got].sort(descending=True).values, expected)  # the same multiset of magnitudes
    # ties at the cut go to the first positions: the k first of a stable sort by descending magnitude
    reference = torch.sort(magnitudes, descending=True, stable=True).indices[: min(k, 1000)].sort().values
    assert torch.equal(got, reference)
    with_nan = magnitudes.clone()
    with_nan[3] = float("nan")
    if 0 < k < 1000:  # a NaN ranks first, as torch.topk ranks it
        nan_kept = ascending_top_k(with_nan, k)
        assert 3 in nan_kept.tolist() and nan_kept.numel() == k and bool((nan_kept[1:] > nan_kept[:-1]).all())


@pytest.mark.parametrize("size", [1000, 100_000])  # below and above kth_smallest's band
def test_ascending_top_k_without_ties_at_the_cut_is_the_k_largest(size: int) -> None:
    gen = torch.Generator().manual_seed(size)
    magnitudes = torch.randperm(size, generator=gen).float()  # distinct: the cut's entry alone is dropped
    for k in (1, size // 100, size // 2, size - 1):
        expected = torch.topk(magnitudes, k).indices.sort().values
        assert torch.equal(ascending_top_k(magnitudes, k), expected), k


@pytest.mark.parametrize(("centre", "spread"), [(0.0, 1.0), (0.3, 2.0), (1e-4, 3e-3)])
def test_the_refitted_threshold_is_the_gaussians_quantile_for_the_target(centre: float, spread: float) -> None:
    d, seen, target = 10**6, 400, 7_500
    thr = centre + spread * normal_quantile(1 - seen / (2 * d))  # where a Gaussian of this spread keeps `seen`
    expected = centre + spread * normal_quantile(1 - target / (2 * d))
    assert refitted(thr, centre, seen, target, d) == pytest.approx(expected, rel=1e-12)
    assert refitted(thr, centre, 0, target, d) is None  # nothing found: nothing to fit
    assert refitted(centre, centre, seen, target, d) is None


@pytest.mark.parametrize("numel", [64 * 1000, 64 * 1000 + 5])  # with and without a partial last block
def test_a_nan_passes_every_threshold_through_block_maxima_as_through_the_streamed_pass(numel: int) -> None:
    """Catches: a block whose maximum is NaN (it holds one) compared ``>`` a threshold, which is False, so that block
    maxima dropped the NaN that the streamed pass keeps; Top-k's payload then vouches for a tensor it never read."""
    x = torch.randn(numel, generator=torch.Generator().manual_seed(8))
    x[[70, 5000, numel - 1]] = torch.tensor([float("nan"), float("nan"), float("nan")])
    blocks = MagnitudeBlocks(x)
    for thr in (3.5, 100.0):
        for inclusive in (False, True):
            found = blocks.above(thr, inclusive)
            assert torch.equal(found, blocks_module.streamed_above(x, thr, inclusive)), (thr, inclusive)
            assert {70, 5000, numel - 1} <= set(found.tolist())


@pytest.mark.parametrize("density", [0.0005, 0.01])  # candidates through block maxima, and by the streamed pass
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_top_k_sends_a_non_finite_element_whenever_there_is_one_so_its_entries_vouch_for_the_tensor(
    density: float, bad: float
) -> None:
    """Catches: error feedback skipping its sum over the compensated tensor on the word of a selection that may leave
    a NaN or an infinity out (every Top-k path must select one; Gaussian_k's and random-k's do not vouch)."""
    numel = 200_000
    codec = TopKCompressor(density)
    for where in (0, 12_345, numel - 1):
        x = torch.randn(numel, generator=torch.Generator().manual_seed(where))
        x[where] = bad
        for generator in (CounterStream(where), None):  # the sampled threshold, and torch.topk
            entries = codec.compress(x, generator).entries()
            assert entries.vouches_finite and not entries.all_finite(), (where, generator)
            parts = entries.split([numel // 2, numel - numel // 2])  # two parameters of one unit
            assert all(p.vouches_finite and not p.all_finite() for p in parts)  # each reports the whole selection
        clean = codec.compress(torch.randn(numel), CounterStream(1)).entries()
        assert clean.vouches_finite and clean.all_finite()
    assert DGCCompressor(density).compress(x, CounterStream(2)).entries().vouches_finite
    assert not GaussianKCompressor(density).compress(x, CounterStream(3)).entries().vouches_finite
    assert not RandomKCompressor(density).compress(x, CounterStream(4)).entries().vouches_finite
