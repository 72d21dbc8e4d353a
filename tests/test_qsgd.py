"""QSGD with s levels: levels are the floor or ceiling of s|x|/N, unbiased, variance measured against Lemma 3.1,
exact wire size, arguments; DIANA with it on real ranks."""

from __future__ import annotations

import math

import pytest
import torch
from ranks import run_ranks
from test_hook import _make_hook, _train
from test_terngrad import Z_LIMIT, assert_unbiased

from lightning_gradcomp import GradCompStrategy
from lightning_gradcomp.core.compressors import LevelsPayload, QSGDCompressor, ternary
from lightning_gradcomp.core.compressors import qsgd as qsgd_module
from lightning_gradcomp.core.memory import Diana


def _analytic_variance(x: torch.Tensor, levels: int) -> float:
    """E||Q(x) - x||^2 for one block: (N / s)^2 sum_j frac(u_j) (1 - frac(u_j)), u = s |x| / N."""
    norm = float(x.norm())
    u = levels * x.abs() / norm
    frac = u - u.floor()
    return (norm / levels) ** 2 * float((frac * (1 - frac)).sum())


@pytest.mark.parametrize("levels", [1, 3, 7])
def test_unbiased_with_the_variance_of_lemma_3_1(levels: int) -> None:
    d, trials = 100, 20_000
    x = torch.randn(d, generator=torch.Generator().manual_seed(levels), dtype=torch.float64)
    compressor = QSGDCompressor(levels, block_size=None)
    # one block of the whole tensor is a block of d: the same codes from the same draws, so the trials are drawn
    # at once, as `trials` blocks of d holding x each (every block its own norm, its own draws)
    same = [QSGDCompressor(levels, size).compress(x, torch.Generator().manual_seed(5)).codes for size in (None, d)]
    assert torch.equal(*same)
    blocks = QSGDCompressor(levels, block_size=d)
    payload = blocks.compress(x.repeat(trials), torch.Generator().manual_seed(100 + levels))
    decoded = blocks.decompress(payload).view(trials, d)
    step = float(x.norm()) / levels
    lower = (x.abs() * (levels / x.norm())).floor()  # l_j, as the compressor computes u_j
    floor = lower * x.sign() * step
    above = payload.codes.view(trials, d).abs().to(torch.float64) - lower
    assert torch.all((above == 0) | (above == 1))
    total = (decoded - floor).sum(0)  # what is left above the floor level: N/s * sign * Bernoulli(frac)
    errors = (decoded - x).pow(2).sum(1)
    assert_unbiased(total, x - floor, torch.full_like(x, step), trials)
    expected = _analytic_variance(x, levels)
    tolerance = Z_LIMIT * float(errors.std()) / math.sqrt(trials)
    assert abs(float(errors.mean()) - expected) <= tolerance, (float(errors.mean()), expected, tolerance)
    assert expected <= compressor.omega(d) * float(x.pow(2).sum())


def test_one_level_bound_is_exact_and_more_levels_shrink_it() -> None:
    x = torch.ones(256, dtype=torch.float64)  # equal magnitudes attain sqrt(d) - 1 at s = 1
    assert _analytic_variance(x, 1) / 256 == pytest.approx(QSGDCompressor(1, None).omega(256)) == 15.0
    assert QSGDCompressor(4, None).omega(256) == min(256 / 16, 16 / 4) == 4.0
    assert QSGDCompressor(16, None).omega(256) == min(256 / 256, 16 / 16) == 1.0
    assert QSGDCompressor(7, 512).omega(10**6) == QSGDCompressor(7, 512).omega(512)  # blocks bound it


@pytest.mark.parametrize(("levels", "numel", "code_bytes"), [(7, 1301, 652), (1, 8, 4), (8, 1301, 1304), (127, 5, 8)])
def test_wire_is_a_norm_per_block_and_fixed_width_levels(levels: int, numel: int, code_bytes: int) -> None:
    x = torch.randn(numel, generator=torch.Generator().manual_seed(numel))
    compressor = QSGDCompressor(levels, block_size=512)
    payload = compressor.compress(x, torch.Generator().manual_seed(1))
    assert isinstance(payload, LevelsPayload) and int(payload.codes.abs().max()) <= levels
    size = 4 * math.ceil(numel / 512) + code_bytes
    wire = payload.to_bytes()
    assert wire.numel() == payload.nbytes == compressor.payload_nbytes(x.shape, x.dtype) == size
    back = compressor.unpack(wire, x.shape, x.dtype)
    assert torch.equal(back.codes, payload.codes) and torch.equal(back.norms, payload.norms)
    with pytest.raises(ValueError, match="unexpected trailing bytes"):
        compressor.unpack(torch.cat([wire, wire[:1]]), x.shape, x.dtype)


