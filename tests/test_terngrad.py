"""TernGrad and its 2-bit wire format: exact packing, unbiasedness checked statistically, bytes on
real ranks, bit-identical allgather/allreduce averages, the hook under torch DDP, and MNIST accuracy."""

from __future__ import annotations

import math
from collections.abc import Callable
from statistics import NormalDist

import pytest
import torch
import torch.distributed as dist
from ranks import run_ranks
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from lightning_gradcomp.core.comm import AllgatherAggregator, AllreduceAggregator, Collectives, Contribution
from lightning_gradcomp.core.compressors import qsgd as qsgd_module
from lightning_gradcomp.core.compressors import ternary
from lightning_gradcomp.core.compressors.quantizer import BlockQuantizer
from lightning_gradcomp.core.compressors.ternary import pack_2bit, packed_nbytes, unpack_2bit
from lightning_gradcomp.core.compressors.terngrad import TernGradCompressor
from lightning_gradcomp.core.memory import NoMemory
from lightning_gradcomp.ddp.hook import GradCompHook, gradcomp_comm_hook

#: Two-sided false-alarm rate of every statistical check (seeds are fixed, so each check is deterministic).
FALSE_ALARM = 1e-6
Z_LIMIT = NormalDist().inv_cdf(1 - FALSE_ALARM / 2)  # 4.89 standard deviations


def assert_unbiased(
    total: torch.Tensor, expected: torch.Tensor, magnitude: torch.Tensor, trials: int, exact_rtol: float = 1e-12
) -> None:
    """Check ``total / trials`` (sums of draws ``magnitude_j * sign * Bernoulli(p_j)``) against ``expected``.

    ``p_j = |expected_j| / magnitude_j``; one draw has variance ``magnitude_j |expected_j| - expected_j^2``.
    Two statistics, each with its standard deviation derived from those variances:

    * chi-square: ``X = sum_j z_j^2`` over elements with ``0 < p_j < 1``, ``z_j`` the standardised
      mean; ``E[X] = k`` and ``Var[X] = sum_j (2 + (1 - 6 p_j q_j) / (trials p_j q_j))`` (the
      binomial's fourth moment);
    * the sum over all elements, whose standardised error is ``N(0, 1)`` by the CLT.

    Elements with ``p_j`` in ``{0, 1}`` are deterministic and must match exactly (to ``exact_rtol``, for
    draws read back through float32 arithmetic).
    """
    total, expected, magnitude = total.double(), expected.double(), magnitude.double()
    mean = total / trials
    p = torch.where(magnitude > 0, expected.abs() / magnitude.clamp_min(1e-300), torch.zeros_like(magnitude))
    random = (p > 0) & (p < 1)
    deterministic = ~random
    torch.testing.assert_close(mean[deterministic], expected[deterministic], rtol=exact_rtol, atol=0.0)
    variance = magnitude * expected.abs() - expected**2
    pq = p * (1 - p)
    z = (mean - expected)[random] / torch.sqrt(variance[random] / trials)
    k = int(random.sum())
    assert k > 0, "no element is random: the check would be vacuous"
    chi2 = float((z**2).sum())
    chi2_sd = math.sqrt(float((2 + (1 - 6 * pq[random]) / (trials * pq[random])).sum()))
    assert abs(chi2 - k) <= Z_LIMIT * chi2_sd, f"chi-square {chi2:.1f} for {k} elements (sd {chi2_sd:.1f})"
    total_z = float((mean - expected).sum() / torch.sqrt(variance.sum() / trials))
    assert abs(total_z) <= Z_LIMIT, f"sum over elements off by {total_z:.2f} standard deviations"


# --------------------------------------------------------------------------------------------
# 2-bit packing


@pytest.mark.parametrize(
    "numel", [0, 1, 2, 3, 4, 5, 7, 8, 9, 1001, 4099, ternary.STREAM_CHUNK + 3, 2 * ternary.STREAM_CHUNK]
)
def test_pack_unpack_round_trip_for_every_length(numel: int) -> None:
    gen = torch.Generator().manual_seed(numel)
    for codes in (
        torch.randint(-1, 2, (numel,), generator=gen, dtype=torch.int8),
        torch.full((numel,), -1, dtype=torch.int8),
        torch.ones(numel, dtype=torch.int8),
        torch.zeros(numel, dtype=torch.int8),
    ):
        packed = pack_2bit(codes)
        assert packed.dtype == torch.uint8 and packed.shape == (4 * math.ceil(numel / 16),) == (packed_nbytes(numel),)
        assert torch.equal(unpack_2bit(packed, numel), codes)


