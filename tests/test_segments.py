"""Segments: a unit read in pieces selects, and takes its average back, exactly as its concatenation would."""

from __future__ import annotations

import pytest
import torch

from lightning_gradcomp.core.compressors import DGCCompressor, GaussianKCompressor, IdentityCompressor, TopKCompressor
from lightning_gradcomp.core.compressors.precision import WirePrecision
from lightning_gradcomp.core.compressors.segments import Segments, adjoining, pieces

SIZES = (300_000, 7, 1_000_000, 4096)


def _parts(seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=generator) for n in SIZES]


# 0.001 takes the block maxima, 0.01 and above the streamed pass, 0.9 the exact fallback path's neighbourhood
@pytest.mark.parametrize("density", [0.001, 0.01, 0.1, 0.9])
@pytest.mark.parametrize("codec", [TopKCompressor, DGCCompressor])
def test_selection_from_pieces_equals_selection_from_their_concatenation(density: float, codec: type) -> None:
    parts = _parts()
    compressor = codec(density=density)
    for seed in range(3):
        flat = compressor.compress(torch.cat(parts), torch.Generator().manual_seed(seed))
        pieced = compressor.compress(Segments(parts), torch.Generator().manual_seed(seed))
        assert torch.equal(flat.indices, pieced.indices) and torch.equal(flat.values, pieced.values)
        assert pieced.shape == torch.Size([sum(SIZES)])


@pytest.mark.parametrize("density", [0.001, 0.01, 0.1])
def test_gaussian_k_from_pieces_keeps_its_guarantees(density: float) -> None:
    # Pieces are reduced one by one, so the threshold may differ from the concatenation's by rounding: the
    # count and the largest-entries property must hold all the same, and at low densities the same set comes out.
    parts = _parts(4)
    parts[1] = parts[1] * 10  # a piece of outliers
    flat = torch.cat(parts)
    compressor = GaussianKCompressor(density)
    k = int(density * flat.numel())
    pieced = compressor.compress(Segments(parts))
    assert k // 2 <= pieced.k <= k
    chosen = torch.zeros(flat.numel(), dtype=torch.bool).index_put_((pieced.indices,), torch.tensor(True))
    assert torch.equal(pieced.values, flat[pieced.indices])
    assert flat[chosen].abs().min() >= flat[~chosen].abs().max()
    assert pieced.nbytes == compressor.payload_nbytes(pieced.shape, pieced.dtype)
    if density < 0.1:
        assert torch.equal(pieced.indices.sort().values, compressor.compress(flat).indices.sort().values)


def test_exact_top_k_of_pieces_is_the_top_k_of_the_concatenation() -> None:
    parts = _parts(1)
    k = 5000
    expected = torch.topk(torch.cat(parts).abs(), k).indices.sort().values
    assert torch.equal(Segments(parts).topk_indices(k).sort().values, expected)
    # without a generator Top-k is exact: the same set either way
    flat = TopKCompressor(0.002).compress(torch.cat(parts))
    pieced = TopKCompressor(0.002).compress(Segments(parts))
    assert torch.equal(flat.indices.sort().values, pieced.indices.sort().values)


def test_scatters_into_pieces_equal_the_flat_tensors() -> None:
    parts = _parts(2)
    flat = torch.cat(parts)
    generator = torch.Generator().manual_seed(3)
    indices = torch.randint(0, flat.numel(), (20_000,), generator=generator)  # repeats included
    values = torch.randn(20_000, generator=generator)
    segments = Segments([p.clone() for p in parts])
    assert torch.equal(segments.gather(indices), flat[indices])
    ascending = indices.sort().values
    assert torch.equal(segments.gather(ascending, ascending=True), flat[ascending])
    inside_one = torch.arange(300_010, 300_020)  # every index in the third part: the others get nothing
    assert torch.equal(segments.gather(inside_one, ascending=True), flat[inside_one])
    segments.index_add_(0, indices, values, alpha=0.5).div_(3.0)
    expected = flat.clone().index_add_(0, indices, values, alpha=0.5).div_(3.0)
    assert torch.equal(torch.cat(segments.parts), expected)
    unique = torch.unique(indices)
    segments.zero_().index_put_((unique,), values[: unique.numel()])
    assert torch.equal(
        torch.cat(segments.parts), torch.zeros_like(flat).index_put_((unique,), values[: unique.numel()])
    )
    assert [p.data_ptr() for p in pieces(segments, SIZES)] == [p.data_ptr() for p in segments.parts]
    assert [p.numel() for p in pieces(flat, SIZES)] == list(SIZES)


@pytest.mark.parametrize("density", [0.002, 0.01])  # 0.6% of the entries landed: divided one by one; 3%: streamed
@pytest.mark.parametrize("wire", [None, "fp16"])
def test_the_sparse_mean_into_pieces_is_the_streamed_division_of_the_summed_entries(
    wire: str | None, density: float
) -> None:
    topk = TopKCompressor(density=density)
    codec = topk if wire is None else WirePrecision(topk, wire)
    received = []  # three ranks' selections, sent and parsed as the allgather's peers are (they overlap)
    for seed in range(3):
        payload = codec.compress(Segments(_parts(seed)), torch.Generator().manual_seed(seed))
        received.append(codec.unpack(payload.to_bytes(), torch.Size([sum(SIZES)]), torch.float32))
    expected = codec.accumulate_all(received, torch.zeros(sum(SIZES))).div_(3)
    arrived = [p.arrived() for p in received] if wire else received
    for average in (codec.average_all, lambda *args: topk.average_where_landed(arrived, *args[1:])):
        segments = Segments([p.clone() for p in _parts(4)])
        average(received, segments, 3)
        assert torch.equal(torch.cat(segments.parts), expected)  # every entry, none left over from the pieces
        assert torch.equal(average(received, torch.cat(_parts(4)), 3), expected)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("wire", [None, "bf16"])
