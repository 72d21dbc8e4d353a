"""The planar layout of small codes in 32-bit words: the wire form of ternary codes (2 bits), QSGD's levels (4 or 8
bits) and the scaled signs (1 bit).

``per_byte`` codes of ``w = 8 // per_byte`` bits share a byte, so ``per_word = 4 * per_byte`` share a little-endian
32-bit word, each stored as its value plus a ``bias`` (so that the field is non-negative). The codes are cut into rows
of ``per_word * STRIPE``: row ``r`` lies in words ``r * STRIPE ..``, and field ``k`` (bits ``k w .. k w + w - 1``) of
its word ``v`` holds the row's code ``v + k * STRIPE``. The last, partial row of ``m`` codes is cut the same way into
stripes of ``ceil(m / per_word)`` words; the fields past its end hold ``pad``. So each field plane of a row is a
contiguous run of elements and each word is read once, as one lane of a vector: compiled on an AMD EPYC (AVX2, one
thread), the mean of two ranks' scaled signs of a 4096 x 4096 layer took 42.3 ms from bytes (8 signs each, rows of
``8 * 512``), 11.4 from words, and a copy of the layer 9.5 (``benchmarks/field_layout.py``). The words are
read as float32 and reinterpreted (:func:`words_of`): there, torch's vector loads of int32 and uint8 that the
compiler emits go through a buffer on the stack, a float32 load is one instruction.

:func:`pack_rows` and :func:`fields_of_rows` are pure functions for the compiled kernels
(:mod:`~lightning_gradcomp.core.compressors.kernels`); :func:`pack_codes`, :func:`unpack_codes` and
:func:`field_positions` are the eager forms, a cache-sized chunk of rows at a time, which address bytes: byte ``j``
of a word holds its fields ``j * per_byte ..``, whatever the machine's byte order. The kernels read the words in the
machine's order, so compiled and eager agree on little-endian machines (every platform torch ships CPU and CUDA
wheels for but s390x); on a big-endian one the kernels run eagerly (:func:`~lightning_gradcomp.core.fused.compiles_on`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_gradcomp.core.compressors.base import STREAM_CHUNK, chunk_for

#: Bytes per word.
WORD = 4
#: Words per whole row, and codes per field plane of one: a row holds ``4 * per_byte * STRIPE`` codes.
STRIPE = 512


def row_codes(per_byte: int) -> int:
    """Codes per whole row: ``per_word`` planes of :data:`STRIPE`."""
    return WORD * per_byte * STRIPE


def row_split(numel: int, per_byte: int) -> tuple[int, int]:
    """``(whole, stripe)``: how many of ``numel`` codes lie in whole rows, and the stripe (in words) of the last,
    partial row (``ceil(m / per_word)`` for its ``m`` codes; 0 when there is none)."""
    row = row_codes(per_byte)
    whole = numel // row * row
    return whole, -(-(numel - whole) // (WORD * per_byte))


def planar_nbytes(numel: int, per_byte: int) -> int:
    """Bytes of ``numel`` codes: whole words, ``4 * ceil(numel / per_word)`` (the rows' words and the last row's
    stripe)."""
    return WORD * -(-numel // (WORD * per_byte))


def word_aligned(packed: Tensor) -> Tensor:
    """``packed`` (uint8) where it starts on a word, else a copy that does (a word view needs it; a received payload
    lies wherever the gather put it): the copy is the codes' bytes, a thirty-second (signs) to a quarter (8-bit levels)
    of the tensor's in float32."""
    return packed if packed.storage_offset() % WORD == 0 else packed.clone()


def words_of(packed: Tensor) -> Tensor:
    """The int32 words of planar bytes (uint8, starting on a word), read as float32 and reinterpreted: compiled on
    AVX2, a float32 vector load is one instruction where an int32 or uint8 one goes through a stack buffer."""
    return packed.view(torch.float32).view(torch.int32)


