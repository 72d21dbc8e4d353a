"""Sets of distinct indices in the fewest bytes their count allows, exactly: Elias-Fano or a bitmap.

A sparse payload's ``k`` indices into a tensor of ``n`` elements cost ``4k`` bytes as int32. Sorted,
they need far fewer bits: the Elias-Fano code (Elias, J. ACM 1974; Fano, 1971) splits each index into
its ``l = floor(log2(n / k))`` low bits, stored as they are, and its high part, stored in unary as
the gaps between consecutive high parts: ``k * l + k + ceil(n / 2^l)`` bits in all, about
``2 + log2(n / k)`` bits per index (11.9 at density 0.001, 8.6 at 0.01, against 32) whatever the
indices are. A bitmap of ``n`` bits is smaller once more than about a quarter of the entries are
sent (a density warm-up's first steps).

Both sizes depend on ``n`` and ``k`` alone, so the receiver knows the format and the size from the
tensor's shape and the count, nothing else travels, and an allgather of fixed-size payloads needs no
exchange of sizes. Encoding sorts the indices; the values travel in the same (ascending index)
order. The bits are packed and unpacked with tensor operations, on the indices' device.
"""

from __future__ import annotations

import sys

import torch
from torch import Tensor

from lightning_gradcomp.core.host_waits import reads_wait

__all__ = [
    "decode_indices",
    "edges_if_ascending",
    "encode_indices",
    "encoded_nbytes",
    "index_format",
    "is_ascending",
    "low_bits",
    "narrowed",
    "pack_bits",
    "pack_words",
    "position_dtype",
    "rises",
    "unpack_bits",
    "unpack_words",
]


def rises(indices: Tensor) -> Tensor:
    """Whether the 1-D ``indices`` (two or more) rise strictly, as a bool tensor on their device (one comparison per
    index: far cheaper than sorting them again)."""
    return (indices[1:] > indices[:-1]).all()


def is_ascending(indices: Tensor) -> bool:
    """Whether the 1-D ``indices`` rise strictly (:func:`rises`, read back)."""
    return indices.numel() < 2 or bool(rises(indices))


def edges_if_ascending(indices: Tensor, cuts: Tensor) -> list[int] | None:
    """Where each of the ascending ``cuts`` falls in the 1-D ``indices`` (``torch.searchsorted``), or ``None`` if the
    indices do not rise strictly: the check and the edges read back together, one wait on a device instead of two."""
    edges = torch.searchsorted(indices, cuts.to(indices.dtype))  # read only where the indices rise
    if indices.numel() < 2:
        return edges.tolist()
    read = torch.cat([rises(indices).to(edges.dtype).reshape(1), edges]).tolist()
    return read[1:] if read[0] else None


