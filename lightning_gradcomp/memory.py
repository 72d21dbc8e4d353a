"""State carried between steps, per parameter name: nothing, or an error-feedback residual.

The hook calls, for each compressed parameter ``name`` and step:

1. ``x = memory.compensate(name, grad)``: the tensor handed to the compressor;
2. ``memory.reconstruct(name, mean)``: after aggregation, the gradient the optimizer sees, from
   the averaged result ``mean`` and the state as it was before this step;
3. ``memory.update(name, x, sent, mean)``: then the state moves on, with ``sent`` the dense form
   of what of this rank's payload reached the global result.

State is keyed by parameter name because DDP rebuilds its buckets after the first iteration.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

from torch import Tensor


class Memory(ABC):
    """Per-parameter compression state."""

    name: ClassVar[str]

    @abstractmethod
    def compensate(self, name: str, grad: Tensor) -> Tensor:
        """The tensor to compress for parameter ``name`` this step (``grad`` is flat)."""

    @abstractmethod
    def update(self, name: str, compensated: Tensor, sent: Tensor, mean: Tensor) -> None:
        """Record what happened to ``compensated``: ``sent`` reached the result, averaged to ``mean``."""

    def reconstruct(self, name: str, mean: Tensor) -> Tensor:
        """The gradient estimate for the optimizer from the aggregated ``mean``."""
        return mean

    @abstractmethod
    def state_dict(self) -> dict[str, Tensor]:
        """This rank's state, by parameter name."""

    @abstractmethod
    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        """Restore what :meth:`state_dict` returned."""


class NoMemory(Memory):
    """Memoryless: compress the gradient itself (``memory="none"``)."""

    name = "none"

    def compensate(self, name: str, grad: Tensor) -> Tensor:
        return grad

    def update(self, name: str, compensated: Tensor, sent: Tensor, mean: Tensor) -> None:
        return None

    def state_dict(self) -> dict[str, Tensor]:
        return {}

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        if state:
            raise ValueError(f"memory 'none' holds no state, got entries for {sorted(state)}")


class ErrorFeedback(Memory):
    """Error feedback (``memory="ef"``): ``acc = grad + residual``; ``residual = acc - sent``.

    What a biased compressor drops is added to the next step's gradient instead of being lost
    (Shi et al., ICDCS 2019, Algorithm 1; ALGORITHMS.md Sec. 4). For a sparsifier ``sent`` equals
    ``acc`` where it is nonzero, so ``sent + residual == acc`` holds exactly.
    """

    name = "ef"

    def __init__(self) -> None:
        self._residuals: dict[str, Tensor] = {}

    def compensate(self, name: str, grad: Tensor) -> Tensor:
        residual = self._residuals.get(name)
        if residual is None:
            return grad.clone()
        if residual.shape != grad.shape:
            raise ValueError(
                f"residual for {name!r} has shape {tuple(residual.shape)} but its gradient has {tuple(grad.shape)}"
            )
        return grad + residual

    def update(self, name: str, compensated: Tensor, sent: Tensor, mean: Tensor) -> None:
        residual = self._residuals.get(name)
        if residual is None or residual.shape != compensated.shape or residual.dtype != compensated.dtype:
            self._residuals[name] = compensated - sent
        else:
            residual.copy_(compensated).sub_(sent)

    def residual(self, name: str) -> Tensor | None:
        """The current residual of parameter ``name`` (``None`` before its first compressed step)."""
        return self._residuals.get(name)

    def state_dict(self) -> dict[str, Tensor]:
        return {name: r.clone() for name, r in self._residuals.items()}

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        self._residuals = {name: r.clone() for name, r in state.items()}


MEMORIES: dict[str, type[Memory]] = {cls.name: cls for cls in (NoMemory, ErrorFeedback)}


def build_memory(name: str) -> Memory:
    """A fresh memory from its registry name."""
    if not isinstance(name, str) or name not in MEMORIES:
        raise ValueError(f"memory must be one of {sorted(MEMORIES)}, got {name!r}")
    return MEMORIES[name]()