def test_a_sparse_mean_over_a_power_of_two_ranks_scales_each_entry_and_equals_the_divided_sum_bit_for_bit(
    wire: str | None, world: int
) -> None:
    """Over 2 or 4 ranks the mean adds each entry times ``1 / world`` (no division pass): the sum of the overlapping
    selections divided by ``world``, bit for bit, into one tensor and into pieces; 3 ranks divide as before."""
    topk = TopKCompressor(density=0.01)
    codec = topk if wire is None else WirePrecision(topk, wire)
    received = []
    for seed in range(world):
        payload = codec.compress(Segments(_parts(seed)), torch.Generator().manual_seed(seed))
        received.append(codec.unpack(payload.to_bytes(), torch.Size([sum(SIZES)]), torch.float32))
    summed = codec.accumulate_all(received, torch.zeros(sum(SIZES)))
    expected = summed / world
    landed = int((summed != 0).sum())
    assert max(p.selected for p in received) < landed < sum(p.selected for p in received)  # they differ and overlap
    segments = Segments([p.clone() for p in _parts(4)])
    codec.average_all(received, segments, world)
    assert torch.equal(torch.cat(segments.parts), expected)
    assert torch.equal(codec.average_all(received, torch.cat(_parts(4)), world), expected)
    scaled = topk.average_scaled([p.arrived() for p in received] if wire else received, torch.empty(sum(SIZES)), 3)
    assert not torch.equal(scaled, summed / 3)  # 1/3 is inexact: three ranks divide the sum instead


@pytest.mark.parametrize("wire", [None, "fp16", "bf16"])
def test_a_dense_unit_read_in_pieces_is_summed_and_decoded_as_its_flat_copy(wire: str | None) -> None:
    """The dense wire (``ddp_fp16``'s: a unit across DDP's buckets) joins the pieces into its summand in the pass that
    scales them, and a half wire's mean lands in the pieces themselves: the flat copy's numbers, bit for bit."""
    codec = IdentityCompressor() if wire is None else WirePrecision(IdentityCompressor(), wire)
    parts = _parts(5)
    flat = torch.cat(parts)
    kept: dict[tuple, torch.Tensor] = {}

    def scratch(role: str, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return kept.setdefault((role, numel, dtype), torch.empty(numel, dtype=dtype, device=device))

    in_pieces, joined = codec.compress(Segments(parts)), codec.compress(flat)
    expected = codec.summable(joined, 3).clone()
    summand = codec.summable(in_pieces, 3, scratch)
    assert summand.dtype == expected.dtype and torch.equal(summand, expected)
    assert in_pieces.nbytes == joined.nbytes and torch.equal(in_pieces.to_bytes(), joined.to_bytes())
    assert torch.equal(codec.decompress(in_pieces), codec.decompress(joined))
    total = summand * 3  # what three ranks with this summand would sum to
    mean = codec.from_sum(total.clone(), in_pieces, 3, out=Segments(parts))
    expected_mean = codec.from_sum(total.clone(), joined, 3, out=torch.empty_like(flat))
    assert torch.equal(torch.cat(pieces(mean, SIZES)), expected_mean)
    if wire is not None:  # cast back straight into the pieces: no flat mean to copy from
        assert [m.data_ptr() for m in pieces(mean, SIZES)] == [p.data_ptr() for p in parts]
    accumulated = codec.accumulate(joined, Segments([torch.ones(n) for n in SIZES]))
    assert torch.equal(torch.cat(accumulated.parts), codec.decompress(joined) + 1)
    assert torch.equal(codec.accumulate(in_pieces, torch.ones(sum(SIZES))), codec.decompress(joined) + 1)


def test_segments_refuse_what_they_cannot_be() -> None:
    with pytest.raises(ValueError, match="at least one part"):
        Segments([])
    with pytest.raises(ValueError, match="one dtype and device"):
        Segments([torch.zeros(3), torch.zeros(3, dtype=torch.float64)])
    segments = Segments([torch.zeros(3), torch.zeros(4)])
    with pytest.raises(ValueError, match=r"cannot be split as \[4, 3\]"):
        segments.split([4, 3])
    with pytest.raises(ValueError, match="cannot take the shape"):
        segments.reshape(7, 1)
    with pytest.raises(ValueError, match="dim must be 0"):
        segments.index_add_(1, torch.tensor([0]), torch.tensor([1.0]))


def test_parts_back_to_back_in_one_buffer_are_read_as_one_view_of_it() -> None:
    bucket = torch.arange(20.0)
    parts = [bucket[2:5], bucket[5:12].view(7, 1), bucket[12:20]]  # as DDP's bucket holds a unit's gradients
    flat = adjoining(parts)
    assert flat is not None and flat.shape == (18,) and flat.data_ptr() == bucket[2:].data_ptr()
    assert torch.equal(flat, bucket[2:20])
    flat.mul_(-1)  # written through: the bucket sees it
    assert torch.equal(bucket[2:], -torch.arange(2.0, 20.0)) and torch.equal(bucket[:2], torch.arange(2.0))
    other = torch.zeros(8)
    assert adjoining([bucket[2:5], bucket[6:9]]) is None  # a gap
    assert adjoining([bucket[5:8], bucket[2:5]]) is None  # out of order
    assert adjoining([bucket[2:5], other[3:6]]) is None  # two buffers
    assert adjoining([bucket[0:8].view(2, 4).T, bucket[8:10]]) is None  # not contiguous