def test_pack_reads_any_shape_in_flat_order_including_0_dim() -> None:
    scalar = torch.tensor(-1, dtype=torch.int8)
    assert torch.equal(unpack_2bit(pack_2bit(scalar), 1), scalar.reshape(1))
    matrix = torch.randint(-1, 2, (3, 5, 7), generator=torch.Generator().manual_seed(0), dtype=torch.int8)
    assert torch.equal(unpack_2bit(pack_2bit(matrix), matrix.numel()), matrix.reshape(-1))
    # non-contiguous input packs its elements in logical order
    assert torch.equal(unpack_2bit(pack_2bit(matrix.transpose(0, 2)), matrix.numel()), matrix.transpose(0, 2).flatten())


def test_pack_byte_layout_is_fixed() -> None:
    # code c is stored as c + 1; five codes are one partial planar row of one-word stripes: field k (bits 2k, 2k+1)
    # of the little-endian word holds code k, and the eleven fields past the end hold code 0 (bits 01)
    codes = torch.tensor([1, 0, -1, 1, -1], dtype=torch.int8)
    assert pack_2bit(codes).tolist() == [
        2 | 1 << 2 | 0 << 4 | 2 << 6,
        0 | 1 << 2 | 1 << 4 | 1 << 6,
        0b01010101,
        0b01010101,
    ]
    # a whole row of 8192 codes in 512 words: code 512 k + v in field k of word v, byte k // 4 of the word
    row = torch.zeros(8192, dtype=torch.int8)
    row[3], row[512 + 3], row[1536 + 3] = 1, -1, 1
    packed = pack_2bit(row)
    assert packed.numel() == 2048 and packed[4 * 3].item() == 2 | 0 << 2 | 1 << 4 | 2 << 6
    assert (packed[torch.arange(2048) != 4 * 3] == 0b01010101).all()


def test_pack_and_unpack_reject_wrong_inputs() -> None:
    with pytest.raises(ValueError, match="int8"):
        pack_2bit(torch.zeros(4, dtype=torch.int32))
    with pytest.raises(ValueError, match="take 4 bytes"):
        unpack_2bit(torch.zeros(3, dtype=torch.uint8), 5)
    with pytest.raises(ValueError, match="uint8"):
        unpack_2bit(torch.zeros(2, dtype=torch.int8), 5)


# --------------------------------------------------------------------------------------------
# TernGrad: hyper-parameters, wire format, reference equivalence


@pytest.mark.parametrize("bad", [-0.5, math.inf, math.nan, True, "2.5", None])
def test_bad_clip_sigma_is_rejected_with_the_allowed_range(bad: object) -> None:
    with pytest.raises(ValueError, match=r"clip_sigma must be a finite number >= 0.*got") as err:
        TernGradCompressor(clip_sigma=bad)  # type: ignore[arg-type]
    assert repr(bad) in str(err.value)


def test_bad_share_scale_is_rejected() -> None:
    with pytest.raises(ValueError, match="share_scale must be True or False, got 'yes'"):
        TernGradCompressor(share_scale="yes")  # type: ignore[arg-type]


def _clipped(x: torch.Tensor, clip_sigma: float) -> torch.Tensor:
    """The paper's clipping, written out: each element to +-c*std (skipped when the bound is 0)."""
    bound = clip_sigma * torch.std(x.float(), correction=0)
    return x.float().clamp(-bound, bound) if clip_sigma > 0 and bound > 0 else x.float()


