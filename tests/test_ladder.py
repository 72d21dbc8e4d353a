"""The ladder of magnitude levels that GPUs select Top-k and Gaussian_k candidates from (it runs on any device, so
it is checked here on the CPU, against ``torch.topk`` and against counting each level's mask)."""

from __future__ import annotations

import pytest
import torch

from lightning_gradcomp.core.compressors import ladder
from lightning_gradcomp.core.compressors.ladder import (
    LEVELS,
    gaussian_centre,
    gaussian_k_by_levels,
    level_counts,
    log_levels,
    select_at_level,
    top_k_by_levels,
)
from lightning_gradcomp.core.compressors.segments import Segments


def draws(kind: str, n: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    if kind == "gaussian":
        return torch.randn(n, generator=generator)
    if kind == "laplace":  # heavy tails, as error feedback's accumulators have
        u = torch.rand(n, generator=generator, dtype=torch.float64) - 0.5
        return (-u.sign() * torch.log1p(-2 * u.abs())).float()
    # small integers (many ties) and a few larger entries, or (``outliers``) huge ones that lift the centre far
    # above the bulk
    x = torch.randint(-3, 4, (n,), generator=generator).float()
    x[torch.randperm(n, generator=generator)[:50]] = 1e6 if kind == "outliers" else 10.0
    return x


@pytest.mark.parametrize("kind", ["gaussian", "laplace"])
@pytest.mark.parametrize(("n", "density"), [(1_000_000, 0.01), (300_007, 0.001), (5000, 0.0002)])
def test_top_k_by_levels_is_torch_topk(kind: str, n: int, density: float) -> None:
    x = draws(kind, n, seed=n)
    k = max(1, int(density * n))
    chosen = top_k_by_levels(x, k, density)
    assert chosen is not None
    assert torch.equal(chosen, torch.topk(x.abs(), k).indices.sort().values)  # continuous draws: no ties


def test_top_k_by_levels_reads_pieces_and_chunks_as_one_tensor(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ladder, "STREAM_CHUNK", 4096)  # many chunks per piece, pieces that end mid-chunk
    x = draws("laplace", 100_003, seed=7)
    pieces = Segments([x[:10_001], x[10_001:10_002], x[10_002:]])
    expected = torch.topk(x.abs(), 1000).indices.sort().values
    assert torch.equal(top_k_by_levels(pieces, 1000, 0.01), expected)
    assert torch.equal(top_k_by_levels(x, 1000, 0.01), expected)


def test_each_level_count_is_its_masks_size() -> None:
    x = draws("ties", 200_000, seed=1)
    centre, _ = gaussian_centre(x, 0.01)
    counts = level_counts(x, centre)
    v = log_levels(x, centre)
    expected = torch.tensor([int((v >= j).sum()) for j in range(LEVELS)], dtype=torch.float64)
    assert torch.equal(counts, expected) and counts[0] > 0
    for j in (0, 37, int((counts >= 100).sum()) - 1):
        level = torch.tensor(float(j))
        assert torch.equal(select_at_level(x, centre, level, int(counts[j])), torch.nonzero(v >= j).reshape(-1))


def test_ties_at_the_cut_still_give_k_of_the_largest() -> None:
    x = draws("ties", 100_000, seed=2)
    k = 10_000  # the 50 entries of 10, then 9950 of the 28,600 entries at |x| = 3
    chosen = top_k_by_levels(x, k, k / x.numel())
    assert chosen is not None and chosen.numel() == k and torch.equal(chosen, chosen.unique())
    magnitudes = x.abs()
    kept = torch.zeros_like(x, dtype=torch.bool)
    kept[chosen] = True
    assert float(magnitudes[kept].min()) >= float(magnitudes[~kept].max()) == 3.0


@pytest.mark.parametrize("kind", ["gaussian", "laplace"])
def test_gaussian_k_by_levels_keeps_between_half_and_k_of_the_largest(kind: str) -> None:
    x = draws(kind, 1_000_000, seed=3)
    for density in (0.01, 0.001):
        k = int(density * x.numel())
        chosen = gaussian_k_by_levels(x, k, density, 0.5)
        assert chosen is not None and k / 2 <= chosen.numel() <= k
        kept = torch.zeros_like(x, dtype=torch.bool)
        kept[chosen] = True
        assert float(x.abs()[kept].min()) > float(x.abs()[~kept].max())
        assert torch.equal(chosen, torch.nonzero(kept).reshape(-1))  # ascending


def test_the_ladder_declines_what_it_cannot_answer() -> None:
    nan = torch.randn(10_000)
    nan[5] = float("nan")
    assert top_k_by_levels(nan, 10, 0.001) is None and gaussian_k_by_levels(nan, 10, 0.001, 0.5) is None
    assert gaussian_k_by_levels(torch.zeros(10_000), 10, 0.001, 0.5) is None
    # k beyond the entries that reach the lowest level (centre / 16): most entries are far below the centre
    sparse = torch.zeros(10_000)
    sparse[:3] = 1.0
    assert top_k_by_levels(sparse, 10, 0.001) is None
    # the same where 50 huge entries lift the centre (Gaussian_k's threshold) far above the entries of 3 that k needs
    assert top_k_by_levels(draws("outliers", 100_000, seed=2), 3000, 0.03) is None


def test_host_waits_counts_nothing_off_cuda() -> None:
    from lightning_gradcomp.core.host_waits import host_waits

    assert host_waits(lambda: torch.ones(3).sum().item(), "cpu") is None


def test_a_misspelt_device_selection_is_refused_by_name() -> None:
    from lightning_gradcomp.core.compressors import TopKCompressor

    codec = TopKCompressor(0.01)
    codec.device_selection = "level"
    with pytest.raises(
        ValueError, match=r"device_selection must be one of \['torch.topk', 'radix', 'levels'\], got 'level'"
    ):
        codec.select_k(torch.empty(1000, device="meta"), 10)  # off the CPU, where the choice is read


def test_histograms_are_refused_off_the_cpu_only_under_deterministic_algorithms() -> None:
    from lightning_gradcomp.core.compressors.ladder import histc_refused

    assert not histc_refused(torch.device("cuda")) and not histc_refused(torch.device("cpu"))
    torch.use_deterministic_algorithms(True)
    try:
        assert histc_refused(torch.device("cuda")) and not histc_refused(torch.device("cpu"))
    finally:
        torch.use_deterministic_algorithms(False)
