"""The identity compressor: the dense baseline through the same hook."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_gradcomp.core.compressors.base import Compressor, Payload
from lightning_gradcomp.core.compressors.draws import Draws
from lightning_gradcomp.core.compressors.segments import Segments
from lightning_gradcomp.core.compressors.wire import ByteReader, to_bytes
from lightning_gradcomp.core.workspace import Scratch


@dataclass(frozen=True)
class DensePayload(Payload):
    """The tensor itself: flat, or the pieces of a unit where DDP's buckets hold them (:class:`Segments`)."""

    values: Tensor | Segments
    shape: torch.Size

    @property
    def dtype(self) -> torch.dtype:  # type: ignore[override]
        return self.values.dtype

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return self.values.device

    @property
    def nbytes(self) -> int:
        return self.values.numel() * torch.empty(0, dtype=self.values.dtype).element_size()

    def flat(self) -> Tensor:
        """The values as one flat tensor (pieces joined into a new one)."""
        return self.values.joined() if isinstance(self.values, Segments) else self.values

    def to_bytes(self) -> Tensor:
        return to_bytes(self.values.parts if isinstance(self.values, Segments) else [self.values])

    def cast(self, dtype: torch.dtype) -> DensePayload:
        return DensePayload(self.flat().to(dtype), self.shape)

    def wire_nbytes(self, float_itemsize: int) -> int:
        return self.values.numel() * float_itemsize


class IdentityCompressor(Compressor):
    """Sends the tensor unchanged (``compressor="none"``); aggregators all-reduce it. A unit of several parameters is
    read where DDP's buckets hold them (:class:`Segments`): its summand is joined and scaled in one pass, with no flat
    copy of the unit before it."""

    name = "none"
    unbiased = True
    float_wire = True
    takes_segments = True

    def compress(self, x: Tensor | Segments, generator: Draws = None, scale: Tensor | None = None) -> DensePayload:
        return DensePayload(x.reshape(-1), x.shape)

    def unpack(self, buffer: Tensor, shape: torch.Size, dtype: torch.dtype) -> DensePayload:
        return DensePayload(ByteReader(buffer).take(shape.numel(), dtype), shape)

    def accumulate(self, payload: Payload, out: Tensor | Segments) -> Tensor | Segments:
        assert isinstance(payload, DensePayload)
        if isinstance(out, Segments):
            flat = payload.flat()
            for part, start in zip(out.parts, out.starts, strict=True):
                part.add_(flat[start : start + part.numel()])
            return out
        if isinstance(payload.values, Segments):
            for part, start in zip(payload.values.parts, payload.values.starts, strict=True):
                out[start : start + part.numel()].add_(part)
            return out
        return out.add_(payload.values)

    def decompress(self, payload: Payload) -> Tensor:
        assert isinstance(payload, DensePayload)
        return payload.flat()

    def summable(self, payload: Payload, world_size: int, scratch: Scratch | None = None) -> Tensor:
        """The tensor times ``1/P`` (as DDP's reducer scales it); pieces are joined by that same multiplication, each
        written into its place in the summand."""
        assert isinstance(payload, DensePayload)
        values = payload.values
        if not isinstance(values, Segments):
            return super().summable(payload, world_size, scratch)
        numel, dtype, device = values.numel(), values.dtype, values.device
        out = (
            torch.empty(numel, dtype=dtype, device=device) if scratch is None else scratch("mean", numel, dtype, device)
        )
        for part, start in zip(values.parts, values.starts, strict=True):
            torch.mul(part, 1.0 / world_size, out=out[start : start + part.numel()])
        return out

    def payload_nbytes(self, shape: torch.Size, dtype: torch.dtype) -> int:
        return shape.numel() * torch.empty(0, dtype=dtype).element_size()
