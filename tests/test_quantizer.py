"""DIANA's block p-norm quantizer: the variance bound omega (tight, and respected by measurement),
unbiasedness checked statistically, its wire format, zeros and half precision."""

from __future__ import annotations

import math

import pytest
import torch
from test_terngrad import Z_LIMIT, assert_unbiased, reference_keep

from lightning_gradcomp.core.compressors import ternary
from lightning_gradcomp.core.compressors.quantizer import DEFAULT_BLOCK_SIZE, BlockQuantizer
from lightning_gradcomp.core.compressors.ternary import num_blocks


def _blocks(x: torch.Tensor, block_size: int | None) -> list[torch.Tensor]:
    flat = x.reshape(-1).double()
    return list(flat.split(block_size or max(1, flat.numel())))


def _norms(x: torch.Tensor, p: float, block_size: int | None) -> torch.Tensor:
    """Each element's block norm, written out block by block."""
    return torch.cat([torch.linalg.vector_norm(b, p).expand(b.numel()) for b in _blocks(x, block_size)])


def exact_variance(x: torch.Tensor, p: float, block_size: int | None) -> float:
    """``E||Q(x) - x||^2 = sum_l (||x_l||_p ||x_l||_1 - ||x_l||_2^2)`` (each element: ``N |x_j| - x_j^2``)."""
    return sum(float(torch.linalg.vector_norm(b, p) * b.abs().sum() - b.pow(2).sum()) for b in _blocks(x, block_size))


def extremal(numel: int, p: float, block_size: int | None, seed: int = 0) -> torch.Tensor:
    """A tensor on which the bound is attained in every full block (derivation in quantizer.py)."""
    gen = torch.Generator().manual_seed(seed)
    signs = torch.randint(0, 2, (numel,), generator=gen).double() * 2 - 1
    if p == 2:
        return signs  # equal magnitudes: ||x||_1 = sqrt(d) ||x||_2
    block = block_size or numel
    magnitudes = torch.full((numel,), 1.0 / (math.sqrt(block) + 1), dtype=torch.float64)
    magnitudes[::block] = 1.0  # one element at the inf-norm, the others at 1 / (sqrt(d) + 1)
    return signs * magnitudes


@pytest.mark.parametrize("bad", [1, 3, 0.5, "two", True, None, math.nan])
def test_bad_p_is_rejected(bad: object) -> None:
    with pytest.raises(ValueError, match=r"p must be 2 or inf .*got"):
        BlockQuantizer(p=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [0, -4, 1.5, True, "8"])
def test_bad_block_size_is_rejected(bad: object) -> None:
    with pytest.raises(
        ValueError, match=r"^block_size must be an integer >= 1 \(or None: one block per tensor\), got "
    ):
        BlockQuantizer(block_size=bad)  # type: ignore[arg-type]


def test_p_accepts_the_documented_spellings() -> None:
    assert BlockQuantizer(p=2).p == BlockQuantizer(p=2.0).p == 2.0
    assert BlockQuantizer(p=math.inf).p == BlockQuantizer(p="inf").p == BlockQuantizer().p == math.inf
    assert BlockQuantizer().block_size == DEFAULT_BLOCK_SIZE == 1024
    assert not BlockQuantizer().shares_scale and BlockQuantizer().unbiased
    assert BlockQuantizer().preferred_aggregator(64) == "allgather"


def test_omega_values() -> None:
    assert BlockQuantizer(p=2).omega(10**6) == 31.0  # sqrt(1024) - 1
    assert BlockQuantizer(p="inf").omega(10**6) == 15.5  # (sqrt(1024) - 1) / 2
    assert BlockQuantizer(p=2).omega(100) == 9.0  # a tensor smaller than a block: d = numel
    assert BlockQuantizer(p=2, block_size=None).omega(10_000) == 99.0
    assert BlockQuantizer(p="inf", block_size=None).omega(10_000) == 49.5
    assert BlockQuantizer(block_size=1).omega(50) == BlockQuantizer().omega(1) == BlockQuantizer().omega(0) == 0.0


@pytest.mark.parametrize("p", [2.0, math.inf])
@pytest.mark.parametrize(("numel", "block_size"), [(1024, 64), (1000, 64), (400, None), (3000, 1024)])
def test_omega_bounds_the_exact_variance_and_is_attained(p: float, numel: int, block_size: int | None) -> None:
    quantizer = BlockQuantizer(p=p, block_size=block_size)
    omega = quantizer.omega(numel)
    gen = torch.Generator().manual_seed(numel)
    for x in (torch.randn(numel, generator=gen), torch.randn(numel, generator=gen) ** 5, torch.ones(numel)):
        assert exact_variance(x, p, block_size) <= omega * float(x.double().pow(2).sum()) * (1 + 1e-9)
    x = extremal(numel, p, block_size)
    if numel % (block_size or numel) == 0:  # every block full: the bound holds with equality
        assert exact_variance(x, p, block_size) == pytest.approx(omega * float(x.pow(2).sum()), rel=1e-9)