def _gradient(numel: int = 2000, seed: int = 0) -> torch.Tensor:
    """Gaussian entries with a few large outliers, so that 2.5-sigma clipping bites."""
    x = torch.randn(numel, generator=torch.Generator().manual_seed(seed))
    x[:: numel // 10] *= 25
    return x


def reference_keep(levels: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """The two-stage draw written out: ``U_j = (B_j + V_j) / 256``, keep when ``U_j < levels_j / 256``.

    ``B_j`` is byte ``j`` of uniform int64 words; ``V_j`` is drawn (in index order) only where
    ``B_j = min(floor(levels_j), 255)``, and is 0 elsewhere, where it cannot change the comparison.
    """
    numel = levels.numel()
    words = torch.empty(-(-numel // 8), dtype=torch.int64).random_(-(2**63), None, generator=generator)
    draws = words.view(torch.uint8)[:numel].double()
    ties = torch.nonzero(draws == levels.double().floor().clamp(max=255)).reshape(-1)  # in index order
    second = torch.zeros(numel, dtype=torch.float64)
    second[ties] = torch.rand(ties.numel(), generator=generator).double()
    return draws + second < levels.double()


@pytest.mark.parametrize("levels", [0.5, 1.5, 254.25, 255.5, 256.0])
def test_the_byte_draw_is_exact_where_one_byte_cannot_decide(levels: float) -> None:
    # q = 0.5: only byte 0 can keep, and then only with the second uniform; the byte alone would keep
    # with probability 1/256 (B < q) or 0 (B < floor(q)). Without the second stage every random
    # case here is off by at least 1/1024, more than twice what the check tolerates.
    numel = 1_000_000
    generator = torch.Generator().manual_seed(4)
    g = torch.full((numel,), levels / 256)  # scale 1: q = 256 |g| = levels, exactly
    codes = ternary.stochastic_ternary(g, torch.ones(1), numel, generator)
    p = min(levels, 256.0) / 256
    measured = float(codes.double().mean())
    spread = math.sqrt(p * (1 - p) / numel)
    assert abs(measured - p) <= Z_LIMIT * spread + (1e-12 if p == 1 else 0), (measured, p)
    assert Z_LIMIT * spread < 1 / 2048


@pytest.mark.parametrize("clip_sigma", [2.5, 0.0])
def test_codes_follow_the_reference_draw_with_the_same_generator(clip_sigma: float) -> None:
    x = _gradient().reshape(40, 50)
    compressor = TernGradCompressor(clip_sigma=clip_sigma)
    payload = compressor.compress(x, torch.Generator().manual_seed(7))
    clipped = _clipped(x, clip_sigma).reshape(-1)
    scale = clipped.abs().max()
    keep = reference_keep(clipped.abs() * (256 / scale), torch.Generator().manual_seed(7))
    reference = torch.sign(clipped) * keep  # keep when U < |g| / s
    assert torch.equal(payload.scales, scale.reshape(1))
    assert torch.equal(compressor.local_scale(x), scale)
    assert torch.equal(payload.codes, reference.to(torch.int8))
    if clip_sigma > 0:
        assert scale < x.abs().max()  # the outliers were clipped
        assert (payload.codes[x.reshape(-1).abs() >= scale] != 0).all()  # clipped elements are always kept
    assert torch.equal(compressor.decompress(payload), (reference * scale).reshape(-1))


@pytest.mark.parametrize("block", [7, 512, None])
def test_bytes_drawn_chunk_by_chunk_are_the_stream_of_one_draw(block: int | None) -> None:
    # over several encoder chunks, with blocks that are not whole random words (7), DIANA's 512, and one block
    numel = 3 * ternary.ENCODE_CHUNK + 13
    block_size = numel if block is None else block
    g = torch.randn(numel, generator=torch.Generator().manual_seed(8))
    blocks = -(-numel // block_size)
    padded = torch.zeros(blocks * block_size).index_copy_(0, torch.arange(numel), g.abs())
    scales = padded.view(blocks, block_size).amax(dim=1)
    codes = ternary.stochastic_ternary(g, scales, block_size, torch.Generator().manual_seed(9))
    per_element = (ternary.DRAW_LEVELS / scales).repeat_interleave(block_size)[:numel]
    keep = reference_keep(g.abs() * per_element, torch.Generator().manual_seed(9))
    assert torch.equal(codes, (torch.sign(g) * keep).to(torch.int8))


@pytest.mark.parametrize(
    ("kind", "block"), [("ternary", 7), ("ternary", None), ("capped", None), ("levels", 512), ("wide levels", 33)]
)
def test_codes_drawn_into_their_packed_bytes_are_the_int8_draw_packed(kind: str, block: int | None) -> None:
    # over several encoder chunks and an odd length, with the tied elements' second uniforms (about one element in
    # 256 of a chunk) stepped into their packed fields afterwards: the same bytes as packing the int8 draw
    numel = 2 * ternary.ENCODE_CHUNK + 7
    block_size = numel if block is None else block
    g = torch.randn(numel, generator=torch.Generator().manual_seed(3)) * 3
    blocks = -(-numel // block_size)
    padded = torch.zeros(blocks * block_size).index_copy_(0, torch.arange(numel), g)
    scales = padded.view(blocks, block_size).norm(dim=1)  # QSGD's norms: |g_j| s / norm in [0, s] up to rounding
    if kind.endswith("levels"):
        levels = 7 if kind == "levels" else 20  # 4-bit and 8-bit levels
        packing = qsgd_module.level_packing(levels)
        multipliers = levels / scales
        codes = ternary.stochastic_levels(g, multipliers, block_size, torch.Generator().manual_seed(5), levels=levels)
        packed = torch.empty(packing.nbytes(numel), dtype=torch.uint8)
        ternary.stochastic_levels(g, multipliers, block_size, torch.Generator().manual_seed(5), packing, packed, levels)
        expected = qsgd_module.pack_levels(codes, levels)
    else:
        cap = torch.tensor(1.0) if kind == "capped" else None
        codes = ternary.stochastic_ternary(g, scales, block_size, torch.Generator().manual_seed(5), cap=cap)
        packed = torch.empty(ternary.packed_nbytes(numel), dtype=torch.uint8)
        ternary.stochastic_ternary(g, scales, block_size, torch.Generator().manual_seed(5), cap=cap, packed=packed)
        expected = ternary.pack_2bit(codes)
    assert codes.abs().sum() > 0 and (codes == 0).any()
    assert torch.equal(packed, expected)


def test_a_received_payload_stays_packed_and_the_chunked_sum_equals_the_whole_one() -> None:
    # three ranks' payloads of 2.3 encoder chunks under one shared scaler, two of them as received off the wire
    numel = int(2.3 * ternary.ENCODE_CHUNK) + 3
    compressor = TernGradCompressor(share_scale=True)
    gens = [torch.Generator().manual_seed(r) for r in range(3)]
    xs = [torch.randn(numel, generator=g) for g in gens]
    shared = max(compressor.local_scale(x) for x in xs)
    payloads = [compressor.compress(x, g, scale=shared) for x, g in zip(xs, gens, strict=True)]
    received = [payloads[0], *(compressor.unpack(p.to_bytes(), xs[0].shape, xs[0].dtype) for p in payloads[1:])]
    assert all(p.stored_codes is None and p.packed is not None for p in received[1:])
    for start, count in [(0, 5), (1, 7), (3, 1), (ternary.ENCODE_CHUNK - 2, 9), (numel - 5, 5)]:
        assert torch.equal(received[1].code_range(start, count), payloads[1].codes[start : start + count])
    out = torch.full((numel,), 0.5)
    compressor.accumulate_all(received, out)
    # the whole-tensor arithmetic: the integer sum of the codes times the shared scaler, rounded once, added
    total = sum(p.codes.to(torch.int32) for p in payloads).to(torch.float32)
    assert torch.equal(out, torch.full((numel,), 0.5).addcmul_(total, payloads[0].scales))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("shape", [(), (1,), (3,), (5, 7), (1001,), (0,)])
def test_wire_round_trip_and_fixed_size(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    x = torch.randn(shape, generator=torch.Generator().manual_seed(3)).to(dtype)
    compressor = TernGradCompressor()
    payload = compressor.compress(x, torch.Generator().manual_seed(0))
    wire = payload.to_bytes()
    numel = x.numel()
    assert wire.dtype == torch.uint8
    assert wire.numel() == payload.nbytes == compressor.payload_nbytes(x.shape, dtype) == 4 * math.ceil(numel / 16) + 4
    shifted = torch.cat([torch.zeros(3, dtype=torch.uint8), wire])[3:]  # misaligned fp32 scaler
    back = compressor.unpack(shifted, x.shape, dtype)
    assert torch.equal(back.codes, payload.codes) and torch.equal(back.scales, payload.scales)
    decoded = compressor.decompress(back)
    assert decoded.dtype == dtype and decoded.shape == (numel,)
    assert torch.equal(decoded, compressor.decompress(payload))
    if numel == 1:  # sigma = 0: no clipping, s = |g|, kept with probability 1: exact
        assert torch.equal(decoded, x.reshape(-1))
    with pytest.raises(ValueError, match="expected"):
        compressor.unpack(wire[:-1], x.shape, dtype)


# --------------------------------------------------------------------------------------------
# TernGrad: unbiasedness, zeros, half precision


@pytest.mark.parametrize(
    ("clip_sigma", "shared_factor"),
    [(2.5, None), (0.0, None), (2.5, 1.5), (0.0, 2.0)],
    ids=["clipped", "unclipped", "clipped-shared-scale", "unclipped-shared-scale"],
)
def test_terngrad_is_unbiased_for_the_clipped_gradient(clip_sigma: float, shared_factor: float | None) -> None:
    x = _gradient(1000, seed=1)
    compressor = TernGradCompressor(clip_sigma=clip_sigma)
    local = compressor.local_scale(x)
    scale = None if shared_factor is None else local * shared_factor  # another rank had a larger scaler
    magnitude = local if scale is None else scale
    gen = torch.Generator().manual_seed(11)
    trials = 3000
    total = torch.zeros(x.numel(), dtype=torch.float64)
    for _ in range(trials):
        payload = compressor.compress(x, gen, scale)
        assert torch.equal(payload.scales, magnitude.reshape(1))
        total += compressor.decompress(payload).double()
    expected = _clipped(x, clip_sigma)
    assert_unbiased(total, expected, magnitude.expand_as(expected), trials)


def test_an_inverted_comparison_would_be_caught() -> None:
    # the check above has teeth: keeping when U >= |g|/s fails it
    x = _gradient(1000, seed=1)
    scale = x.abs().max()
    gen = torch.Generator().manual_seed(11)
    trials = 300
    total = torch.zeros(x.numel(), dtype=torch.float64)
    for _ in range(trials):
        inverted = torch.sign(x) * (torch.rand(x.numel(), generator=gen) >= x.abs() / scale) * scale
        total += inverted.double()
    with pytest.raises(AssertionError):
        assert_unbiased(total, x, scale.expand_as(x), trials)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_all_zero_gradients_give_zero_codes_and_no_nan(dtype: torch.dtype) -> None:
    compressor = TernGradCompressor()
    x = torch.zeros(1000, dtype=dtype)
    assert compressor.local_scale(x) == 0
    for scale in (None, torch.tensor(0.0)):
        payload = compressor.compress(x, torch.Generator().manual_seed(0), scale)
        assert payload.scales.item() == 0 and not payload.codes.any()
        assert torch.equal(compressor.decompress(payload), x)
        out = torch.zeros(1000, dtype=dtype)
        compressor.accumulate(payload, out)
        compressor.accumulate(compressor.unpack(payload.to_bytes(), x.shape, dtype), out)
        assert torch.equal(out, x)
    shared = compressor.compress(x, torch.Generator().manual_seed(0), torch.tensor(0.0))
    averaged = compressor.from_sum(compressor.summable(shared, 4) * 4, shared, 4)
    assert averaged.dtype == dtype and torch.equal(averaged, x)
    # a zero layer among ranks with a non-zero shared scaler: still all-zero codes
    assert not compressor.compress(x, None, torch.tensor(0.5)).codes.any()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_gradients_are_ternarized_in_fp32(dtype: torch.dtype) -> None:
    x = (_gradient(1000, seed=2) * 1e-3).to(dtype)  # small values, as gradients are
    compressor = TernGradCompressor()
    gen = torch.Generator().manual_seed(5)
    trials = 2000
    total = torch.zeros(x.numel(), dtype=torch.float64)
    for _ in range(trials):
        payload = compressor.compress(x, gen)
        assert payload.scales.dtype == torch.float32 and payload.dtype == dtype
        decoded = compressor.decompress(payload)
        assert decoded.dtype == dtype and torch.isfinite(decoded).all()
        # decoding rounds the fp32 scaler to the gradient's dtype once
        total += decoded.double()
    scale = payload.scales[0].to(dtype).double()
    expected = _clipped(x, 2.5).double()
    assert_unbiased(total, expected * scale / payload.scales[0].double(), scale.expand_as(expected), trials)


def test_summable_needs_a_shared_scale_and_widens_beyond_127_ranks() -> None:
    compressor = TernGradCompressor()
    x = _gradient(100)
    own = compressor.compress(x, torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="same scaler"):
        compressor.summable(own, 2)
    shared = compressor.compress(x, torch.Generator().manual_seed(0), compressor.local_scale(x))
    assert compressor.summable(shared, 127).dtype == torch.int8
    assert compressor.summable(shared, 128).dtype == torch.int32  # gloo has no int16 allreduce


def test_preferred_aggregator_moves_fewer_bytes() -> None:
    shared = TernGradCompressor()
    # allgather hands (P - 1) d / 4 bytes, a ring allreduce of int8 codes about 2 d
    assert [shared.preferred_aggregator(p) for p in (2, 4, 8, 9, 16, 200)] == ["allgather"] * 3 + ["allreduce"] * 3
    assert TernGradCompressor(share_scale=False).preferred_aggregator(64) == "allgather"
    assert TernGradCompressor().shares_scale and not TernGradCompressor(share_scale=False).shares_scale


# --------------------------------------------------------------------------------------------
# Real ranks: bytes on the wire, and both aggregation paths bit for bit

LAYERS = [
    ((64, 32, 3, 3), torch.float32),
    ((1000,), torch.float32),
    ((257, 3), torch.float16),
    ((999,), torch.bfloat16),
]


def _local_gradients(rank: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + rank)
    # magnitudes differ per rank and layer, so the shared MAX scaler differs from most local ones
    return [(torch.randn(shape, generator=gen) * (0.5 + rank) * 1e-2).to(dtype) for shape, dtype in LAYERS]


def _two_paths(rank: int, world_size: int) -> dict:
    compressor = TernGradCompressor()
    grads = _local_gradients(rank)
    scale_collectives = Collectives()
    scales = torch.stack([compressor.local_scale(g) for g in grads])
    scale_collectives.all_reduce_(scales, op=dist.ReduceOp.MAX)  # as the hook does, one collective per bucket
    gen = torch.Generator().manual_seed(rank)
    payloads = [compressor.compress(g, gen, s) for g, s in zip(grads, scales.unbind(), strict=True)]
    contributions = [Contribution(compressor, p) for p in payloads]
    gathered_collectives, reduced_collectives = Collectives(), Collectives()
    gathered = AllgatherAggregator().aggregate(contributions, gathered_collectives)
    reduced = AllreduceAggregator().aggregate(contributions, reduced_collectives)
    # every rank's codes, to rebuild the expected average outside the ranks
    codes = [Collectives().all_gather(p.codes) for p in payloads]
    # DIANA's quantizer (own norms per rank) through the same allgather
    quantizer = BlockQuantizer()
    quantized = [quantizer.compress(g, gen) for g in grads]
    quantized_collectives = Collectives()
    quantized_means = AllgatherAggregator().aggregate(
        [Contribution(quantizer, q) for q in quantized], quantized_collectives
    )
    # one integer summand alone in an allreduce: the payload must come out of it untouched
    wire_before = payloads[0].to_bytes().clone()
    (alone,) = AllreduceAggregator().aggregate([contributions[0]], Collectives())
    return {
        "alone": {"codes_kept": torch.equal(payloads[0].to_bytes(), wire_before), "sent": alone.sent},
        "gathered": [a.mean for a in gathered],
        "reduced": [a.mean for a in reduced],
        "sent": [a.sent for a in gathered],
        "local": [compressor.decompress(p) for p in payloads],
        "codes": codes,
        "scales": scales,
        "scale_calls": scale_collectives.counter.calls,
        "quantized_wire": [q.to_bytes() for q in quantized],
        "quantized_means": [a.mean for a in quantized_means],
        "quantized_counts": (quantized_collectives.counter.calls, quantized_collectives.counter.bytes_sent),
        "gathered_counts": (gathered_collectives.counter.calls, gathered_collectives.counter.bytes_sent),
        "reduced_counts": (reduced_collectives.counter.calls, reduced_collectives.counter.bytes_sent),
    }


@pytest.fixture(scope="module", params=[2, 3, 4])
def two_paths(request: pytest.FixtureRequest) -> tuple[int, list[dict]]:
    return request.param, run_ranks(_two_paths, request.param)


def test_the_allreduce_leaves_a_lone_payload_as_it_was(two_paths: tuple[int, list[dict]]) -> None:
    _, results = two_paths
    for r in results:
        assert r["alone"]["codes_kept"]
        assert torch.equal(r["alone"]["sent"], r["local"][0])  # what this rank sent, not the sum


def test_allgather_and_allreduce_give_bit_identical_averages(two_paths: tuple[int, list[dict]]) -> None:
    world_size, results = two_paths
    naive_differs = False
    for i, (shape, dtype) in enumerate(LAYERS):
        numel = math.prod(shape)
        scale = results[0]["scales"][i]
        count = results[0]["codes"][i].sum(dim=0, dtype=torch.int64)
        expected = (count.float() * scale).to(dtype) / world_size  # round(n * s), then / P
        naive = torch.zeros(numel, dtype=dtype)
        for r in results:
            assert torch.equal(r["scales"], results[0]["scales"])
            assert torch.equal(r["gathered"][i], r["reduced"][i]), f"layer {i}: paths differ on {world_size} ranks"
            assert torch.equal(r["gathered"][i], expected)
            assert r["gathered"][i].dtype == dtype and torch.isfinite(r["gathered"][i]).all()
            assert torch.equal(r["sent"][i], r["local"][i])
            naive += r["local"][i]
        naive_differs |= not torch.equal(naive / world_size, expected)
    if world_size == 4:
        # adding +-s rank after rank rounds partial sums: the care taken in accumulate() is needed
        assert naive_differs


def test_compressed_layers_cost_a_sixteenth_of_dense_bytes(two_paths: tuple[int, list[dict]]) -> None:
    _, results = two_paths
    dense = sum(4 * math.prod(shape) for shape, _ in LAYERS)  # what fp32 DDP would allreduce
    payloads = sum(4 * math.ceil(math.prod(shape) / 16) + 4 for shape, _ in LAYERS)
    for r in results:
        assert r["scale_calls"] == 1
        calls, sent = r["gathered_counts"]
        assert calls == 1 and sent == payloads  # fixed sizes: no size exchange, no padding
        assert sent <= dense / 15
        # allreduce of int8 codes: one collective, 1 byte per element
        assert r["reduced_counts"] == (1, sum(math.prod(shape) for shape, _ in LAYERS))
        calls, sent = r["quantized_counts"]
        assert calls == 1 and sent == sum(BlockQuantizer().payload_nbytes(torch.Size(s), d) for s, d in LAYERS)
        assert sent <= dense / 15


def test_quantizer_payloads_average_exactly_over_allgather(two_paths: tuple[int, list[dict]]) -> None:
    world_size, results = two_paths
    quantizer = BlockQuantizer()
    for i, (shape, dtype) in enumerate(LAYERS):
        expected = torch.zeros(math.prod(shape), dtype=dtype)
        for r in results:  # parse every rank's bytes and add them in rank order, as the aggregator does
            quantizer.accumulate(quantizer.unpack(r["quantized_wire"][i], torch.Size(shape), dtype), expected)
        expected /= world_size
        for r in results:
            assert torch.equal(r["quantized_means"][i], expected)


# --------------------------------------------------------------------------------------------
# The hook under torch's DDP

HOOK_STEPS = 4


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))


def _train(rank: int, world_size: int, share_scale: bool, aggregator: str) -> dict:
    model = _mlp()
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.001)
    hook = GradCompHook(
        TernGradCompressor(share_scale=share_scale),
        NoMemory(),
        aggregator,
        list(model.named_parameters()),
        warmup_steps=0,
        min_compress_numel=100,
    )
    ddp.register_comm_hook(hook, gradcomp_comm_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    gen = torch.Generator().manual_seed(100 + rank)  # each rank its own batches
    for _ in range(HOOK_STEPS):
        x = torch.randn(16, 32, generator=gen)
        y = torch.randint(0, 4, (16,), generator=gen)
        optimizer.zero_grad()
        nn.functional.cross_entropy(ddp(x), y).backward()
        optimizer.step()
    return {"weights": model.state_dict(), "history": list(hook.history)}


def _hook_runs(rank: int, world_size: int) -> dict:
    return {
        "allreduce": _train(rank, world_size, True, "allreduce"),
        "allgather": _train(rank, world_size, True, "allgather"),
        "own-scalers": _train(rank, world_size, False, "allgather"),
    }


def test_hook_with_shared_scale_keeps_ranks_in_sync_on_both_paths() -> None:
    results = run_ranks(_hook_runs, 2)
    for run in ("allreduce", "allgather", "own-scalers"):
        for name, value in results[0][run]["weights"].items():
            assert torch.equal(results[1][run]["weights"][name], value), f"{run}: ranks diverged on {name}"
    for rank_results in results:
        # the same codes (same seeds) average to the same bits on both paths: identical models
        for name, value in rank_results["allreduce"]["weights"].items():
            assert torch.equal(rank_results["allgather"]["weights"][name], value)
        for shared, own in zip(
            rank_results["allgather"]["history"], rank_results["own-scalers"]["history"], strict=True
        ):
            assert shared.compressed and shared.numel_compressed == 2048 + 256
            # scaler sharing: one extra MAX allreduce per bucket, 4 bytes per compressed layer
            assert shared.collectives == own.collectives + shared.buckets
            assert shared.bytes_sent == own.bytes_sent + 4 * 2
        for step in rank_results["allreduce"]["history"]:
            assert step.bytes_sent < step.dense_bytes / 3  # int8 codes instead of fp32


# --------------------------------------------------------------------------------------------
# Lightning on MNIST

MNIST_STEPS = 250


def test_terngrad_fit_on_mnist_trains_close_to_dense(
    record_property: Callable[[str, object], None], mnist_fit: Callable[..., dict]
) -> None:
    """LeNet-5 on the MNIST test set, 250 steps: TernGrad within 3 points of dense at one seed.

    Single-seed accuracy at this length varies by about +-1.5 points with the random draws alone:
    measured over hook seeds 0-3, TernGrad reached 94.75, 95.40, 93.95 and 97.00 against dense
    96.75 (mean gap -1.4); the draws of the earlier shared generator gave 96.15, 95.10, 93.85 and
    95.60. The 3-point margin covers that spread; accuracy parity is a benchmark's question
    (paired seeds, ``benchmarks/convergence.py``), not a single fit's.
    """
    dense = mnist_fit({"compressor": "none", "memory": "none"}, steps=MNIST_STEPS, seed=0)
    tern = mnist_fit(
        {"compressor": TernGradCompressor(), "memory": "none", "aggregator": "allgather"}, steps=MNIST_STEPS, seed=0
    )
    ratio = tern["dense_bytes"] / tern["bytes_sent"]
    print(
        f"MNIST LeNet-5, 2 ranks, {MNIST_STEPS} steps, seed 0: dense val_acc {dense['val_acc']:.4f}, "
        f"terngrad val_acc {tern['val_acc']:.4f}, terngrad bytes per step {tern['bytes_sent']:.0f} "
        f"vs dense {tern['dense_bytes']:.0f} ({ratio:.1f}x)"
    )
    record_property("dense_val_acc", dense["val_acc"])
    record_property("terngrad_val_acc", tern["val_acc"])
    record_property("terngrad_compression_ratio", ratio)
    assert dense["val_acc"] > 0.9, "the dense baseline did not learn: the comparison would be meaningless"
    assert tern["val_acc"] >= dense["val_acc"] - 0.03
    assert ratio > 10  # the small layers (conv1, fc3, biases) stay dense


def test_a_local_scale_handed_over_gives_the_same_codes_as_computing_it() -> None:
    compressor = TernGradCompressor()
    x = torch.randn(3000, generator=torch.Generator().manual_seed(5)) * 0.1
    local = compressor.local_scale(x)
    shared = local * 1.5  # another rank's scaler was larger
    own = compressor.compress(x, torch.Generator().manual_seed(1), shared)
    handed = compressor.compress(x, torch.Generator().manual_seed(1), shared, local_scale=local)
    assert torch.equal(own.codes, handed.codes) and torch.equal(own.scales, handed.scales)
    assert int(own.codes.abs().sum()) > 0


def test_terngrad_reports_itself_unbiased_only_without_clipping() -> None:
    assert TernGradCompressor(clip_sigma=0).unbiased
    assert not TernGradCompressor().unbiased and not TernGradCompressor(clip_sigma=2.5).unbiased
    # what clipping does to an outlier: the scaler, and with it the largest value E[t] can take, is the
    # 2.5-sigma bound (0.95 here), not the outlier's 12
    x = torch.zeros(1000)
    x[0] = 12.0
    sigma = float(torch.std(x, correction=0))
    assert float(TernGradCompressor().local_scale(x)) == pytest.approx(2.5 * sigma) and 2.5 * sigma < 1.0
    assert float(TernGradCompressor(clip_sigma=0).local_scale(x)) == 12.0
    assert "clip_sigma=0" in TernGradCompressor().bias_reason and TernGradCompressor(clip_sigma=0).bias_reason is None
