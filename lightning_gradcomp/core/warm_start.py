"""Per-unit state a compressor carries from one step to the next (PowerSGD's ``Q``), kept by the hook.

Memory (:mod:`lightning_gradcomp.core.memory`) is per rank: residuals and shifts differ across ranks.
A warm start is the compressor's own iterate and is the same on every rank: it starts from a
generator seeded from the strategy's seed and the unit alone
(:meth:`~lightning_gradcomp.core.randomness.UnitStreams.shared`), and the compressor moves it on with
the aggregated result, which every rank holds alike. It is keyed by the unit's label (its
parameters' names), not by a DDP bucket, and is part of every rank's checkpoint shard, so a
resumed run continues from the very same iterate.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_gradcomp.core.compressors import Compressor
from lightning_gradcomp.core.randomness import UnitStreams
from lightning_gradcomp.core.units import Unit


class WarmStarts:
    """The warm starts of ``compressor`` for every unit it compresses, created at the unit's first compressed step."""

    def __init__(self, compressor: Compressor, streams: UnitStreams) -> None:
        self.compressor = compressor
        self.streams = streams
        self._states: dict[str, Tensor] = {}
        self._stateless: set[str] = set()  # units the compressor keeps no state for (e.g. sent dense)

    def arguments(self, unit: Unit, x: Tensor) -> dict[str, Tensor]:
        """The keyword arguments of ``compressor.compress`` for ``unit``'s tensor ``x``: ``{"warm_start": Q}``
        for a warm-started compressor with state for this shape, else nothing."""
        if not self.compressor.warm_started or unit.label in self._stateless:
            return {}
        state = self._states.get(unit.label)
        if state is None:
            generator = self.streams.shared(x.device, unit.key)
            state = self.compressor.initial_state(unit.shapes, x.dtype, x.device, generator)
            if state is None:
                self._stateless.add(unit.label)
                return {}
            self._states[unit.label] = state
        elif state.device != x.device or state.dtype != x.dtype:  # loaded from a checkpoint on the CPU
            state = self._states[unit.label] = state.to(device=x.device, dtype=x.dtype)
        return {"warm_start": state}

    def state_dict(self) -> dict[str, Tensor]:
        """Every unit's warm start by unit label, on the CPU (small: ``m x r`` per matrix for PowerSGD)."""
        return {label: state.detach().cpu() for label, state in self._states.items()}

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        """Restore :meth:`state_dict`'s output (moved to the gradient's device at first use)."""
        if not all(isinstance(value, torch.Tensor) for value in state.values()):
            raise ValueError("warm starts must be tensors keyed by unit label")
        self._states = {label: value.clone() for label, value in state.items()}
