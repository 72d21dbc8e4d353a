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

import torch
from torch import Tensor

__all__ = ["decode_indices", "encode_indices", "encoded_nbytes", "index_format", "low_bits"]


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
        indices.device.type == "cpu"
        and k
        and (int(indices[0]) < 0 or int(indices[-1]) >= n or bool((indices[1:] <= indices[:-1]).any()))
    ):
        raise ValueError(f"indices must be distinct, ascending and below {n}")
    size = encoded_nbytes(n, k, capacity)
    device = indices.device
    kind = index_format(n, slots)
    if kind == "empty":
        return torch.empty(0, dtype=torch.uint8, device=device)
    indices = indices.reshape(-1).long()
    if kind == "bitmap":
        bits = torch.zeros(_bytes(n) * 8, dtype=torch.bool, device=device)
        bits[indices] = True
        return _pack(bits)
    low = low_bits(n, slots)
    lows = _pack(_bits_of(indices & ((1 << low) - 1), low)) if low else torch.empty(0, dtype=torch.uint8, device=device)
    # the i-th index's high part h_i is written as a one at h_i + i: the ones' positions rise by 1 + (h_{i+1} - h_i)
    ones = (indices >> low) + torch.arange(k, device=device)
    highs = torch.zeros(_bytes(slots + _high_values(n, low)) * 8, dtype=torch.bool, device=device)
    highs[ones] = True
    encoded = torch.cat([_padded(lows, _bytes(slots * low)), _pack(highs)])
    assert encoded.numel() == size
    return encoded


def decode_indices(buffer: Tensor, n: int, k: int, capacity: int | None = None) -> Tensor:
    """The ``k`` ascending int64 indices that :func:`encode_indices` wrote into ``buffer`` (uint8, exactly
    :func:`encoded_nbytes` long). The count is known, so nothing waits for the device (``nonzero_static``);
    on the CPU the bytes are also checked to hold exactly ``k`` indices below ``n``."""
    slots = k if capacity is None else capacity
    size = encoded_nbytes(n, k, capacity)
    if buffer.numel() != size:
        raise ValueError(f"{k} indices below {n} take {size} bytes, got {buffer.numel()}")
    kind = index_format(n, slots)
    device = buffer.device
    if kind == "empty":
        return torch.empty(0, dtype=torch.long, device=device)
    check = device.type == "cpu"
    if kind == "bitmap":
        bits = _unpack(buffer)[:n]
        indices = _ones(bits, k, check)
    else:
        low = low_bits(n, slots)
        low_size = _bytes(slots * low)
        bits = _unpack(buffer[low_size:])
        ones = _ones(bits, k, check)
        indices = (ones - torch.arange(k, device=device)) << low
        if low:
            indices |= _value_of(_unpack(buffer[:low_size])[: k * low].reshape(-1, low))
    if check and k and int(indices[-1]) >= n:
        raise ValueError(f"an index {int(indices[-1])} is out of range for {n} elements")
    return indices


def _ones(bits: Tensor, k: int, check: bool) -> Tensor:
    """The positions of the ``k`` set bits (checking, when asked, that there are exactly ``k``)."""
    if check and int(bits.sum()) != k:
        raise ValueError(f"the index bytes hold {int(bits.sum())} indices, expected {k}")
    return torch.nonzero_static(bits, size=k).reshape(-1)


_BIT_WEIGHTS: dict[torch.device, Tensor] = {}


def _weights(device: torch.device) -> Tensor:
    weights = _BIT_WEIGHTS.get(device)
    if weights is None:
        weights = _BIT_WEIGHTS[device] = (1 << torch.arange(8, device=device)).to(torch.uint8)
    return weights


def _bits_of(values: Tensor, width: int) -> Tensor:
    """The ``width`` low bits of each value, least significant first, as one flat bool tensor (a bit column at a
    time: ``k * width`` bytes, no int64 matrix)."""
    bits = torch.empty(values.numel(), width, dtype=torch.bool, device=values.device)
    for b in range(width):
        bits[:, b] = (values >> b) & 1
    return bits.reshape(-1)


def _value_of(bits: Tensor) -> Tensor:
    """Rows of bits (least significant first) back to int64 values."""
    value = torch.zeros(bits.shape[0], dtype=torch.long, device=bits.device)
    for b in range(bits.shape[1]):
        value |= bits[:, b].long() << b
    return value


def _pack(bits: Tensor) -> Tensor:
    """Flat bools, 8 to a byte (least significant bit first), zero-padded to whole bytes."""
    padded = _padded(bits, _bytes(bits.numel()) * 8).reshape(-1, 8)
    return (padded.to(torch.uint8) * _weights(bits.device)).sum(dim=1, dtype=torch.uint8)


def _unpack(buffer: Tensor) -> Tensor:
    """Bytes back to flat bools, least significant bit first."""
    return (buffer.unsqueeze(1) & _weights(buffer.device)).bool().reshape(-1)


def _padded(t: Tensor, length: int) -> Tensor:
    return torch.cat([t, t.new_zeros(length - t.numel())]) if t.numel() < length else t
