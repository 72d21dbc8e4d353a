"""Byte-level wire format shared by all payloads: tensors concatenated as raw bytes.

A payload travels as one flat ``uint8`` tensor so that every unit of an aggregation, whatever its
compressor, fits in one collective. Reading a part back copies only when the part's offset is
not aligned for its dtype (``Tensor.view(dtype)`` needs an aligned storage offset).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from lightning_gradcomp.core.workspace import OWN_PAYLOAD, Scratch


def to_bytes(parts: Sequence[Tensor]) -> Tensor:
    """Concatenate the raw bytes of ``parts`` (each made contiguous and flat) into one uint8 tensor."""
    flats = [p.detach().contiguous().reshape(-1).view(torch.uint8) for p in parts]
    if not flats:
        return torch.empty(0, dtype=torch.uint8)
    if len(flats) == 1:
        return flats[0]
    return torch.cat(flats)


def own_payload(scratch: Scratch | None, header: Tensor, nbytes: int) -> tuple[Tensor, Tensor, Tensor]:
    """This rank's payload laid out as it travels: the float32 ``header`` (scales, norms) written in front, and a region
    of ``nbytes`` behind it for the codes to be written into, in the unit's kept buffer when there is ``scratch``.
    Returns the whole buffer, the header's float32 view in it and the codes' region."""
    front = 4 * header.numel()
    if scratch is None:
        wire = torch.empty(front + nbytes, dtype=torch.uint8, device=header.device)
    else:
        wire = scratch(OWN_PAYLOAD, front + nbytes, torch.uint8, header.device)
    kept_header = wire[:front].view(torch.float32).copy_(header.reshape(-1))
    return wire, kept_header, wire[front:]


class ByteReader:
    """Reads typed parts back, in order, from a uint8 buffer written by :func:`to_bytes`."""

    def __init__(self, buffer: Tensor) -> None:
        if buffer.dtype != torch.uint8 or buffer.dim() != 1:
            raise ValueError(f"buffer must be a 1-D uint8 tensor, got {buffer.dtype} with shape {tuple(buffer.shape)}")
        self._buffer = buffer
        self._offset = 0

    @property
    def remaining(self) -> int:
        """Bytes not read yet."""
        return self._buffer.numel() - self._offset

    def take(self, count: int, dtype: torch.dtype) -> Tensor:
        """Return the next ``count`` elements of ``dtype`` as a 1-D tensor."""
        itemsize = torch.empty(0, dtype=dtype).element_size()
        nbytes = count * itemsize
        if nbytes > self.remaining:
            raise ValueError(f"payload truncated: need {nbytes} bytes of {dtype}, {self.remaining} left")
        raw = self._buffer[self._offset : self._offset + nbytes]
        absolute = raw.storage_offset() * raw.element_size()
        if absolute % itemsize:
            raw = raw.clone()
        self._offset += nbytes
        return raw.view(dtype)