@pytest.mark.parametrize("p", [2.0, math.inf])
@pytest.mark.parametrize("block_size", [64, None])
def test_quantizer_is_unbiased_and_its_measured_variance_respects_omega(p: float, block_size: int | None) -> None:
    numel, trials = 1000, 3000  # 1000 = 15 blocks of 64 + a tail of 40
    quantizer = BlockQuantizer(p=p, block_size=block_size)
    gen = torch.Generator().manual_seed(3)
    omega = quantizer.omega(numel)
    for x in (torch.randn(numel, generator=gen) ** 3, extremal(numel, p, block_size)):
        x = x.float()
        total = torch.zeros(numel, dtype=torch.float64)
        errors = torch.empty(trials, dtype=torch.float64)
        for t in range(trials):
            q = quantizer.decompress(quantizer.compress(x, gen)).double()
            total += q
            errors[t] = (q - x.double()).pow(2).sum()
        assert_unbiased(total, x, _norms(x, p, block_size), trials)
        variance = exact_variance(x, p, block_size)
        measured, spread = float(errors.mean()), float(errors.std()) / math.sqrt(trials)
        assert abs(measured - variance) <= Z_LIMIT * spread, f"measured {measured}, exact {variance}"
        assert measured <= omega * float(x.double().pow(2).sum()) + Z_LIMIT * spread


def test_codes_follow_the_reference_draw_with_the_same_generator() -> None:
    x = torch.randn(1000, generator=torch.Generator().manual_seed(1)).reshape(10, 100)
    for p in (2.0, math.inf):
        quantizer = BlockQuantizer(p=p, block_size=64)
        payload = quantizer.compress(x, torch.Generator().manual_seed(9))
        torch.testing.assert_close(payload.scales, _norms(x, p, 64)[::64].float(), rtol=1e-6, atol=0)
        norms = payload.scales.repeat_interleave(64)[:1000]
        flat = x.reshape(-1)
        keep = reference_keep(flat.abs() * (256 / norms), torch.Generator().manual_seed(9))
        reference = torch.sign(flat) * keep  # keep when U < |x| / ||x_l||_p
        assert torch.equal(payload.codes, reference.to(torch.int8))
        assert torch.equal(quantizer.decompress(payload), reference * norms)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize(("shape", "block_size"), [((), 1024), ((3,), 2), ((5, 7), 8), ((1001,), 1024), ((0,), 4)])
def test_wire_round_trip_and_size(dtype: torch.dtype, shape: tuple[int, ...], block_size: int) -> None:
    x = torch.randn(shape, generator=torch.Generator().manual_seed(2)).to(dtype)
    quantizer = BlockQuantizer(block_size=block_size)
    payload = quantizer.compress(x, torch.Generator().manual_seed(0))
    wire = payload.to_bytes()
    numel = x.numel()
    expected = 4 * num_blocks(numel, block_size) + 4 * math.ceil(numel / 16)
    assert wire.numel() == payload.nbytes == quantizer.payload_nbytes(x.shape, dtype) == expected
    shifted = torch.cat([torch.zeros(1, dtype=torch.uint8), wire])[1:]
    back = quantizer.unpack(shifted, x.shape, dtype)
    assert torch.equal(back.codes, payload.codes) and torch.equal(back.scales, payload.scales)
    decoded = quantizer.decompress(back)
    assert decoded.dtype == dtype and torch.isfinite(decoded).all()
    assert torch.equal(decoded, quantizer.decompress(payload))
    # accumulate adds in fp32 (fp64 for fp64) and rounds once to the gradient's dtype
    working = torch.float64 if dtype == torch.float64 else torch.float32
    expected_sum = (torch.ones(numel, dtype=working) + back.dense(working)).to(dtype)
    assert torch.equal(quantizer.accumulate(back, torch.ones(numel, dtype=dtype)), expected_sum)


def test_default_block_size_costs_just_over_two_bits_per_element() -> None:
    numel = 1 << 20
    bits = 8 * BlockQuantizer().payload_nbytes(torch.Size([numel]), torch.float32) / numel
    assert bits == 2 + 32 / 1024


