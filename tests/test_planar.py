"""The planar rows of small codes in 32-bit words (ternary codes, QSGD's 4-bit and 8-bit levels): the word and field
of every code as the layout defines them, ranges read back from inside rows and the last, partial row, tied draws
stepped into their fields, and the compiled draws and decodes equal to the eager ones for blocks shorter than a
stripe, as long as one, longer than a row, and not lined up with the rows at all."""

from __future__ import annotations

import pytest
import torch

import lightning_gradcomp.core.fused as fused_module
from lightning_gradcomp.core.compressors import QSGDCompressor
from lightning_gradcomp.core.compressors.kernels import draw_codes, draw_packed_codes, mean_of_fields_, stochastic_codes
from lightning_gradcomp.core.compressors.planar import (
    STRIPE,
    field_positions,
    pack_codes,
    planar_nbytes,
    row_codes,
    unpack_codes,
)
from lightning_gradcomp.core.compressors.quantizer import BlockQuantizer
from lightning_gradcomp.core.compressors.ternary import CodePacking, _counter_codes
from lightning_gradcomp.core.fused import set_codec_mode
from lightning_gradcomp.core.randomness import CounterStream

#: (numel, block_size) against a ternary row of 8192 codes (two rows of 4-bit levels): blocks shorter than a stripe,
#: a stripe, two rows, not lining up with the stripes, a row, three stripes (a row is not a whole number of them).
ROW_SIZED_CASES = [
    (2 * 8192 + 809, 256),
    (3 * 8192 + 5, 512),
    (3 * 8192 + 809, 16384),
    (7000, 1000),
    (2 * 8192 + 700, 8192),
    (2 * 8192 + 809, 1536),
]
#: (per_byte, bias, pad): ternary codes, 4-bit levels, 8-bit levels.
LAYOUTS = [(4, 1, 1), (2, 7, 0), (1, 20, 0)]


@pytest.fixture
def mode() -> object:
    yield set_codec_mode
    fused_module._mode = None