@pytest.mark.parametrize("levels", [7, 100])
def test_a_received_payload_stays_packed_and_adds_any_range_as_its_levels(levels: int) -> None:
    x = torch.randn(3001, generator=torch.Generator().manual_seed(5))
    compressor = QSGDCompressor(levels, block_size=64)
    payload = compressor.compress(x, torch.Generator().manual_seed(6))
    back = compressor.unpack(payload.to_bytes(), x.shape, x.dtype)
    assert back.stored_codes is None and back.packed is not None  # another rank's payload: 4 or 8 bits each
    assert torch.equal(back.to_bytes(), payload.to_bytes())
    dense = payload.dense()
    for start, count in [(0, 3001), (1, 1), (7, 130), (64, 64), (1000, 2001), (3000, 1)]:
        assert torch.equal(back.code_range(start, count), payload.codes[start : start + count]), (start, count)
        out = torch.ones(count)
        assert torch.equal(back.add_to_(out, first=start), 1 + dense[start : start + count]), (start, count)
    assert torch.equal(back.codes, payload.codes)


def test_a_zero_block_sends_zeros() -> None:
    compressor = QSGDCompressor(7, block_size=4)
    x = torch.tensor([0.0, 0.0, 0.0, 0.0, 1.0, -2.0, 0.5, 0.0])
    decoded = compressor.decompress(compressor.compress(x, torch.Generator().manual_seed(0)))
    assert torch.equal(decoded[:4], torch.zeros(4)) and torch.isfinite(decoded).all()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"levels": 0}, "levels must be an integer from 1 to 127"),
        ({"levels": 128}, "levels must be an integer from 1 to 127"),
        ({"levels": 2.0}, "levels must be an integer from 1 to 127"),
        ({"block_size": 0}, r"block_size must be an integer >= 1 \(or None: one block per tensor\), got 0"),
    ],
)
def test_bad_arguments_are_refused_by_name(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        GradCompStrategy(compressor="qsgd", memory="none", compressor_kwargs=kwargs)


def test_diana_takes_its_shift_step_from_the_bound() -> None:
    strategy = GradCompStrategy(compressor="qsgd", memory="diana", compressor_kwargs={"levels": 4, "block_size": 256})
    assert isinstance(strategy.memory, Diana)
    assert strategy.memory.alpha_for(10_000) == pytest.approx(1 / (4.0 + 1))
    assert strategy.resolved_aggregator(4) == "allgather"


def _diana(rank: int, world_size: int) -> dict:
    compressor = QSGDCompressor(7, block_size=256)
    model, hook = _train(rank, world_size, _make_hook(compressor, Diana(variance_bound=compressor.omega), "layer"))
    return {"weights": model.state_dict(), "payload_bytes": [s.payload_bytes for s in hook.history]}


@pytest.mark.parametrize("world_size", [2, 3])
def test_on_real_ranks_diana_with_qsgd_keeps_ranks_identical(world_size: int) -> None:
    results = run_ranks(_diana, world_size)
    # 0.weight (2048: 8 norms + 1024 code bytes) and 2.weight (256: 1 norm + 128)
    assert results[0]["payload_bytes"] == [(4 * 8 + 1024) + (4 + 128)] * len(results[0]["payload_bytes"])
    for r in results[1:]:
        for name, value in r["weights"].items():
            assert torch.equal(value, results[0]["weights"][name]), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("block_size", [512, 1000, None])
def test_levels_added_chunk_by_chunk_equal_the_dense_decode_bit_for_bit(dtype: torch.dtype, block_size) -> None:
    numel = qsgd_module.STREAM_CHUNK + 3001  # pieces that end off the block edges when 1000 does not divide them
    x = (torch.randn(numel, generator=torch.Generator().manual_seed(4)) * 3).to(dtype)
    payload = QSGDCompressor(block_size=block_size).compress(x, torch.Generator().manual_seed(5))
    dense = payload.dense()
    base = torch.randn(numel, generator=torch.Generator().manual_seed(6)).to(dtype)
    assert torch.equal(payload.add_to_(base.clone()), base.clone().add_(dense.to(dtype)))
    scaled = payload.add_to_(base.clone(), alpha=0.3)
    expected = base.clone().add_(dense.to(dtype), alpha=0.3)
    if dtype == torch.bfloat16:
        # torch's own bfloat16 add with alpha rounds alpha * x in its vectorised body but not in its scalar tail
        # (where a thread's share ends decides which): the two orders differ by at most one rounding of each term
        bound = 2**-8 * (expected.float().abs() + (0.3 * dense.to(dtype).float()).abs())
        assert bool(((scaled.float() - expected.float()).abs() <= bound).all())
    else:
        assert torch.equal(scaled, expected)
    entries = payload.entries()
    assert entries.all_finite() and torch.equal(entries.to_dense(), dense.to(dtype))
    sizes = [7, 1000, qsgd_module.STREAM_CHUNK - 500, numel - 507 - qsgd_module.STREAM_CHUNK]
    for piece, start, n in zip(
        entries.split(sizes), [0, 7, 1007, 1007 + qsgd_module.STREAM_CHUNK - 500], sizes, strict=True
    ):
        part = base[start : start + n].clone()
        assert torch.equal(
            piece.add_to_(part, alpha=-0.5),
            base[start : start + n].clone().add_(dense[start : start + n].to(dtype), alpha=-0.5),
        )


def test_a_slice_is_finite_when_the_norms_of_its_own_blocks_are() -> None:
    x = torch.randn(2048, generator=torch.Generator().manual_seed(0))
    payload = QSGDCompressor(block_size=512).compress(x, torch.Generator().manual_seed(1))
    payload.norms[3] = float("inf")
    first, last = payload.entries().split([1536, 512])
    assert first.all_finite() and not last.all_finite() and not payload.entries().all_finite()


@pytest.mark.parametrize("numel", [1, 2, 1001, 4096, 4097, 2**20 + 3])
def test_levels_unpack_from_any_range_of_their_planar_rows(numel: int) -> None:
    # 4-bit levels in planar rows of 4096: ranges from inside a row, across rows and into the last, partial row
    codes = torch.randint(-7, 8, (numel,), dtype=torch.int8, generator=torch.Generator().manual_seed(numel))
    packed = qsgd_module.pack_levels(codes, 7)
    assert packed.numel() == 4 * -(-numel // 8)
    assert torch.equal(qsgd_module.unpack_levels(packed, numel, 7), codes)
    for start, count in [(0, numel), (numel // 3, numel - numel // 3), (1, numel - 1), (numel - 1, 1)]:
        got = qsgd_module.unpack_level_range(packed, numel, start, count, 7)
        assert torch.equal(got, codes[start : start + count]), (start, count)
    if numel >= 4096:  # level 512 k + v of a row in field k of word v: byte j's low nibble field 2j, its high 2j + 1
        planes = (codes[:4096].to(torch.int32) + 7).view(4, 2, 512)
        assert torch.equal(packed[:2048].view(512, 4).T.to(torch.int32), planes[:, 0] | planes[:, 1] << 4)


@pytest.mark.parametrize("levels", [7, 20])
def test_a_level_never_passes_s_where_one_element_holds_its_block_norm(levels: int) -> None:
    # u = |g| (s / N) can round above s where one element holds its block's norm (blocks of one element: about one
    # value in five in float32); a level past s would borrow from its neighbour's 4-bit field. The draw clamps u to
    # s: multipliers well above s / |g| (u = 1.5 s) must still give exactly +-s, packed or not.
    g = torch.randn(4096, generator=torch.Generator().manual_seed(6))
    multipliers = 1.5 * levels / g.abs()
    packing = qsgd_module.level_packing(levels)
    packed = torch.empty(packing.nbytes(g.numel()), dtype=torch.uint8)
    draw = [torch.Generator().manual_seed(7) for _ in range(2)]
    codes = ternary.stochastic_levels(g, multipliers, 1, draw[0], levels=levels)
    ternary.stochastic_levels(g, multipliers, 1, draw[1], packing, packed, levels=levels)
    assert torch.equal(codes, torch.sign(g).to(torch.int8) * levels)
    assert torch.equal(packed, qsgd_module.pack_levels(codes, levels))
    codec = QSGDCompressor(levels=levels, block_size=1)  # the compressor passes its s
    payload = codec.compress(g, torch.Generator().manual_seed(7))
    assert torch.equal(payload.codes, torch.sign(g).to(torch.int8) * levels)
