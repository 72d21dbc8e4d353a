"""Random streams as a pure function of (seed, rank, step, unit): the same draws after any restart.

A generator shared by all units and consumed in the order buckets arrive would hand a unit
different draws whenever DDP's bucket layout differs, as it does between a run and its
resumption. Here every unit's stream is derived afresh, counter-style, from the four numbers
that identify it: a SplitMix64 mix (Steele, Lea, Flood, "Fast splittable pseudorandom number
generators", OOPSLA 2014) of ``seed``, ``rank``, ``step`` and the unit's key seeds the device's
generator just before the unit is compressed. Nothing but ``seed`` and the step counter has to
be checkpointed, and the draws do not depend on which other units exist or in which order they
are compressed. On CUDA the generator is Philox, which a new seed resets at no cost; on CPU it is
a Mersenne twister, whose re-seeding costs about a microsecond.
"""

from __future__ import annotations

import torch

_MASK64 = (1 << 64) - 1
#: The "rank" of streams every rank draws alike (no real rank is 2**64 - 1).
SHARED = _MASK64


def _splitmix64(z: int) -> int:
    z = (z + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def stream_seed(seed: int, rank: int, step: int, key: int) -> int:
    """The 63-bit seed of unit ``key``'s stream on ``rank`` at ``step`` (distinct for each of the four)."""
    z = _splitmix64(seed & _MASK64)
    for part in (rank, step, key):
        z = _splitmix64(z ^ (part & _MASK64))
    return z >> 1


class UnitStreams:
    """One generator per device, re-seeded for each (step, unit) this rank compresses."""

    def __init__(self, seed: int, rank: int) -> None:
        self.seed = seed
        self.rank = rank
        self._generators: dict[torch.device, torch.Generator] = {}

    def generator(self, device: torch.device, step: int, key: int) -> torch.Generator:
        """The generator for unit ``key`` at ``step`` on ``device``, seeded for it alone."""
        generator = self._generators.get(device)
        if generator is None:
            generator = self._generators[device] = torch.Generator(device=device)
        return generator.manual_seed(stream_seed(self.seed, self.rank, step, key))

    def shared(self, device: torch.device, key: int) -> torch.Generator:
        """A generator for unit ``key`` seeded alike on every rank, from the seed and the key alone
        (for state every rank must start with the same: PowerSGD's initial ``Q``)."""
        generator = torch.Generator(device=device)
        return generator.manual_seed(stream_seed(self.seed, SHARED, 0, key))