def _reference_places(numel: int, per_byte: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Word and field of each code, from the layout's definition: code ``v + k * STRIPE`` of a whole row in field
    ``k`` of the row's word ``v``; the last row of ``m`` codes in stripes of ``ceil(m / (4 per_byte))`` words."""
    row = 4 * per_byte * STRIPE
    whole = numel // row * row
    stripe = max(1, -(-(numel - whole) // (4 * per_byte)))
    j = torch.arange(numel)
    in_tail = j >= whole
    offset = torch.where(in_tail, j - whole, j % row)
    plane = torch.where(in_tail, stripe, STRIPE)
    word = torch.where(in_tail, whole // (4 * per_byte), j // row * STRIPE) + offset % plane
    return word, offset // plane


def _codes(numel: int, per_byte: int, seed: int) -> torch.Tensor:
    top = {4: 1, 2: 7, 1: 20}[per_byte]
    return torch.randint(-top, top + 1, (numel,), dtype=torch.int8, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize(("per_byte", "bias", "pad"), LAYOUTS, ids=["2-bit", "4-bit", "8-bit"])
@pytest.mark.parametrize("numel", [1, 5, 511, 2048, 4095, 4096, 4097, 8191, 8192, 8193, 3 * 8192 + 1001])
def test_every_code_lies_in_the_word_and_field_the_layout_defines(
    per_byte: int, bias: int, pad: int, numel: int
) -> None:
    codes = _codes(numel, per_byte, numel)
    packed = pack_codes(codes, per_byte, bias, pad)
    assert packed.numel() == planar_nbytes(numel, per_byte) == 4 * -(-numel // (4 * per_byte))
    word, field = _reference_places(numel, per_byte)
    width, per_word = 8 // per_byte, 4 * per_byte
    expected = torch.full((packed.numel() // 4, per_word), pad, dtype=torch.int64)
    expected[word, field] = codes.to(torch.int64) + bias
    words = (expected << (width * torch.arange(per_word))).sum(1)  # little-endian: byte i holds bits 8i .. 8i + 7
    assert torch.equal(packed.view(-1, 4).to(torch.int64), (words[:, None] >> (8 * torch.arange(4))) & 255)
    found_byte, shift = field_positions(torch.arange(numel), numel, per_byte)
    bit = field * width
    assert torch.equal(found_byte, 4 * word + bit // 8) and torch.equal(shift, (bit % 8).to(torch.int32))


@pytest.mark.parametrize(("per_byte", "bias", "pad"), LAYOUTS, ids=["2-bit", "4-bit", "8-bit"])
def test_any_range_reads_back_from_inside_rows_and_the_last_row(per_byte: int, bias: int, pad: int) -> None:
    row = row_codes(per_byte)
    numel = 5 * row + 777
    codes = _codes(numel, per_byte, 3)
    packed = pack_codes(codes, per_byte, bias, pad)
    ranges = [(0, numel), (1, 1), (511, 3), (row // 2 - 1, row + 2), (row, row), (numel - 900, 900), (numel - 1, 1)]
    for start, count in ranges:
        assert torch.equal(unpack_codes(packed, numel, start, count, per_byte, bias), codes[start : start + count])


def test_steps_added_in_place_move_only_their_own_fields() -> None:
    numel = 8192 + 13
    packing = CodePacking(4, bias=1, pad=1)
    codes = torch.zeros(numel, dtype=torch.int8)
    positions = torch.tensor([0, 1, 512, 1536, 2047, 8191, 8192, 8194, numel - 1])
    steps = torch.tensor([1, -1, 1, -1, 1, -1, 1, -1, 1], dtype=torch.int8)
    packed = packing.step_(packing.pack(codes), numel, positions, steps)
    codes[positions] += steps
    assert torch.equal(packing.unpack(packed, numel, 0, numel), codes)


@pytest.mark.parametrize(
    ("numel", "block_size"),
    ROW_SIZED_CASES,
    ids=["short-blocks", "stripe-blocks", "long-blocks", "unaligned-blocks", "row-blocks", "stripes-not-rows"],
)
@pytest.mark.parametrize("levels", [False, True], ids=["ternary", "levels"])
def test_compiled_draws_are_the_eager_chunks_and_the_element_order_codes(
    mode: object, numel: int, block_size: int, levels: bool
) -> None:
    # the last, partial row across several blocks is drawn eagerly after the compiled rows (inductor computed wrong
    # multipliers there): the same bytes; blocks that do not line up with the stripes are drawn unpacked, then packed
    g = torch.randn(numel, generator=torch.Generator().manual_seed(numel))
    blocks = -(-numel // block_size)
    multipliers = torch.rand(blocks, generator=torch.Generator().manual_seed(1)) * 3 + 0.5
    if not levels:  # ternary: keep probabilities |g| m / 256
        multipliers *= 100
    per_byte, bias, pad = (2, 7, 0) if levels else (4, 1, 1)
    cap = torch.tensor(7.0) if levels else None
    packing = CodePacking(per_byte, bias=bias, pad=pad)
    results = []
    for codecs in ("compiled", "eager"):
        mode(codecs)
        packed = torch.empty(packing.nbytes(numel), dtype=torch.uint8)
        results.append(_counter_codes(g, multipliers, block_size, CounterStream(4), cap, levels, packing, packed))
    assert torch.equal(results[0], results[1])
    codes = stochastic_codes(g, multipliers, CounterStream(4).block(numel), cap, 0, block_size, levels)[:numel]
    assert torch.equal(packing.unpack(results[0], numel, 0, numel), codes) and int((codes != 0).sum()) > numel // 10


def test_the_compiled_draw_kernels_run_on_the_rows_they_are_given(mode: object) -> None:
    # whole rows of aligned blocks: one packed kernel; blocks that do not line up with the rows: eager chunks
    mode("compiled")
    g = torch.randn(4 * 2048 + 3, generator=torch.Generator().manual_seed(2))
    packing = CodePacking(4, bias=1, pad=1)
    for block_size, packed_calls in [(512, 1), (1000, 0), (1536, 0)]:
        multipliers = torch.full((-(-g.numel() // block_size),), 900.0)
        calls = [draw_codes.compiled_calls, draw_packed_codes.compiled_calls]
        packed = torch.empty(packing.nbytes(g.numel()), dtype=torch.uint8)
        _counter_codes(g, multipliers, block_size, CounterStream(1), None, False, packing, packed)
        assert [draw_codes.compiled_calls, draw_packed_codes.compiled_calls] == [calls[0], calls[1] + packed_calls]


@pytest.mark.parametrize(
    "compressor",
    [
        QSGDCompressor(levels=7, block_size=256),
        QSGDCompressor(levels=7, block_size=8192),
        BlockQuantizer(2, 256),
        BlockQuantizer(2, 1536),
    ],
    ids=["levels-short-blocks", "levels-long-blocks", "ternary-short-blocks", "ternary-stripes-not-rows"],
)
def test_compiled_means_and_adds_over_any_aligned_blocks_are_the_eager_sums(mode: object, compressor: object) -> None:
    numel = 3 * 4096 + 333
    payloads = []
    for rank in range(2):
        x = torch.randn(numel, generator=torch.Generator().manual_seed(rank))
        payload = compressor.compress(x, CounterStream(10 + rank))
        payloads.append(compressor.unpack(payload.to_bytes().clone(), x.shape, x.dtype))
    means, added = [], []
    calls = mean_of_fields_.compiled_calls
    for codecs in ("compiled", "eager"):
        mode(codecs)
        means.append(compressor.average_all(payloads, torch.full((numel,), 5.0), 2))
        # one pass, the quantizer's ternary mean too; blocks that do not line up with the rows, eagerly
        assert mean_of_fields_.compiled_calls == calls + (compressor.block_size != 1536)
        added.append(payloads[0].entries().split([100, numel - 200, 100])[1].add_to_(torch.ones(numel - 200)))
    assert torch.equal(means[0], means[1]) and torch.equal(added[0], added[1])
    dense = [compressor.decompress(p) for p in payloads]
    assert torch.equal(added[1], 1 + dense[0][100:-100])
    assert torch.equal(means[1], (dense[0] + dense[1]) / 2)