def _field_shifts(per_byte: int, device: torch.device) -> Tensor:
    """Each field's shift within a word, ``(1, per_word, 1)`` (int32): field ``k`` holds bits ``k w ..``."""
    per_word = WORD * per_byte
    return (8 // per_byte) * torch.arange(per_word, dtype=torch.int32, device=device).view(1, per_word, 1)


def pack_rows(fields: Tensor, per_byte: int, stripe: int) -> Tensor:
    """The words (int32, flat; :meth:`Tensor.view` them as uint8 for the wire) of whole rows of ``per_word * stripe``
    int32 fields given in element order: each word's fields shifted into place and summed over the planes (distinct
    bits: the sum is their union), each plane read as whole vectors. One expression over the planes, not one per
    plane, which compiles several times faster (the docs' speed page, twelfth round)."""
    shifts = _field_shifts(per_byte, fields.device)
    return (fields.view(-1, shifts.shape[1], stripe) << shifts).sum(1, dtype=torch.int32).reshape(-1)


def fields_of_rows(packed: Tensor, per_byte: int, stripe: int) -> Tensor:
    """The int32 fields of whole rows' bytes (uint8, starting on a word), shaped ``(rows, per_word, stripe)``: each
    row's planes in element order, each word read once (:func:`words_of`)."""
    words = words_of(packed).view(-1, 1, stripe)
    return (words >> _field_shifts(per_byte, packed.device)) & ((1 << (8 // per_byte)) - 1)


def pack_fields(fields: Tensor, per_byte: int, pad: int) -> Tensor:
    """The planar words (int32) of ``fields`` in element order (flat, int32): the whole rows, then the last row
    padded with ``pad`` (for a kernel that computes its fields in element order: a tail, or blocks that do not align
    with rows)."""
    numel = fields.numel()
    whole, stripe = row_split(numel, per_byte)
    parts = [pack_rows(fields[:whole], per_byte, STRIPE)] if whole else []
    if stripe:
        tail = torch.nn.functional.pad(fields[whole:], (0, WORD * per_byte * stripe - (numel - whole)), value=pad)
        parts.append(pack_rows(tail, per_byte, stripe))
    if not parts:
        return fields.new_zeros(0, dtype=torch.int32)
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _rows_per_chunk(device: torch.device, per_byte: int) -> int:
    """Whole rows per eager chunk: about :data:`STREAM_CHUNK` codes."""
    return max(1, chunk_for(device, STREAM_CHUNK) // row_codes(per_byte))


def byte_planes(packed: Tensor, stripe: int) -> Tensor:
    """The bytes of whole rows (or of one partial row of ``stripe`` words) as ``(rows, WORD, stripe)``: byte ``j`` of
    each of a row's words, a strided view."""
    return packed.view(-1, stripe, WORD).transpose(1, 2)


def _pack_biased_(out: Tensor, codes: Tensor, per_byte: int, stripe: int, bias: int) -> None:
    """``out`` (the bytes of whole rows) set from the uint8 view of int8 ``codes``, each plus ``bias`` (uint8
    arithmetic wraps: ``-1 + 1 = 0``), in bytes throughout: byte ``j`` of a word gathers its planes
    ``j * per_byte ..``."""
    width = 8 // per_byte
    planes = codes.view(-1, WORD, per_byte, stripe)
    target = byte_planes(out, stripe)
    torch.add(planes[:, :, 0], bias, out=target)
    for k in range(1, per_byte):
        target |= (planes[:, :, k] + bias) << (width * k)


def pack_codes(codes: Tensor, per_byte: int, bias: int, pad: int, out: Tensor | None = None) -> Tensor:
    """The planar bytes of the int8 ``codes`` (any shape, read in flat order), into ``out`` when given; eagerly, a
    chunk of whole rows at a time. Codes outside the fields' range are not checked (that would cost a pass) and do
    not round-trip."""
    if codes.dtype != torch.int8:
        raise ValueError(f"codes must be an int8 tensor, got {codes.dtype}")
    flat = codes.reshape(-1).view(torch.uint8)
    numel = flat.numel()
    packed = torch.empty(planar_nbytes(numel, per_byte), dtype=torch.uint8, device=codes.device) if out is None else out
    whole, stripe = row_split(numel, per_byte)
    span = _rows_per_chunk(codes.device, per_byte) * row_codes(per_byte)
    for start in range(0, whole, span):
        stop = min(start + span, whole)
        _pack_biased_(packed[start // per_byte : stop // per_byte], flat[start:stop], per_byte, STRIPE, bias)
    if stripe:
        tail = torch.full((WORD * per_byte * stripe,), (pad - bias) % 256, dtype=torch.uint8, device=codes.device)
        tail[: numel - whole] = flat[whole:]
        _pack_biased_(packed[whole // per_byte :], tail, per_byte, stripe, bias)
    return packed


def _fields_of(packed: Tensor, per_byte: int, stripe: int, out: Tensor) -> Tensor:
    """``out`` (uint8, ``per_byte`` fields per byte of ``packed``) set to the fields of those whole rows in element
    order, one plane at a time."""
    width, mask = 8 // per_byte, (1 << (8 // per_byte)) - 1
    rows = byte_planes(packed, stripe)
    planes = out.view(-1, WORD, per_byte, stripe)
    for k in range(per_byte):
        torch.bitwise_and(rows >> (width * k), mask, out=planes[:, :, k])
    return out


def unpack_codes(packed: Tensor, numel: int, start: int, count: int, per_byte: int, bias: int) -> Tensor:
    """Codes ``start .. start + count`` (int8) of the planar bytes of ``numel`` codes: the rows that hold them decoded
    a chunk of rows at a time through a small buffer, the field minus ``bias``."""
    codes = torch.empty(count, dtype=torch.uint8, device=packed.device)
    stop = start + count
    whole, stripe = row_split(numel, per_byte)
    row = row_codes(per_byte)
    step = _rows_per_chunk(packed.device, per_byte) * row
    first_row, rows_end = start // row * row, min(whole, -(-stop // row) * row)
    buffer = torch.empty(min(step, max(0, rows_end - first_row)), dtype=torch.uint8, device=codes.device)
    for low in range(first_row, rows_end, step):
        high = min(low + step, rows_end)
        fields = _fields_of(packed[low // per_byte : high // per_byte], per_byte, STRIPE, buffer[: high - low])
        first, last = max(start, low), min(stop, high)
        codes[first - start : last - start] = fields[first - low : last - low]
    if stop > whole:
        fields = torch.empty(WORD * per_byte * stripe, dtype=torch.uint8, device=codes.device)
        _fields_of(packed[whole // per_byte :], per_byte, stripe, fields)
        first = max(start, whole)
        codes[first - start :] = fields[first - whole : stop - whole]
    return codes.sub_(bias).view(torch.int8)  # uint8 arithmetic wraps to the int8 bits


def field_positions(positions: Tensor, numel: int, per_byte: int) -> tuple[Tensor, Tensor]:
    """Where codes ``positions`` (int64) of ``numel`` lie: their bytes (int64) and their fields' shifts within the
    byte (int32)."""
    whole, stripe = row_split(numel, per_byte)
    row, width = row_codes(per_byte), 8 // per_byte
    in_tail = positions >= whole
    offset = torch.where(in_tail, positions - whole, positions % row)
    plane = torch.where(in_tail, max(stripe, 1), STRIPE)
    field, word = offset // plane, offset % plane
    first = torch.where(in_tail, whole // per_byte, positions // row * (WORD * STRIPE))
    return first + WORD * word + field // per_byte, (field % per_byte * width).to(torch.int32)