def test_zero_blocks_give_zero_codes_and_no_nan() -> None:
    x = torch.randn(300, generator=torch.Generator().manual_seed(0))
    x[64:128] = 0  # one all-zero block between non-zero ones
    for p in (2.0, math.inf):
        quantizer = BlockQuantizer(p=p, block_size=64)
        payload = quantizer.compress(x, torch.Generator().manual_seed(0))
        assert payload.scales[1] == 0 and not payload.codes[64:128].any()
        assert torch.isfinite(quantizer.decompress(payload)).all()
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            zeros = torch.zeros(300, dtype=dtype)
            decoded = quantizer.decompress(quantizer.compress(zeros, torch.Generator().manual_seed(0)))
            assert torch.equal(decoded, zeros)


@pytest.mark.parametrize("chunk", [128, 100, 37])
def test_codes_do_not_depend_on_the_encoding_chunk(chunk: int, monkeypatch: pytest.MonkeyPatch) -> None:
    # the encoder works through chunks of whole blocks; the codes must be those of one pass
    x = torch.randn(2000, generator=torch.Generator().manual_seed(6))
    encoders = [BlockQuantizer(block_size=64), BlockQuantizer(p=2, block_size=100), BlockQuantizer(block_size=None)]
    whole = [q.compress(x, torch.Generator().manual_seed(3)).codes for q in encoders]
    monkeypatch.setattr(ternary, "ENCODE_CHUNK", chunk)
    for quantizer, expected in zip(encoders, whole, strict=True):
        assert torch.equal(quantizer.compress(x, torch.Generator().manual_seed(3)).codes, expected)


def test_block_norms_equal_the_written_out_norms_with_a_short_last_block_and_a_nan() -> None:
    x = torch.randn(1000, generator=torch.Generator().manual_seed(4))
    x[130] = math.nan
    for p in (2.0, math.inf):
        got = BlockQuantizer(p=p, block_size=64).norms(x)
        expected = _norms(x.float(), p, 64)[::64].float()  # in float64, then rounded
        assert got.isnan()[2] and not got[torch.arange(16) != 2].isnan().any()
        mask = ~expected.isnan()
        if p == math.inf:  # max |x| is exact in any precision
            assert torch.equal(got[mask], expected[mask])
        else:
            torch.testing.assert_close(got[mask], expected[mask], rtol=1e-6, atol=0)


@pytest.mark.parametrize("chunk", [1 << 18, 15, 5])  # one pass; two blocks at a time; chunks inside a block
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16])
@pytest.mark.parametrize(("start", "numel"), [(0, 50), (3, 40), (7, 14), (9, 2), (0, 0), (45, 5)])
def test_a_slice_of_codes_adds_as_its_decoded_values(
    dtype: torch.dtype, start: int, numel: int, chunk: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # what DIANA's h_i takes from this rank's own payload: no dense decoded copy, same numbers
    x = torch.randn(50, generator=torch.Generator().manual_seed(5)).to(dtype)
    payload = BlockQuantizer(block_size=7).compress(x, torch.Generator().manual_seed(1))
    monkeypatch.setattr(ternary, "ENCODE_CHUNK", chunk)
    whole = payload.entries()
    part = whole.split([start, numel, 50 - start - numel])[1]
    decoded = BlockQuantizer(block_size=7).decompress(payload)[start : start + numel]
    assert torch.equal(part.to_dense(), decoded) and part.all_finite()
    for alpha in (1.0, -1.0, 0.3):
        base = torch.randn(numel, generator=torch.Generator().manual_seed(2)).to(dtype)
        expected = base.clone().add_(decoded, alpha=alpha)
        torch.testing.assert_close(part.add_to_(base.clone(), alpha=alpha), expected, rtol=0, atol=0)
    with pytest.raises(ValueError, match="do not add up"):
        whole.split([10, 10])


def test_a_slice_is_finite_exactly_when_the_scales_of_its_blocks_are() -> None:
    x = torch.randn(30, generator=torch.Generator().manual_seed(0))
    payload = BlockQuantizer(block_size=10).compress(x, torch.Generator().manual_seed(0))
    payload.scales[1] = math.inf  # elements 10..19 decode to +-inf or NaN (0 * inf)
    first, middle, last = payload.entries().split([10, 10, 10])
    assert first.all_finite() and last.all_finite() and not middle.all_finite()
    assert not payload.entries().split([9, 2, 19])[1].all_finite()  # touches block 1 by one element
    assert not torch.isfinite(middle.to_dense()).all()
