"""The radix select that devices take Top-k by (it runs on any device, so it is held here on the CPU to the CPU's own
selection, :func:`ascending_top_k`, ties included, and to counting each digit's keys one by one)."""

from __future__ import annotations

import pytest
import torch

from lightning_gradcomp.core.compressors.radix import DIGITS, digit_histogram, magnitude_keys, radix_top_k
from lightning_gradcomp.core.compressors.segments import Segments
from lightning_gradcomp.core.compressors.topk import ascending_top_k


def gradient(kind: str, n: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    if kind == "gaussian":
        return torch.randn(n, generator=generator)
    if kind == "ties":  # small integers: the cut falls inside thousands of equal magnitudes, +0.0 and -0.0 among them
        return torch.randint(-3, 4, (n,), generator=generator).float() * torch.randn(n, generator=generator).sign()
    if kind == "neighbours":  # adjacent floats: every key shares its top 22 bits, so the last digit decides
        steps = (torch.randperm(n, generator=generator) % 300).int()
        return (
            torch.full((n,), 1.5).view(torch.int32).add(steps).view(torch.float32)
            * torch.randn(n, generator=generator).sign()
        )
    return torch.zeros(n)


@pytest.mark.parametrize("kind", ["gaussian", "ties", "neighbours", "zeros"])
@pytest.mark.parametrize(("n", "k"), [(1_000, 1), (1_000, 999), (50_000, 500), (2_500_001, 25_000)])
def test_radix_top_k_is_the_cpus_selection_ties_included(kind: str, n: int, k: int) -> None:
    x = gradient(kind, n, seed=n + k)
    assert torch.equal(radix_top_k(x, k), ascending_top_k(x.abs(), k))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_selects_as_its_float32_widening(dtype: torch.dtype) -> None:
    x = torch.randn(100_000, generator=torch.Generator().manual_seed(4)).to(dtype)  # ties among the rounded values
    assert torch.equal(radix_top_k(x, 1_000), ascending_top_k(x.float().abs(), 1_000))


def test_float64_is_left_to_the_caller() -> None:
    assert radix_top_k(torch.randn(100, dtype=torch.float64), 5) is None


def test_a_unit_in_pieces_selects_what_its_concatenation_does() -> None:
    x = gradient("ties", 3_000_000, seed=5)
    parts = [x[:1_000_003], x[1_000_003:1_000_010], x[1_000_010:]]
    assert torch.equal(radix_top_k(Segments(parts), 30_000), radix_top_k(x, 30_000))


def test_non_finite_entries_rank_first() -> None:
    x = torch.randn(10_000, generator=torch.Generator().manual_seed(6))
    x[[5, 700, 9_000]] = torch.tensor([float("nan"), float("inf"), -float("inf")])
    chosen = radix_top_k(x, 100)
    finite = torch.ones(10_000, dtype=torch.bool)
    finite[[5, 700, 9_000]] = False
    rest = torch.nonzero(finite).reshape(-1)
    expected = torch.cat([torch.tensor([5, 700, 9_000]), rest[ascending_top_k(x[rest].abs(), 97)]]).sort().values
    assert torch.equal(chosen, expected)


def test_each_digit_histogram_counts_the_keys_of_its_bin() -> None:
    """Every digit's histogram equals counting, key by key, those whose higher bits are the prefix, across the
    pieces of a tensor longer than a piece."""
    x = gradient("gaussian", 2_300_000, seed=7)
    keys = magnitude_keys(x).long()
    for shift, width in DIGITS[1:]:
        prefix = keys[12_345] >> (shift + width)  # the higher bits of one key: its bin is not empty
        inside = keys[(keys >> (shift + width)) == prefix]
        expected = torch.bincount((inside >> shift) & ((1 << width) - 1), minlength=1 << width).double()
        got = digit_histogram(x, prefix.int().reshape(1), shift, width)
        assert torch.equal(got, expected) and got.sum() > 0
    top_shift, top_width = DIGITS[0]
    assert torch.equal(
        digit_histogram(x, torch.zeros(1, dtype=torch.int32), top_shift, top_width),
        torch.bincount(keys >> top_shift, minlength=1 << top_width).double(),
    )
