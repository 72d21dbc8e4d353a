"""The planar layout of small codes in bytes: the wire form of ternary codes (2 bits) and of QSGD's levels (4 bits).

``per_byte`` codes of ``w = 8 // per_byte`` bits share a byte, each stored as its value plus a ``bias`` (so that the
field is non-negative). The codes are cut into rows of ``per_byte * STRIPE``: row ``r`` lies in bytes
``r * STRIPE ..``, and field ``k`` (bits ``k w .. k w + w - 1``) of its byte ``b`` holds the row's code
``b + k * STRIPE``. The last, partial row of ``m`` codes is cut the same way into stripes of ``ceil(m / per_byte)``;
the fields past its end hold ``pad``. So each field plane of a row is a contiguous run of elements, which compiled
loops read and write as whole vectors: packed consecutively (code ``j`` in field ``j % per_byte`` of byte
``j // per_byte``), the compiled mean of two ranks' 4-bit levels of a 4096 x 4096 layer took 20.8 ms on one CPU
thread, planar 6.5 (``benchmarks/field_layout.py``). The scaled signs use the same rows with one bit per field
(:mod:`~lightning_gradcomp.core.compressors.sign`). The layout does not depend on the machine's byte order.

:func:`pack_rows` and :func:`fields_of_rows` are pure functions for the compiled kernels
(:mod:`~lightning_gradcomp.core.compressors.kernels`); :func:`pack_codes`, :func:`unpack_codes` and
:func:`field_positions` are the eager forms, a cache-sized chunk of rows at a time.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_gradcomp.core.compressors.base import STREAM_CHUNK, chunk_for

#: Bytes per whole row: a row holds ``per_byte * STRIPE`` codes.
STRIPE = 512


def row_split(numel: int, per_byte: int) -> tuple[int, int]:
    """``(whole, stripe)``: how many of ``numel`` codes lie in whole rows, and the stripe of the last, partial row
    (``ceil(m / per_byte)`` for its ``m`` codes; 0 when there is none)."""
    row = per_byte * STRIPE
    whole = numel // row * row
    return whole, -(-(numel - whole) // per_byte)


def planar_nbytes(numel: int, per_byte: int) -> int:
    """Bytes of ``numel`` codes: ``ceil(numel / per_byte)`` (the rows' bytes and the last row's stripe)."""
    return -(-numel // per_byte)


def pack_rows(fields: Tensor, per_byte: int, stripe: int) -> Tensor:
    """The bytes (uint8, flat) of whole rows of ``per_byte * stripe`` fields given in element order (int32 for a
    compiled kernel, whose loops vectorise its shifts; any integer dtype eagerly): one OR of shifted planes per byte."""
    width = 8 // per_byte
    rows = fields.view(-1, per_byte, stripe)
    packed = rows[:, 0]
    for k in range(1, per_byte):
        packed = packed | (rows[:, k] << (width * k))
    return packed.to(torch.uint8).reshape(-1)


def fields_of_rows(packed: Tensor, per_byte: int, stripe: int) -> Tensor:
    """The int32 fields of whole rows' bytes, shaped ``(rows, per_byte, stripe)``: each row's planes in element
    order. Compiled, each plane reads its bytes as whole vectors."""
    width = 8 // per_byte
    shifts = width * torch.arange(per_byte, dtype=torch.int32, device=packed.device).view(1, per_byte, 1)
    return (packed.view(-1, 1, stripe).to(torch.int32) >> shifts) & ((1 << width) - 1)


def pack_fields(fields: Tensor, per_byte: int, pad: int) -> Tensor:
    """The planar bytes of ``fields`` in element order (flat, int32 in a compiled kernel): the whole rows, then the
    last row padded with ``pad`` (for a kernel that computes its fields in element order: a tail, or blocks that do
    not align with rows)."""
    numel = fields.numel()
    whole, stripe = row_split(numel, per_byte)
    parts = [pack_rows(fields[:whole], per_byte, STRIPE)] if whole else []
    if stripe:
        tail = torch.nn.functional.pad(fields[whole:], (0, per_byte * stripe - (numel - whole)), value=pad)
        parts.append(pack_rows(tail, per_byte, stripe))
    if not parts:
        return fields.new_zeros(0, dtype=torch.uint8)
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _rows_per_chunk(device: torch.device, per_byte: int) -> int:
    """Whole rows per eager chunk: about :data:`STREAM_CHUNK` codes."""
    return max(1, chunk_for(device, STREAM_CHUNK) // (per_byte * STRIPE))


def _pack_biased_(out: Tensor, codes: Tensor, per_byte: int, stripe: int, bias: int) -> None:
    """``out`` (the bytes of whole rows) set from the uint8 view of int8 ``codes``, each plus ``bias`` (uint8
    arithmetic wraps: ``-1 + 1 = 0``), in bytes throughout."""
    width = 8 // per_byte
    planes = codes.view(-1, per_byte, stripe)
    target = out.view(-1, stripe)
    torch.add(planes[:, 0], bias, out=target)
    for k in range(1, per_byte):
        target |= (planes[:, k] + bias) << (width * k)


def pack_codes(codes: Tensor, per_byte: int, bias: int, pad: int, out: Tensor | None = None) -> Tensor:
    """The planar bytes of the int8 ``codes`` (any shape, read in flat order), into ``out`` when given; eagerly, a
    chunk of whole rows at a time. Codes outside the fields' range are not checked (that would cost a pass) and do
    not round-trip."""
    if codes.dtype != torch.int8:
        raise ValueError(f"codes must be an int8 tensor, got {codes.dtype}")
    flat = codes.reshape(-1).view(torch.uint8)
    numel = flat.numel()
    packed = torch.empty(planar_nbytes(numel, per_byte), dtype=torch.uint8, device=codes.device) if out is None else out
    if per_byte == 1:
        return torch.add(flat, bias, out=packed)
    whole, stripe = row_split(numel, per_byte)
    span = _rows_per_chunk(codes.device, per_byte) * per_byte * STRIPE
    for start in range(0, whole, span):
        stop = min(start + span, whole)
        _pack_biased_(packed[start // per_byte : stop // per_byte], flat[start:stop], per_byte, STRIPE, bias)
    if stripe:
        tail = torch.full((per_byte * stripe,), (pad - bias) % 256, dtype=torch.uint8, device=codes.device)
        tail[: numel - whole] = flat[whole:]
        _pack_biased_(packed[whole // per_byte :], tail, per_byte, stripe, bias)
    return packed


def _fields_of(packed: Tensor, per_byte: int, stripe: int, out: Tensor) -> Tensor:
    """``out`` (uint8, ``per_byte`` fields per byte of ``packed``) set to the fields of those whole rows in element
    order, one plane at a time."""
    width, mask = 8 // per_byte, (1 << (8 // per_byte)) - 1
    rows = packed.view(-1, stripe)
    planes = out.view(-1, per_byte, stripe)
    for k in range(per_byte):
        torch.bitwise_and(rows >> (width * k), mask, out=planes[:, k])
    return out


def unpack_codes(packed: Tensor, numel: int, start: int, count: int, per_byte: int, bias: int) -> Tensor:
    """Codes ``start .. start + count`` (int8) of the planar bytes of ``numel`` codes: the rows that hold them decoded
    a chunk of rows at a time through a small buffer, the field minus ``bias``."""
    codes = torch.empty(count, dtype=torch.uint8, device=packed.device)
    if per_byte == 1:
        return torch.sub(packed[start : start + count], bias, out=codes).view(torch.int8)
    stop = start + count
    whole, stripe = row_split(numel, per_byte)
    row = per_byte * STRIPE
    step = _rows_per_chunk(packed.device, per_byte) * row
    first_row, rows_end = start // row * row, min(whole, -(-stop // row) * row)
    buffer = torch.empty(min(step, max(0, rows_end - first_row)), dtype=torch.uint8, device=codes.device)
    for low in range(first_row, rows_end, step):
        high = min(low + step, rows_end)
        fields = _fields_of(packed[low // per_byte : high // per_byte], per_byte, STRIPE, buffer[: high - low])
        first, last = max(start, low), min(stop, high)
        codes[first - start : last - start] = fields[first - low : last - low]
    if stop > whole:
        fields = torch.empty(per_byte * stripe, dtype=torch.uint8, device=codes.device)
        _fields_of(packed[whole // per_byte :], per_byte, stripe, fields)
        first = max(start, whole)
        codes[first - start :] = fields[first - whole : stop - whole]
    return codes.sub_(bias).view(torch.int8)  # uint8 arithmetic wraps to the int8 bits


def field_positions(positions: Tensor, numel: int, per_byte: int) -> tuple[Tensor, Tensor]:
    """Where codes ``positions`` (int64) of ``numel`` lie: their bytes (int64) and their fields' shifts (int32)."""
    whole, stripe = row_split(numel, per_byte)
    row, width = per_byte * STRIPE, 8 // per_byte
    in_tail = positions >= whole
    offset = torch.where(in_tail, positions - whole, positions % row)
    plane = torch.where(in_tail, max(stripe, 1), STRIPE)
    byte = torch.where(in_tail, whole // per_byte, positions // row * STRIPE) + offset % plane
    return byte, (offset // plane * width).to(torch.int32)
