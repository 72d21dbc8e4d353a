"""The planar rows of small codes (ternary codes, QSGD's 4-bit levels): the byte and field of every code as the layout
defines them, ranges read back from inside rows and the last, partial row, tied draws stepped into their fields, and
the compiled draws and decodes equal to the eager ones for blocks shorter than a stripe, as long as one, longer than a
row, and not lined up with the rows at all."""

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
    unpack_codes,
)
from lightning_gradcomp.core.compressors.quantizer import BlockQuantizer
from lightning_gradcomp.core.compressors.ternary import CodePacking, _counter_codes
from lightning_gradcomp.core.fused import set_codec_mode
from lightning_gradcomp.core.randomness import CounterStream

#: (per_byte, bias, pad): ternary codes, 4-bit levels, 8-bit levels.
LAYOUTS = [(4, 1, 1), (2, 7, 0), (1, 20, 0)]


@pytest.fixture
def mode() -> object:
    yield set_codec_mode
    fused_module._mode = None


def _reference_places(numel: int, per_byte: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Byte and field of each code, from the layout's definition: code ``b + k * STRIPE`` of a whole row in field
    ``k`` of the row's byte ``b``; the last row of ``m`` codes in stripes of ``ceil(m / per_byte)``."""
    row = per_byte * STRIPE
    whole = numel // row * row
    stripe = max(1, -(-(numel - whole) // per_byte))
    j = torch.arange(numel)
    in_tail = j >= whole
    offset = torch.where(in_tail, j - whole, j % row)
    plane = torch.where(in_tail, stripe, STRIPE)
    byte = torch.where(in_tail, whole // per_byte, j // row * STRIPE) + offset % plane
    return byte, offset // plane


def _codes(numel: int, per_byte: int, seed: int) -> torch.Tensor:
    top = {4: 1, 2: 7, 1: 20}[per_byte]
    return torch.randint(-top, top + 1, (numel,), dtype=torch.int8, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize(("per_byte", "bias", "pad"), LAYOUTS, ids=["2-bit", "4-bit", "8-bit"])
@pytest.mark.parametrize("numel", [1, 5, 511, 1024, 2047, 2048, 2049, 3 * 2048 + 1001])
def test_every_code_lies_in_the_byte_and_field_the_layout_defines(
    per_byte: int, bias: int, pad: int, numel: int
) -> None:
    codes = _codes(numel, per_byte, numel)
    packed = pack_codes(codes, per_byte, bias, pad)
    assert packed.numel() == planar_nbytes(numel, per_byte) == -(-numel // per_byte)
    byte, field = _reference_places(numel, per_byte)
    width = 8 // per_byte
    expected = torch.full((packed.numel(), per_byte), pad, dtype=torch.int64)
    expected[byte, field] = codes.to(torch.int64) + bias
    weights = 1 << (width * torch.arange(per_byte))
    assert torch.equal(packed.to(torch.int64), (expected * weights).sum(1))
    found_byte, shift = field_positions(torch.arange(numel), numel, per_byte)
    assert torch.equal(found_byte, byte) and torch.equal(shift, (field * width).to(torch.int32))


@pytest.mark.parametrize(("per_byte", "bias", "pad"), LAYOUTS, ids=["2-bit", "4-bit", "8-bit"])
def test_any_range_reads_back_from_inside_rows_and_the_last_row(per_byte: int, bias: int, pad: int) -> None:
    numel = 5 * 2048 + 777
    codes = _codes(numel, per_byte, 3)
    packed = pack_codes(codes, per_byte, bias, pad)
    for start, count in [(0, numel), (1, 1), (511, 3), (1023, 2050), (2048, 2048), (numel - 900, 900), (numel - 1, 1)]:
        assert torch.equal(unpack_codes(packed, numel, start, count, per_byte, bias), codes[start : start + count])


def test_steps_added_in_place_move_only_their_own_fields() -> None:
    numel = 2048 + 13
    packing = CodePacking(4, bias=1, pad=1)
    codes = torch.zeros(numel, dtype=torch.int8)
    positions = torch.tensor([0, 1, 512, 1536, 2047, 2048, 2050, numel - 1])
    steps = torch.tensor([1, -1, 1, -1, 1, -1, 1, -1], dtype=torch.int8)
    packed = packing.step_(packing.pack(codes), numel, positions, steps)
    codes[positions] += steps
    assert torch.equal(packing.unpack(packed, numel, 0, numel), codes)


@pytest.mark.parametrize(
    ("numel", "block_size"),
    [(9000, 256), (3 * 2048 + 5, 512), (9000, 4096), (7000, 1000), (2 * 2048 + 700, 2048), (9000, 1536)],
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
        QSGDCompressor(levels=7, block_size=4096),
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
