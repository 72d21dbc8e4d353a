"""Exact Top-k on a device without a host wait: a radix select over the bits of the magnitudes, three counting passes
and one selecting pass, every size fixed in advance.

A float's magnitude orders as its bit pattern with the sign cleared (an int32 key; a NaN's key lies above an
infinity's, so NaNs rank first, as ``torch.topk`` ranks them). The ``k``-th largest key is found digit by digit, most
significant first (the radix select of Alabi et al., "Fast K-selection algorithms for graphics processing units",
ACM JEA 17, 2012): a histogram of the top 11 bits places it in one bin, one of the next 11 bits of that bin's keys
places it in a sub-bin, and one of the last 9 bits gives it exactly. Each histogram is ``torch.histc`` of
the digits (those outside the bin at ``-1``, which ``histc`` leaves out), counted in chunks of at most ``2^24`` entries
so that its float32 bins count exactly. The choices stay on the device: the host never reads a count.

The selection is the keys above the cut and the first of those at it, by position, up to ``k`` (the same entries,
ties included, as :func:`~lightning_gradcomp.core.compressors.topk.ascending_top_k`): two ``nonzero_static`` of size
``k`` and a sort of their ``2k`` positions, in ascending order.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_gradcomp.core.compressors.ladder import histc_refused, pieces
from lightning_gradcomp.core.compressors.segments import Segments
from lightning_gradcomp.core.fused import fused

__all__ = ["DIGITS", "magnitude_digits", "radix_top_k", "split_by_cut"]

#: ``(shift, width)`` of the key's digits, most significant first: 11 + 11 + 9 bits, the 31 of a magnitude. 2048
#: float32 bins fit in a GPU block's shared memory, which ``histc`` counts in.
DIGITS: tuple[tuple[int, int], ...] = ((20, 11), (9, 11), (0, 9))
#: Dtypes whose magnitudes widen exactly to float32 (whose bits are then the key).
KEYED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def magnitude_keys(x: Tensor) -> Tensor:
    """The int32 keys of ``|x|``: float32 bit patterns with the sign cleared, ordered as the magnitudes."""
    return x.float().view(torch.int32) & 0x7FFFFFFF


@fused
def magnitude_digits(piece: Tensor, prefix: Tensor, shift: int, width: int) -> Tensor:
    """Digit ``(key >> shift) mod 2^width`` of each entry's magnitude key (float32, for ``histc``), ``-1`` where the
    key's bits above the digit (``key >> (shift + width)``) are not ``prefix`` (an int32 scalar; ignored for the
    top digit)."""
    key = magnitude_keys(piece)
    digit = ((key >> shift) & ((1 << width) - 1)).float()
    if shift + width >= 31:
        return digit
    return torch.where((key >> (shift + width)) == prefix, digit, -1.0)


@fused
def split_by_cut(piece: Tensor, cut: Tensor) -> tuple[Tensor, Tensor]:
    """Whether each entry's magnitude key is above the int32 scalar ``cut``, and whether it is at it."""
    key = magnitude_keys(piece)
    return key > cut, key == cut


def digit_histogram(flat: Tensor | Segments, prefix: Tensor, shift: int, width: int) -> Tensor:
    """Counts (float64) of each value of the digit at ``shift`` among the keys whose higher bits are ``prefix``."""
    bins = 1 << width
    counts = torch.zeros(bins, dtype=torch.float64, device=flat.device)
    for _, piece in pieces(flat):  # at most 2^24 entries a piece: float32 bins count them exactly
        counts += torch.histc(magnitude_digits(piece, prefix, shift, width), bins=bins, min=0, max=bins)
    return counts


def deepest_bin(counts: Tensor, wanted: Tensor | int) -> tuple[Tensor, Tensor]:
    """The largest digit ``j`` with at least ``wanted`` entries at ``j`` or above, and how many of those at ``j``
    itself are still wanted (``wanted`` less those above ``j``): both device tensors, no read-back."""
    at_or_above = counts.flip(0).cumsum(0).flip(0)
    digit = ((at_or_above >= wanted).sum() - 1).clamp_(min=0).reshape(1)
    above = (at_or_above.index_select(0, digit) - counts.index_select(0, digit)).to(torch.int64)
    return digit.to(torch.int32), wanted - above


def radix_top_k(flat: Tensor | Segments, k: int) -> Tensor | None:
    """Ascending flat indices of exactly ``k`` entries of largest magnitude of ``flat`` (``0 < k < numel``; ties at the
    cut: the first ones), or ``None`` for a dtype whose magnitudes are not float32 keys (float64), and off the CPU
    under ``torch.use_deterministic_algorithms`` (which refuses CUDA's ``histc``, whose counts are exact all the
    same)."""
    if flat.dtype not in KEYED_DTYPES:
        return None
    if histc_refused(flat.device):
        return None
    device, numel = flat.device, flat.numel()
    prefix = torch.zeros(1, dtype=torch.int32, device=device)
    wanted: Tensor | int = k
    for shift, width in DIGITS:
        digit, wanted = deepest_bin(digit_histogram(flat, prefix, shift, width), wanted)
        prefix = (prefix << width) | digit
    above = torch.empty(numel, dtype=torch.bool, device=device)
    at = torch.empty(numel, dtype=torch.bool, device=device)
    for start, piece in pieces(flat):
        piece_above, piece_at = split_by_cut(piece, prefix)
        above[start : start + piece.numel()] = piece_above
        at[start : start + piece.numel()] = piece_at
    first_above = torch.nonzero_static(above, size=k, fill_value=numel).reshape(-1)  # fewer than k: filled
    first_at = torch.nonzero_static(at, size=k, fill_value=numel).reshape(-1)
    first_at = torch.where(torch.arange(k, device=device) < wanted, first_at, numel)  # the ties wanted, by position
    return torch.cat([first_above, first_at]).sort().values[:k]
