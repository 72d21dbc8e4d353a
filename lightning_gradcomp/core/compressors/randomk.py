"""random-k sparsification: ``k`` coordinates drawn uniformly without replacement.

Two uses, one selection:

* ``scaled=True`` (default): the kept values are multiplied by ``d / k``, an unbiased estimator
  (Wangni et al., "Gradient Sparsification for Communication-Efficient Distributed Optimization",
  NeurIPS 2018, with uniform probabilities). Each coordinate is kept with probability ``k / d``,
  so ``E||C(x) - x||^2 = (d / k - 1) ||x||^2`` exactly: :meth:`RandomKCompressor.omega`, which
  lets DIANA (``memory="diana"``) take its shift step from it.
* ``scaled=False``: the kept values as they are, a contraction
  (``E||x - C(x)||^2 = (1 - k/d) ||x||^2``) meant for error feedback (Stich, Cordonnier, Jaggi,
  "Sparsified SGD with Memory", NeurIPS 2018, ``rand_k``).

The coordinates come from the unit's own random stream, so every rank draws its own and payloads
are merged by the allgather (``k`` indices and values each).
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_gradcomp.core.compressors.draws import Draws, random_integers, random_subset
from lightning_gradcomp.core.compressors.sparse import FixedKSparsifier, SparsePayload, k_for
from lightning_gradcomp.core.validation import check_bool, check_density


def sample_indices(d: int, k: int, generator: Draws, device: torch.device) -> Tensor:
    """``k`` distinct indices of ``range(d)``, every ``k``-subset equally likely, in random order.

    For ``k <= d / 4``: the first ``k`` distinct values of i.i.d. uniform draws, in order of first
    appearance (relabelling the values does not change the draws' law, so every ordered ``k``-tuple
    of distinct values is equally likely); ``O(k log k)`` instead of a permutation's ``O(d)``. Fewer
    than ``4 k / 3`` draws are expected, so a second batch is rarely needed. Otherwise the first
    ``k`` of a random permutation.
    """
    if 4 * k > d:
        return random_subset(generator, d, k, device)
    draws = torch.empty(0, dtype=torch.int64, device=device)
    while True:
        more = random_integers(generator, d, k + k // 2 + 16, device)
        draws = torch.cat([draws, more])
        values, inverse = torch.unique(draws, return_inverse=True)
        if values.numel() >= k:
            break
    positions = torch.arange(draws.numel(), device=device)
    first = torch.full_like(values, draws.numel()).scatter_reduce_(0, inverse, positions, "amin")
    return values[first.argsort()[:k]]


class RandomKCompressor(FixedKSparsifier):
    """Keeps ``k = max(1, int(density * d))`` coordinates drawn uniformly without replacement.

    Args:
        density: the fraction ``k / d`` of coordinates kept, in (0, 1].
        scaled: multiply the kept values by ``d / k`` (unbiased; variance ``(d/k - 1) ||x||^2``), or
            send them as they are (biased, for ``memory="ef"``).
    """

    name = "randomk"

    def __init__(self, density: float = 0.01, scaled: bool = True) -> None:
        self.density = check_density("density", density)
        self.scaled = check_bool("scaled", scaled, note="True: unbiased, values x d/k; False: for error feedback")

    @property
    def unbiased(self) -> bool:  # type: ignore[override]
        return self.scaled

    @property
    def bias_reason(self) -> str | None:
        return None if self.scaled else "scaled=False sends the kept values unscaled (for error feedback)"

    def omega(self, numel: int) -> float:
        """Variance bound of the scaled estimator: ``E||C(x) - x||^2 = (d/k - 1) ||x||^2`` (equality)."""
        if numel <= 0:
            return 0.0
        return numel / k_for(numel, self.density) - 1.0

    def compress(self, x: Tensor, generator: Draws = None, scale: Tensor | None = None) -> SparsePayload:
        flat = x.reshape(-1)
        d = flat.numel()
        k = k_for(d, self.density)
        indices = sample_indices(d, k, generator, flat.device)
        values = flat[indices]
        if self.scaled and k < d:
            values = values * (d / k)
        return SparsePayload(indices, values, x.shape)
