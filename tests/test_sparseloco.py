"""SparseLoCo's reference wire and aggregation: the chunked selection and the 2-bit bins against references written
from their definitions, the exact wire size (12-bit indices, 2-bit codes, a table of bins), and the mean over the
ranks that chose each index on 2 and 3 real ranks, where the ranks' choices overlap and where they are disjoint."""

from __future__ import annotations

import math

import pytest
import torch
from ranks import run_ranks

from lightning_gradcomp.core.comm import AllgatherAggregator, ChoosersAggregator, Collectives, CommCounter, Contribution
from lightning_gradcomp.core.compressors import ChunkedTopKCompressor, TopKCompressor
from lightning_gradcomp.core.compressors.chunked import bin_values, largest_divisor_up_to
from lightning_gradcomp.core.pipeline_arguments import build_pipeline


def _reference_selection(x: torch.Tensor, chunk: int, flat_chunk: int, per_chunk: int) -> set[int]:
    """The flat indices SparseLoCo keeps, chunk by chunk in plain Python: the largest divisors of each side not above
    the chunk's, the ``per_chunk`` entries of largest magnitude of each chunk."""
    if x.dim() >= 2:
        rows, cols = x.shape[0], x.numel() // x.shape[0]
        matrix = x.reshape(rows, cols)
        r = max(d for d in range(1, min(rows, chunk) + 1) if rows % d == 0)
        c = max(d for d in range(1, min(cols, chunk) + 1) if cols % d == 0)
    else:
        rows, cols = 1, x.numel()
        matrix = x.reshape(1, cols)
        r, c = 1, max(d for d in range(1, min(cols, flat_chunk) + 1) if cols % d == 0)
    kept = set()
    for top in range(0, rows, r):
        for left in range(0, cols, c):
            block = matrix[top : top + r, left : left + c].reshape(-1)
            for local in block.abs().topk(min(per_chunk, r * c)).indices.tolist():
                kept.add((top + local // c) * cols + left + local % c)
    return kept


@pytest.mark.parametrize(
    ("shape", "chunk", "flat_chunk", "per_chunk"),
    [((128, 384), 64, 4096, 64), ((100, 96), 64, 4096, 64), ((5000,), 64, 4096, 64), ((7, 3, 3, 64), 64, 4096, 64),
     ((64,), 64, 4096, 64), ((96, 40), 32, 4096, 5), ((12288,), 64, 4096, 17)],
)  # fmt: skip
def test_the_chunked_selection_is_the_definitions(shape: tuple, chunk: int, flat_chunk: int, per_chunk: int) -> None:
    x = torch.randn(shape, generator=torch.Generator().manual_seed(len(shape) * 100 + shape[0]))
    codec = ChunkedTopKCompressor(per_chunk, chunk, flat_chunk, quantization_bins=None)
    payload = codec.compress(x)
    expected = _reference_selection(x, chunk, flat_chunk, per_chunk)
    assert payload.indices.numel() == len(expected) == payload.selected
    assert set(payload.indices.tolist()) == expected
    assert torch.equal(payload.values, x.reshape(-1)[payload.indices])  # float values sent as they are
    decoded = codec.decompress(payload)
    assert torch.equal(decoded[payload.indices], payload.values) and int((decoded != 0).sum()) == len(expected)


def test_the_divisor_rule_is_the_reference_configurations() -> None:
    assert [largest_divisor_up_to(n, 64) for n in (64, 128, 100, 96, 97, 30, 4096 * 3)] == [64, 64, 50, 48, 1, 30, 64]


def _reference_bins(values: torch.Tensor, bins: int, spread: float) -> tuple[list[int], list[float]]:
    """Each value's bin and each bin's decoded value, from the definition in float64: bins of width ``spread * sigma
    / bins`` centred on the mean (``sigma`` with Bessel's correction), a value's code its distance from the mean in
    widths rounded to the nearest integer plus ``bins / 2``, clamped to ``[0, bins - 1]``; a bin decodes as the mean of
    its values."""
    v = [float(a) for a in values.double()]
    mean = sum(v) / len(v)
    sigma = math.sqrt(sum((a - mean) ** 2 for a in v) / (len(v) - 1))
    width = spread * sigma / bins
    codes = [min(bins - 1, max(0, round((a - mean) / width) + bins // 2)) for a in v]
    table = []
    for b in range(bins):
        members = [a for a, code in zip(v, codes, strict=True) if code == b]
        table.append(sum(members) / len(members) if members else mean)
    return codes, table


def _check_bins(values: torch.Tensor, codes: torch.Tensor, table: torch.Tensor, bins: int) -> None:
    expected_codes, expected_table = _reference_bins(values, bins, 6.0)
    # codes: exact. Only a value within float32 rounding of a bin's edge could land in the other bin (the code is
    # computed in float32 from a float32 mean and deviation: a few times 2^-24 of the values' magnitude, under 1e-6
    # here); none lies that close, checked first
    mean, sigma = float(values.double().mean()), float(values.double().std())
    edges = [(b - bins // 2 + 0.5) * 6.0 * sigma / bins + mean for b in range(bins - 1)]
    assert min(abs(float(v) - e) for v in values for e in edges) > 1e-6
    assert codes.tolist() == expected_codes
    # the table: the bins' means, summed in float32 in another order than the float64 reference (rounding only)
    torch.testing.assert_close(table.double(), torch.tensor(expected_table, dtype=torch.float64), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("bins", [4, 16])
def test_the_bins_are_the_definitions(bins: int) -> None:
    values = torch.randn(3000, generator=torch.Generator().manual_seed(bins)) * 0.1 + 0.3
    codes, table = bin_values(values, bins, 6.0)
    _check_bins(values, codes, table, bins)
    assert len(set(codes.tolist())) == bins  # every bin used (the outer ones by clamping): each was exercised


def test_the_chunked_compressor_sends_the_bins_of_its_selection() -> None:
    x = torch.randn(256, 512, generator=torch.Generator().manual_seed(4))
    payload = ChunkedTopKCompressor().compress(x)
    _check_bins(x.reshape(-1)[payload.indices], payload.codes, payload.table, 4)
    assert torch.equal(payload.values, payload.table[payload.codes.long()])
    # the largest magnitudes of each chunk lie on either side of the mean: two of the four bins carry them
    assert sorted(set(payload.codes.tolist())) == [1, 3]


def test_the_wire_is_12_bit_indices_2_bit_codes_and_a_table_and_round_trips() -> None:
    codec = ChunkedTopKCompressor()
    x = torch.randn(256, 384, generator=torch.Generator().manual_seed(1))
    payload = codec.compress(x)
    selected = (256 // 64) * (384 // 64) * 64
    assert payload.nbytes == math.ceil(selected * 12 / 8) + math.ceil(selected * 2 / 8) + 4 * 4
    assert payload.to_bytes().numel() == payload.nbytes == codec.payload_nbytes(x.shape, x.dtype)
    assert 32 * x.numel() / (8 * payload.nbytes) > 100  # over a hundred times fewer bytes than float32
    back = codec.unpack(payload.to_bytes(), x.shape, x.dtype)
    assert torch.equal(back.indices, payload.indices) and torch.equal(back.values, payload.values)
    corrupt = payload.to_bytes().clone()
    corrupt[: math.ceil(selected * 12 / 8)] = 255  # every local index 4095: in range for 64 x 64 chunks
    assert int(codec.unpack(corrupt, x.shape, x.dtype).local.max()) == 4095
    with pytest.raises(ValueError, match="a chunk-local index 2047 is out of range for chunks of 1920"):  # 48 x 40
        codec.unpack(codec.compress(torch.randn(48, 40)).to_bytes().clone().fill_(255), torch.Size([48, 40]), x.dtype)
    with pytest.raises(ValueError, match="expected 1360 for shape"):
        codec.unpack(torch.zeros(10, dtype=torch.uint8), torch.Size([128, 384]), x.dtype)


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"per_chunk": 0}, "per_chunk"),
        ({"chunk": 0}, "chunk"),
        ({"flat_chunk": -1}, "flat_chunk"),
        ({"quantization_bins": 6}, "power of two"),
        ({"quantization_bins": 512}, "quantization_bins"),
        ({"quantization_range": 0.0}, "quantization_range"),
    ],
)
def test_bad_arguments_are_refused_by_name(arguments: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ChunkedTopKCompressor(**arguments)


#: Each rank's chosen indices among 12 (values 10 * (rank + 1) + index): overlapping choices, then disjoint ones.
CHOICES = {
    "overlapping": {0: [0, 1, 2], 1: [1, 2, 3], 2: [2, 3, 4]},
    "disjoint": {0: [0, 1, 2], 1: [3, 4, 5], 2: [6, 7, 8]},
}


def _vector(rank: int, chosen: list[int]) -> torch.Tensor:
    """Twelve entries, the chosen ones far the largest (so Top-k chooses them), each value telling rank and index."""
    x = torch.full((12,), 0.001 * (rank + 1))
    x[chosen] = torch.tensor([10.0 * (rank + 1) + i for i in chosen])
    return x


def _averages(rank: int, world_size: int) -> dict[str, list[list[float]]]:
    codec = TopKCompressor(density=0.25)  # 3 of 12
    collectives = Collectives(None, CommCounter())
    out = {}
    for case, choices in CHOICES.items():
        payload = codec.compress(_vector(rank, choices[rank]))
        out[case] = [
            aggregator.aggregate([Contribution(codec, payload)], collectives)[0].mean.tolist()
            for aggregator in (ChoosersAggregator(), AllgatherAggregator())
        ]
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_the_choosers_mean_averages_each_index_over_the_ranks_that_chose_it(world_size: int) -> None:
    ranks = run_ranks(_averages, world_size)
    for case, choices in CHOICES.items():
        chosen = {r: choices[r] for r in range(world_size)}
        expected_choosers, expected_ranks = [], []
        for i in range(12):
            values = [10.0 * (r + 1) + i for r in range(world_size) if i in chosen[r]]
            expected_choosers.append(sum(values) / len(values) if values else 0.0)
            expected_ranks.append(sum(values) / world_size)
        for outcome in ranks:  # every rank holds the same means
            choosers, over_ranks = outcome[case]
            assert choosers == pytest.approx(expected_choosers, rel=1e-6), case
            assert over_ranks == pytest.approx(expected_ranks, rel=1e-6), case  # the plain allgather divides by P
        if case == "disjoint":  # each index chosen once: its chooser's own value, undivided
            assert ranks[0][case][0][:3] == pytest.approx([10.0, 11.0, 12.0])


def test_the_choosers_mean_needs_chosen_entries() -> None:
    with pytest.raises(ValueError, match="aggregator='allgather_choosers' averages each index over the ranks"):
        build_pipeline("qsgd", None, None, None, "none", None, "allgather_choosers")
    codec, _ = build_pipeline("topk", None, 0.1, "2bit", "ef", None, "allgather_choosers")
    assert codec.selects_entries
