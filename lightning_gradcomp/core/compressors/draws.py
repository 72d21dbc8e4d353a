"""Random draws from either kind of stream a compressor is handed: the library's counter-based
:class:`~lightning_gradcomp.core.randomness.CounterStream` (a pure function of seed, rank, step, unit and element:
the same on every device, compiled or eager), or a ``torch.Generator`` (a test's, a user's), used as torch does.
``None`` is torch's global generator."""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_gradcomp.core.randomness import CounterStream, unsigned_of

__all__ = ["Draws", "random_bytes", "random_integers", "random_subset", "stratified_positions", "uniform"]

#: What a compressor's ``generator`` argument may be.
Draws = torch.Generator | CounterStream | None


def uniform(draws: Draws, count: int, device: torch.device, dtype: torch.dtype = torch.float32) -> Tensor:
    """``count`` uniforms on ``[0, 1)``."""
    if isinstance(draws, CounterStream):
        return draws.uniform(count, dtype).to(device)
    return torch.rand(count, generator=draws, device=device, dtype=dtype)


def random_bytes(draws: Draws, count: int, device: torch.device) -> Tensor:
    """``count`` uniform bytes (uint8)."""
    if isinstance(draws, CounterStream):
        return draws.bytes(count).to(device)
    words = torch.empty(-(-count // 8), dtype=torch.int64, device=device)
    return words.random_(-(2**63), None, generator=draws).view(torch.uint8)[:count]


def random_integers(draws: Draws, high: int, count: int, device: torch.device) -> Tensor:
    """``count`` uniform integers in ``[0, high)`` (int64)."""
    if isinstance(draws, CounterStream):
        return draws.integers(high, count).to(device)
    return torch.randint(high, (count,), generator=draws, device=device)


def stratified_positions(draws: Draws, high: int, count: int, device: torch.device) -> Tensor:
    """``count <= high`` ascending positions in ``[0, high)`` (int64), one in each of ``count`` strata
    ``[l_i, l_{i+1})``, ``l_i = floor(i high / count)``: ``l_i + floor(b w_i / 2^32)`` of one 32-bit draw ``b`` (``w_i``
    the stratum's width; Lemire, ACM TOMACS 2019, Sec. 3, without the rejection: within ``w_i / 2^32`` of uniform,
    relatively).

    A stratified sample (Cochran, *Sampling Techniques*, 3rd ed., 1977, Sec. 5.1) for a threshold placed by the
    sample's ranks: the number of sampled entries among any set of entries is a sum of independent Bernoulli draws,
    one per stratum, whose variance is at most the binomial one of independent positions, which the margins are set
    by. Its positions come in order, so a unit read in pieces is gathered in runs (``benchmarks/kernel_costs.py``:
    65,536 positions of 25,000,000 entries in two pieces)."""
    if not 0 < count <= high:
        raise ValueError(f"count must be an integer in [1, high={high}], got {count}")
    strata = torch.arange(count + 1, dtype=torch.int64, device=device)
    whole, rest = divmod(high, count)
    lows = strata * whole + strata * rest // count  # floor(i high / count), without the product i * high
    widths = lows[1:] - lows[:-1]
    if whole + 1 >= 1 << 31:  # strata too wide for a 32-bit draw times a width in int64: a 53-bit uniform each
        if isinstance(draws, CounterStream):
            u53 = draws.bits53(count).to(device).double().mul_(2.0**-53)
        else:
            u53 = torch.rand(count, generator=draws, device=device, dtype=torch.float64)
        return lows[:-1] + torch.minimum((u53 * widths).long(), widths - 1)  # a product may round up to its width
    if isinstance(draws, CounterStream):
        bits = unsigned_of(draws.bits(count)).to(device)
    else:
        bits = torch.randint(1 << 32, (count,), generator=draws, device=device)
    return lows[:-1] + (bits * widths >> 32)


def random_subset(draws: Draws, d: int, k: int, device: torch.device) -> Tensor:
    """``k`` distinct indices of ``range(d)``, every ``k``-subset equally likely, in random order: a permutation's first
    ``k`` (a counter stream's: the ``k`` smallest of ``d`` random 53-bit keys)."""
    if isinstance(draws, CounterStream):  # 53-bit keys: a tie (which topk breaks by position) has chance d^2 / 2^54
        return torch.topk(draws.bits53(d).to(device), k, largest=False, sorted=True).indices
    return torch.randperm(d, generator=draws, device=device)[:k]
