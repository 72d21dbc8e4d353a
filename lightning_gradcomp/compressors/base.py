"""The compressor contract: pure tensor math, no collectives, no Lightning.

A compressor turns a flat gradient into a :class:`Payload` and back. Payloads serialise to one
uint8 tensor (:meth:`Payload.to_bytes`) whose size is exactly what goes on the wire, and the
compressor parses such bytes back (:meth:`Compressor.unpack`) knowing only the element count and
dtype, which every rank knows for every layer.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import torch
from torch import Tensor


class Payload(ABC):
    """What one rank sends for one flat tensor of ``numel`` elements."""

    numel: int
    dtype: torch.dtype
    device: torch.device

    @abstractmethod
    def to_bytes(self) -> Tensor:
        """The wire form: a 1-D uint8 tensor, exactly ``nbytes`` long."""

    @property
    @abstractmethod
    def nbytes(self) -> int:
        """Exact size of the wire form in bytes."""


class Compressor(ABC):
    """Compresses flat gradients; subclasses validate their hyper-parameters in ``__init__``.

    Attributes:
        name: the registry name (``compressor="topk"``).
        unbiased: whether ``E[decompress(compress(x))] == x``.
        sparse: whether payloads are (indices, values) pairs that sparse aggregators can merge.
    """

    name: ClassVar[str]
    unbiased: ClassVar[bool]
    sparse: ClassVar[bool] = False

    @abstractmethod
    def compress(self, x: Tensor, generator: torch.Generator | None = None) -> Payload:
        """Compress the flat tensor ``x``; ``generator`` drives any randomness (one per rank)."""

    @abstractmethod
    def unpack(self, buffer: Tensor, numel: int, dtype: torch.dtype) -> Payload:
        """Parse the bytes another rank sent for a tensor of ``numel`` elements of ``dtype``."""

    @abstractmethod
    def accumulate(self, payload: Payload, out: Tensor) -> Tensor:
        """Add the decompressed payload into the flat tensor ``out`` in place and return it."""

    def payload_nbytes(self, numel: int, dtype: torch.dtype) -> int | None:
        """Wire size of any payload for this input, when it depends on nothing else; else ``None``.

        A fixed size lets the allgather skip the exchange of sizes (one collective fewer).
        """
        return None

    def decompress(self, payload: Payload) -> Tensor:
        """The dense flat tensor the payload stands for."""
        return self.accumulate(payload, torch.zeros(payload.numel, dtype=payload.dtype, device=payload.device))

    def __repr__(self) -> str:
        params = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if not k.startswith("_"))
        return f"{type(self).__name__}({params})"
