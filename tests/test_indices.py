"""The compact index sets of sparse payloads: exact round trips for every count, sizes from the count alone."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch

import lightning_gradcomp.core.compressors.indices as indices_module
from lightning_gradcomp.core.compressors import SparsePayload, TopKCompressor
from lightning_gradcomp.core.compressors.indices import (
    decode_indices,
    edges_if_ascending,
    encode_indices,
    encoded_nbytes,
    index_format,
    low_bits,
    pack_bits,
    pack_words,
    unpack_bits,
)

SIZES = (1, 2, 7, 8, 9, 100, 1000, 4097, 61_706, 1_862_000)


def _counts(n: int) -> list[int]:
    """0, 1, d/2 and d (the issue's cases), and the densities the presets send: 0.1%, 1%, 25%."""
    return sorted({0, 1, n // 2, n, max(1, n // 1000), max(1, n // 100), max(1, n // 4)})


def _elias_fano_bits(n: int, k: int) -> int:
    """Elias-Fano's size in bits as the paper states it: k low parts of l bits, k ones and at most n / 2^l zeros
    for the high parts (each part padded to whole bytes here)."""
    low = math.floor(math.log2(n / k)) if 0 < k < n else 0
    return 8 * (math.ceil(k * low / 8) + math.ceil((k + (n - 1) // 2**low + 1) / 8))


@pytest.mark.parametrize("n", SIZES)
def test_every_count_round_trips_exactly_in_the_smaller_of_elias_fano_and_a_bitmap(n: int) -> None:
    generator = torch.Generator().manual_seed(n)
    for k in _counts(n):
        indices = torch.randperm(n, generator=generator)[:k].sort().values
        encoded = encode_indices(indices, n)
        assert encoded.dtype == torch.uint8 and encoded.numel() == encoded_nbytes(n, k), (n, k)
        expected = 0 if k == 0 else min(math.ceil(n / 8), _elias_fano_bits(n, k) // 8)
        assert encoded.numel() == expected, (n, k, index_format(n, k))
        assert torch.equal(decode_indices(encoded, n, k), indices), (n, k)


def test_the_sizes_the_presets_send() -> None:
    # the MNIST MLP as one unit (1.86M entries) at density 0.001 and 0.01: 11.96 and 8.56 bits an index, not 32
    assert (low_bits(1_862_000, 1862), encoded_nbytes(1_862_000, 1862)) == (9, 2783)
    assert (low_bits(1_862_000, 18_620), encoded_nbytes(1_862_000, 18_620)) == (6, 19_930)
    assert index_format(1_862_000, 18_620) == "elias-fano"
    # more than about a quarter of the entries: a bitmap of d bits is smaller
    assert index_format(1000, 300) == "bitmap" and encoded_nbytes(1000, 300) == 125
    # l = 2: 50 bytes of low bits, ceil((200 + 250) / 8) = 57 of high parts
    assert index_format(1000, 200) == "elias-fano" and encoded_nbytes(1000, 200) == 107
    assert (index_format(50, 0), encoded_nbytes(50, 0)) == ("empty", 0)


@pytest.mark.parametrize("n", [100, 61_706])
def test_a_varying_count_takes_the_size_of_its_capacity(n: int) -> None:
    capacity = n // 100
    size = encoded_nbytes(n, capacity)
    generator = torch.Generator().manual_seed(1)
    for k in (0, 1, capacity // 2, capacity):
        indices = torch.randperm(n, generator=generator)[:k].sort().values
        encoded = encode_indices(indices, n, capacity=capacity)
        assert encoded.numel() == encoded_nbytes(n, k, capacity=capacity) == size
        assert torch.equal(decode_indices(encoded, n, k, capacity=capacity), indices)
    with pytest.raises(ValueError, match=f"{capacity + 1} indices do not fit in {capacity} slots"):
        encode_indices(torch.arange(capacity + 1), n, capacity=capacity)


def test_indices_of_a_unit_past_int32_round_trip() -> None:
    n = 2**40  # a flat unit of a trillion elements: the low bits and the high parts are int64 throughout
    indices = torch.tensor([0, 2**33 + 5, 2**39, n - 1])
    assert low_bits(n, 4) == 38
    assert torch.equal(decode_indices(encode_indices(indices, n), n, 4), indices)


@pytest.mark.parametrize(("n", "k"), [(1000, 300), (25_000, 250), (10_000, 9_000)])  # Elias-Fano, and bitmaps
def test_positions_travel_in_int32_words_and_int64_ones_alike(n: int, k: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Positions of a tensor of at most 2^31 elements are int32 (decoded so, encoded in 32-bit words); the bytes are
    those of int64 positions in 64-bit words, and the int64 path (past 2^31, forced here) reads them back the same."""
    chosen = torch.randperm(n, generator=torch.Generator().manual_seed(n))[:k].sort().values
    encoded = encode_indices(chosen.int(), n)
    assert torch.equal(encode_indices(chosen, n), encoded)
    decoded = decode_indices(encoded, n, k)
    assert decoded.dtype == torch.int32 and torch.equal(decoded, chosen.int())
    monkeypatch.setattr(indices_module, "position_dtype", lambda _: torch.int64)
    assert torch.equal(encode_indices(chosen, n), encoded)
    wide = decode_indices(encoded, n, k)
    assert wide.dtype == torch.int64 and torch.equal(wide, chosen)


def test_indices_that_are_not_ascending_or_out_of_range_are_refused() -> None:
    for bad in ([5, 3], [3, 3], [2, 10]):
        with pytest.raises(ValueError, match="indices must be distinct, ascending and below 10"):
            encode_indices(torch.tensor(bad), 10)


def test_bytes_that_do_not_hold_the_count_are_refused() -> None:
    encoded = encode_indices(torch.tensor([3, 70, 99]), 100)  # l = 5: 2 bytes of low bits, 1 of high parts
    with pytest.raises(ValueError, match="3 indices below 100 take 3 bytes, got 2"):
        decode_indices(encoded[:2], 100, 3)
    with pytest.raises(ValueError, match="the index bytes hold 3 indices, expected 2"):
        decode_indices(encode_indices(torch.tensor([3, 70, 99]), 100), 100, 2)


def test_bytes_that_hold_an_index_out_of_range_are_refused_naming_it() -> None:
    """Catches: corrupt or foreign index bytes decoded into indices past the tensor's end (they would fail later, in
    ``index_add_`` or as a device assert on a GPU, not with the library's message)."""
    elias_fano = encode_indices(torch.tensor([3, 70, 99]), 100)  # l = 5: the third index's low bits are bits 10-14
    elias_fano[1] |= 0b0111_1100  # its low bits 31 instead of 3: 3 * 32 + 31 = 127
    with pytest.raises(ValueError, match="an index 127 is out of range for 100 elements"):
        decode_indices(elias_fano, 100, 3)
    bitmap = encode_indices(torch.tensor([1, 4, 9]), 10)  # a bitmap of 2 bytes: bits 10-15 lie past the end
    assert bitmap.tolist() == [0b0001_0010, 0b0000_0010]
    bitmap[1] = 0b0001_0000  # bit 9 moved to bit 12
    with pytest.raises(ValueError, match="an index 12 is out of range for 10 elements"):
        decode_indices(bitmap, 10, 3)


@pytest.mark.parametrize("numel", [1, 1000, 61_706])
@pytest.mark.parametrize("density", [0.001, 0.5, 1.0])
def test_sparse_payloads_count_what_they_carry(numel: int, density: float) -> None:
    """A payload's declared size is its wire form's, the entries come back in index order, and the count is d's
    for density 1 (every entry: a bitmap of d bits)."""
    x = torch.randn(numel, generator=torch.Generator().manual_seed(numel))
    codec = TopKCompressor(density)
    payload = codec.compress(x)
    wire = payload.to_bytes()
    assert wire.numel() == payload.nbytes == codec.payload_nbytes(x.shape, x.dtype)
    assert payload.nbytes == 8 + encoded_nbytes(numel, payload.k) + 4 * payload.k
    back = SparsePayload.from_bytes(wire, x.shape, x.dtype)
    order = payload.indices.argsort()
    assert torch.equal(back.indices, payload.indices[order]) and torch.equal(back.values, payload.values[order])
    if density == 1.0:
        assert payload.k == numel and index_format(numel, numel) == "bitmap"


def _counted(calls: dict[str, int], key: str, fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """``fn``, counting its calls in ``calls[key]``."""

    def counted(*args: object) -> torch.Tensor:
        calls[key] += 1
        return fn(*args)

    return counted


@pytest.mark.parametrize("width", [1, 3, 6, 8, 9, 12, 31, 57, 58, 63])
@pytest.mark.parametrize("count", [0, 7, 65_535, 65_536, 131_079, 200_001])
def test_bits_packed_in_byte_columns_are_the_word_streams_bytes_and_come_back(
    width: int, count: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Eight values of ``width`` bits fill ``width`` bytes: moved in those byte columns (the CPU's path for many
    values, widths up to 57), the stream is byte for byte what the int64 words write, padding included, and every
    value comes back, from a view at an offset too."""
    calls = {"packed": 0, "unpacked": 0}
    for name, key in (("_pack_groups", "packed"), ("_unpack_groups", "unpacked")):
        monkeypatch.setattr(indices_module, name, _counted(calls, key, getattr(indices_module, name)))
    gen = torch.Generator().manual_seed(width * 100_003 + count)
    values = torch.randint(-(2**63), 2**63 - 1, (count,), generator=gen) & ((1 << width) - 1)
    if count:
        values[0] = (1 << width) - 1  # every bit of a field set: no carry into its neighbours
    for padding in (0, 5):
        nbytes = (count * width + 7) // 8 + padding
        packed = pack_bits(values, width, nbytes)
        assert torch.equal(packed, pack_words(values, width, nbytes))
        assert torch.equal(unpack_bits(packed, count, width), values)
        at_offset = torch.cat([torch.zeros(3, dtype=torch.uint8), packed])[3:]
        assert torch.equal(unpack_bits(at_offset, count, width), values)
    assert calls["packed"] == (2 if width <= 57 and count >= 131_072 else 0)
    assert calls["unpacked"] == (4 if width <= 57 and count >= 65_536 else 0)


@pytest.mark.parametrize(
    ("indices", "expected"),
    [([], [0, 0]), ([5], [0, 1]), ([1, 4, 9, 12], [1, 3]), ([1, 4, 4, 12], None), ([9, 4], None)],
)
def test_edges_are_searchsorteds_where_the_indices_rise_and_none_elsewhere(
    indices: list[int], expected: list[int] | None
) -> None:
    got = edges_if_ascending(torch.tensor(indices, dtype=torch.int32), torch.tensor([3, 10]))
    assert got == expected
