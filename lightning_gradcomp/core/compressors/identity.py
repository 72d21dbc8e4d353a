"""The identity compressor: the dense baseline through the same hook."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_gradcomp.core.compressors.base import Compressor, Payload
from lightning_gradcomp.core.compressors.draws import Draws
from lightning_gradcomp.core.compressors.wire import ByteReader, to_bytes


@dataclass(frozen=True)
class DensePayload(Payload):
    """The tensor itself."""

    values: Tensor
    shape: torch.Size

    @property
    def dtype(self) -> torch.dtype:  # type: ignore[override]
        return self.values.dtype

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return self.values.device

    @property
    def nbytes(self) -> int:
        return self.values.numel() * self.values.element_size()

    def to_bytes(self) -> Tensor:
        return to_bytes([self.values])

    def cast(self, dtype: torch.dtype) -> DensePayload:
        return DensePayload(self.values.to(dtype), self.shape)

    def wire_nbytes(self, float_itemsize: int) -> int:
        return self.values.numel() * float_itemsize


class IdentityCompressor(Compressor):
    """Sends the tensor unchanged (``compressor="none"``); aggregators all-reduce it."""

    name = "none"
    unbiased = True
    float_wire = True

    def compress(self, x: Tensor, generator: Draws = None, scale: Tensor | None = None) -> DensePayload:
        return DensePayload(x.reshape(-1), x.shape)

    def unpack(self, buffer: Tensor, shape: torch.Size, dtype: torch.dtype) -> DensePayload:
        return DensePayload(ByteReader(buffer).take(shape.numel(), dtype), shape)

    def accumulate(self, payload: Payload, out: Tensor) -> Tensor:
        assert isinstance(payload, DensePayload)
        return out.add_(payload.values)

    def decompress(self, payload: Payload) -> Tensor:
        assert isinstance(payload, DensePayload)
        return payload.values

    def payload_nbytes(self, shape: torch.Size, dtype: torch.dtype) -> int:
        return shape.numel() * torch.empty(0, dtype=dtype).element_size()
