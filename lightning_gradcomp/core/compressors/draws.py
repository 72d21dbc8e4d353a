"""Random draws from either kind of stream a compressor is handed: the library's counter-based
:class:`~lightning_gradcomp.core.randomness.CounterStream` (a pure function of seed, rank, step, unit and element:
the same on every device, compiled or eager), or a ``torch.Generator`` (a test's, a user's), used as torch does.
``None`` is torch's global generator."""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_gradcomp.core.randomness import CounterStream

__all__ = ["Draws", "random_bytes", "random_integers", "random_positions", "random_subset", "uniform"]

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


def random_positions(draws: Draws, high: int, count: int, device: torch.device) -> Tensor:
    """``count`` integers in ``[0, high)`` (int64) for a sample of positions: a counter stream's from one 32-bit draw
    each (:meth:`~lightning_gradcomp.core.randomness.CounterStream.positions`, uniform to ``high / 2^32``), a
    generator's as :func:`random_integers`."""
    if isinstance(draws, CounterStream):
        return draws.positions(high, count).to(device)
    return random_integers(draws, high, count, device)


def random_subset(draws: Draws, d: int, k: int, device: torch.device) -> Tensor:
    """``k`` distinct indices of ``range(d)``, every ``k``-subset equally likely, in random order: a permutation's first
    ``k`` (a counter stream's: the ``k`` smallest of ``d`` random 53-bit keys)."""
    if isinstance(draws, CounterStream):  # 53-bit keys: a tie (which topk breaks by position) has chance d^2 / 2^54
        return torch.topk(draws.bits53(d).to(device), k, largest=False, sorted=True).indices
    return torch.randperm(d, generator=draws, device=device)[:k]