def low_bits(n: int, k: int) -> int:
    """Elias-Fano's low bits per index for ``k`` indices below ``n``: ``floor(log2(n / k))``, at least 0 (in integer
    arithmetic: exact for any ``n``)."""
    return max(0, (n // k).bit_length() - 1) if 0 < k < n else 0


def _elias_fano_nbytes(n: int, k: int, low: int) -> int:
    return _bytes(k * low) + _bytes(k + _high_values(n, low))


def _high_values(n: int, low: int) -> int:
    """How many high parts indices below ``n`` can have with ``low`` low bits."""
    return ((n - 1) >> low) + 1 if n else 0


def _bytes(bits: int) -> int:
    return (bits + 7) // 8


def index_format(n: int, k: int) -> str:
    """The format of ``k`` distinct indices below ``n``: ``"bitmap"`` when it is no larger, else ``"elias-fano"``."""
    if k == 0:
        return "empty"
    return "bitmap" if _bytes(n) <= _elias_fano_nbytes(n, k, low_bits(n, k)) else "elias-fano"


def encoded_nbytes(n: int, k: int, capacity: int | None = None) -> int:
    """Bytes of ``k`` distinct indices below ``n``; with ``capacity``, of any count up to it, in ``capacity``'s
    format (a payload of fixed size whose count varies, Gaussian_k's)."""
    slots = k if capacity is None else capacity
    kind = index_format(n, slots)
    if kind == "empty":
        return 0
    if kind == "bitmap":
        return _bytes(n)
    return _elias_fano_nbytes(n, slots, low_bits(n, slots))


def encode_indices(indices: Tensor, n: int, capacity: int | None = None) -> Tensor:
    """``indices`` (distinct, below ``n``, strictly ascending: checked on the CPU) as :func:`encoded_nbytes` uint8
    bytes (zero-padded up to ``capacity``'s size when it is given)."""
    k = indices.numel()
    slots = k if capacity is None else capacity
    if k > slots:
        raise ValueError(f"{k} indices do not fit in {slots} slots")
    if (
        not reads_wait(indices.device)
        and k
        and (int(indices[0]) < 0 or int(indices[-1]) >= n or bool((indices[1:] <= indices[:-1]).any()))
    ):
        raise ValueError(f"indices must be distinct, ascending and below {n}")
    size = encoded_nbytes(n, k, capacity)
    device = indices.device
    kind = index_format(n, slots)
    if kind == "empty":
        return torch.empty(0, dtype=torch.uint8, device=device)
    indices = indices.reshape(-1).to(position_dtype(n))
    if kind == "bitmap":
        return _set_bits(indices, _bytes(n))
    low = low_bits(n, slots)
    lows = pack_bits(indices & ((1 << low) - 1), low, _bytes(slots * low))
    # the i-th index's high part h_i is written as a one at h_i + i: the ones' positions rise by 1 + (h_{i+1} - h_i)
    ones = (indices >> low).add_(torch.arange(k, dtype=indices.dtype, device=device))
    encoded = torch.cat([lows, _set_bits(ones, _bytes(slots + _high_values(n, low)))])
    assert encoded.numel() == size
    return encoded


def decode_indices(buffer: Tensor, n: int, k: int, capacity: int | None = None) -> Tensor:
    """The ``k`` ascending indices that :func:`encode_indices` wrote into ``buffer`` (uint8, exactly
    :func:`encoded_nbytes` long), as :func:`position_dtype` of ``n`` (int32 up to ``2^31`` elements). The bytes are
    checked to hold exactly ``k`` indices (one number read back from the device), and on the CPU also that they lie
    below ``n``."""
    slots = k if capacity is None else capacity
    size = encoded_nbytes(n, k, capacity)
    if buffer.numel() != size:
        raise ValueError(f"{k} indices below {n} take {size} bytes, got {buffer.numel()}")
    kind = index_format(n, slots)
    device = buffer.device
    if kind == "empty":
        return torch.empty(0, dtype=position_dtype(n), device=device)
    check = not reads_wait(device)
    if kind == "bitmap":
        indices = _set_positions(buffer, k)
    else:
        low = low_bits(n, slots)
        low_size = _bytes(slots * low)
        ones = narrowed(_set_positions(buffer[low_size:], k), n)
        indices = ones.sub_(torch.arange(k, dtype=ones.dtype, device=device)).bitwise_left_shift_(low)
        if low:
            indices |= unpack_bits(buffer[:low_size], k, low).to(indices.dtype)  # else ORed through an int64 copy
    if check and k and int(indices[-1]) >= n:
        raise ValueError(f"an index {int(indices[-1])} is out of range for {n} elements")
    return indices


# The bits travel least significant first within each byte, bytes in order: the bit stream of little-endian
# int64 words, which is how they are built and read, 64 bits at a time.
_WORD = 64


def _set_bits(positions: Tensor, nbytes: int) -> Tensor:
    """``nbytes`` bytes whose set bits are exactly the distinct ``positions`` (one scatter into words of the positions'
    width, 32 or 64 bits: distinct bits add without a carry, and every partial sum of them is representable, so the sum
    is their union)."""
    width = 8 * positions.element_size()
    words = torch.zeros(-(-nbytes * 8 // width), dtype=positions.dtype, device=positions.device)
    bits = torch.ones_like(positions).bitwise_left_shift_(positions & (width - 1))  # in place: one temporary fewer
    words.index_add_(0, positions >> (width.bit_length() - 1), bits)
    return _bytes_of(words)[:nbytes]


def _set_positions(buffer: Tensor, k: int) -> Tensor:
    """The ascending positions of the ``k`` set bits of ``buffer``: per byte its count of ones (a table), then each
    one's bit from a table of the byte's set bits. The count is checked on every device (one number read back):
    spreading the bytes over ``k`` positions must not run past them on malformed bytes."""
    counts, bits = _byte_tables(buffer.device)
    dtype = position_dtype(8 * buffer.numel())
    values = buffer.to(dtype)
    per_byte = counts.index_select(0, values)
    if int(per_byte.sum()) != k:
        raise ValueError(f"the index bytes hold {int(per_byte.sum())} indices, expected {k}")
    byte = torch.repeat_interleave(
        torch.arange(buffer.numel(), dtype=dtype, device=buffer.device), per_byte, output_size=k
    )
    first = per_byte.cumsum(0, dtype=dtype).sub_(per_byte)  # ones before each byte
    # each one's rank within its byte picks its bit from the byte's table row; in place, three arrays of k at most
    at = (
        values.index_select(0, byte)
        .mul_(8)
        .add_(torch.arange(k, dtype=dtype, device=buffer.device))
        .sub_(first.index_select(0, byte))
    )
    picked = bits.view(-1).index_select(0, at)  # int32 bits: widened only for positions past int32
    return (picked if picked.dtype == dtype else picked.to(dtype)).add_(byte.mul_(8))


def position_dtype(n: int) -> torch.dtype:
    """The integer dtype of positions below ``n``: int32 while they fit (half the bytes of int64 to move), else
    int64."""
    return torch.int32 if n <= 1 << 31 else torch.int64


def narrowed(indices: Tensor, n: int) -> Tensor:
    """``indices`` below ``n`` as :func:`position_dtype` of ``n`` (themselves where they are already)."""
    dtype = position_dtype(n)
    return indices if indices.dtype == dtype else indices.to(dtype)


def pack_bits(values: Tensor, width: int, nbytes: int) -> Tensor:
    """The ``width`` low bits of each of ``values`` (non-negative, below ``2**width``), back to back, in ``nbytes``
    bytes. On the CPU, whole groups of eight values go in :func:`_pack_groups`' byte columns; otherwise (and for the
    last values) each value is added into the word its first bit falls in, and what spills past bit 63 into the next
    word."""
    whole = values.dim() == 1 and nbytes * 8 >= values.numel() * width  # else the words' path, as it always was
    groups = _groups(values, width, values.numel(), least=_PACKED_IN_COLUMNS_FROM) if whole else 0
    if not groups:
        return pack_words(values, width, nbytes)
    head = _pack_groups(values[: 8 * groups], width, groups)
    rest = pack_words(values[8 * groups :], width, nbytes - head.numel())
    return torch.cat([head, rest])


def unpack_bits(buffer: Tensor, count: int, width: int) -> Tensor:
    """:func:`pack_bits`' ``count`` values of ``width`` bits from the bytes ``buffer`` (int64)."""
    whole = buffer.dtype == torch.uint8 and buffer.numel() * 8 >= count * width  # else the words' path
    groups = _groups(buffer, width, count, least=_UNPACKED_FROM_COLUMNS_FROM) if whole else 0
    if not groups:
        return unpack_words(buffer, count, width)
    head = _unpack_groups(buffer[: groups * width], width, groups)
    return torch.cat([head, unpack_words(buffer[groups * width :], count - 8 * groups, width)])


#: Fewest values :func:`pack_bits` and :func:`unpack_bits` move in byte columns: below them the words' few passes
#: cost less than the columns' eight times as many operations (one CPU thread, widths 6 and 9).
_PACKED_IN_COLUMNS_FROM = 1 << 17
_UNPACKED_FROM_COLUMNS_FROM = 1 << 16


def _groups(t: Tensor, width: int, count: int, least: int) -> int:
    """Whole groups of eight of the ``count`` ``width``-bit values (``width`` bytes each) to move in byte columns: on
    the CPU, from ``least`` values on (250,000 values of 6 bits: packed in 1.60 ms instead of 2.96, unpacked in 1.35
    instead of 4.19, ``benchmarks/kernel_costs.py``), and only for widths whose values span at most eight bytes;
    else 0."""
    if t.device.type != "cpu" or not 0 < width <= 57 or count < least:
        return 0
    return count // 8


def _columns(width: int) -> list[tuple[int, int, int]]:
    """For value ``j`` of a group of eight: its first byte in the group, its first bit in that byte, and how many
    bytes it spans (bit ``j * width`` of the group's ``8 * width``, least significant first)."""
    return [(j * width >> 3, j * width & 7, ((j * width & 7) + width + 7) >> 3) for j in range(8)]


def _pack_groups(values: Tensor, width: int, groups: int) -> Tensor:
    """``groups * 8`` values as ``groups * width`` bytes: a group's value ``j`` is ORed, shifted to its first bit,
    into the byte columns it spans (eight strided passes over ``groups`` values, no gather or scatter)."""
    body = torch.zeros(groups, width, dtype=torch.uint8, device=values.device)
    per_group = values.reshape(groups, 8)
    for j, (first, shift, span) in enumerate(_columns(width)):
        placed = per_group[:, j].long() << shift
        for t in range(span):
            column = body[:, first + t]
            column.bitwise_or_(((placed >> (8 * t)) & 0xFF).to(torch.uint8))
    return body.reshape(-1)


def _unpack_groups(body: Tensor, width: int, groups: int) -> Tensor:
    """:func:`_pack_groups`' values back from its ``groups * width`` bytes."""
    columns = body.view(groups, width)
    out = torch.empty(groups, 8, dtype=torch.long, device=body.device)
    mask = (1 << width) - 1
    for j, (first, shift, span) in enumerate(_columns(width)):
        value = columns[:, first].long()
        for t in range(1, span):
            value |= columns[:, first + t].long() << (8 * t)
        out[:, j] = (value >> shift) & mask
    return out.reshape(-1)


def pack_words(values: Tensor, width: int, nbytes: int) -> Tensor:
    """:func:`pack_bits` on any device: each value added into the int64 word its first bit falls in, and what spills
    past bit 63 into the next word."""
    words = torch.zeros(-(-nbytes // 8) + 1, dtype=torch.long, device=values.device)
    if width and values.numel():
        start = torch.arange(values.numel(), device=values.device) * width
        word, shift = start >> 6, start & (_WORD - 1)
        words.index_add_(0, word, values << shift)  # bits past 63 drop out here...
        words.index_add_(0, word + 1, values >> (_WORD - shift))  # ...and land here (a shift by 64 gives 0)
    return _bytes_of(words)[:nbytes]


def unpack_words(buffer: Tensor, count: int, width: int) -> Tensor:
    """:func:`unpack_bits` on any device, from the int64 words of the bit stream."""
    words = _words_of(buffer, extra=1)
    start = torch.arange(count, device=buffer.device) * width
    word, shift = start >> 6, start & (_WORD - 1)
    below = (words.index_select(0, word) >> shift) & ((1 << (_WORD - shift)) - 1)  # logical: no sign bit copies
    above = words.index_select(0, word + 1) << (_WORD - shift)  # the next word's spill (shift 0: 64 shifts to 0)
    return (below | above) & ((1 << width) - 1)


def _bytes_of(words: Tensor) -> Tensor:
    """The words' bytes in bit-stream order (little-endian words as they lie in memory)."""
    raw = words.view(torch.uint8)
    return raw if sys.byteorder == "little" else raw.view(-1, words.element_size()).flip(1).reshape(-1)


def _words_of(buffer: Tensor, extra: int = 0) -> Tensor:
    """The bytes as int64 words of the bit stream, zero-padded to whole words and ``extra`` more."""
    padded = torch.zeros((-(-buffer.numel() // 8) + extra) * 8, dtype=torch.uint8, device=buffer.device)
    padded[: buffer.numel()] = buffer
    if sys.byteorder != "little":
        padded = padded.view(-1, 8).flip(1).reshape(-1)
    return padded.view(torch.long)


_BYTE_TABLES: dict[torch.device, tuple[Tensor, Tensor]] = {}


def _byte_tables(device: torch.device) -> tuple[Tensor, Tensor]:
    """For every byte value: how many bits are set, and their positions (ascending, padded with 0)."""
    tables = _BYTE_TABLES.get(device)
    if tables is None:
        bits = (torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1
        order = torch.argsort(1 - bits, dim=1, stable=True)  # the set bits first, in ascending order
        tables = _BYTE_TABLES[device] = (bits.sum(1).to(device, torch.int32), order.to(device, torch.int32))
    return tables
