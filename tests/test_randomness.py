"""The counter-based streams: the hash is the published finaliser, its bits pass frequency and independence tests
(tolerances from the binomial and chi-square variances at ``test_terngrad.FALSE_ALARM``), and a draw depends only on
its key and counter, whatever piece it is drawn in."""

from __future__ import annotations

import math

import pytest
import torch
from test_terngrad import Z_LIMIT

from lightning_gradcomp.core.compressors.draws import random_integers, random_subset, stratified_positions
from lightning_gradcomp.core.randomness import (
    CounterStream,
    UnitStreams,
    counter_bits,
    counter_uniform,
    stream_seed,
    unsigned_of,
)

MASK32 = (1 << 32) - 1
N = 1 << 20
KEYS = [stream_seed(0, rank, step, 17) for rank in (0, 1) for step in (0, 1)]


def lowbias32(x: int) -> int:
    """Wellons' finaliser in Python integers, the reference for the int32 tensor form."""
    x ^= x >> 16
    x = (x * 0x7FEB352D) & MASK32
    x ^= x >> 15
    x = (x * 0x846CA68B) & MASK32
    return x ^ (x >> 16)


def reference_bits(key: int, counter: int) -> int:
    return lowbias32(lowbias32((counter & MASK32) ^ (key & MASK32)) ^ (key >> 32))


@pytest.mark.parametrize("start", [0, 12_345, 2**31 - 3, 2**32 - 3])
def test_bits_are_the_reference_hash_counters_wrapping(start: int) -> None:
    key = stream_seed(3, 1, 4, 99)
    got = unsigned_of(counter_bits(key, start, 7)).tolist()
    assert got == [reference_bits(key, start + i) for i in range(7)]


def test_a_draw_depends_on_its_counter_alone() -> None:
    stream = CounterStream(KEYS[0])
    key = stream.key  # the integer mixed: the hash's key
    whole = counter_bits(key, 0, 1000)
    assert torch.equal(counter_bits(key, 300, 200), whole[300:500])
    assert torch.equal(torch.cat([stream.bits(10), stream.bits(20)]), whole[:30])  # successive draws never overlap
    assert torch.equal(stream.uniform(5), counter_uniform(key, 30, 5))
    wide = CounterStream(KEYS[0]).bits53(3).tolist()  # two draws each: the first's 32 bits over the second's top 21
    assert wide == [(reference_bits(key, 2 * i) << 21) | (reference_bits(key, 2 * i + 1) >> 11) for i in range(3)]
    unit = UnitStreams(0, 1).generator(torch.device("cpu"), 0, 17)
    assert torch.equal(unit.bits(64), CounterStream(KEYS[2]).bits(64))


def test_streams_of_nearby_integers_share_no_stretch_of_bits() -> None:
    """Keys ``0 .. 63`` (a test's seeds, a benchmark's steps) name independent streams: no 8-draw stretch of one
    appears anywhere in the first 4096 draws of another (unmixed, key ``s`` would repeat key ``0``'s draws in another
    order: counter ``c`` of one is counter ``c ^ s`` of the other)."""
    draws = [unsigned_of(CounterStream(key).bits(4096)) for key in range(64)]
    seen: dict[tuple[int, ...], int] = {}
    for key, bits in enumerate(draws):
        for start in range(0, 4096, 8):
            stretch = tuple(bits[start : start + 8].tolist())
            assert seen.setdefault(stretch, key) == key, (key, seen[stretch])
    assert len(torch.cat(draws).unique()) > 0.999 * 64 * 4096  # 2^18 draws of 32 bits: ~8 equal pairs expected


@pytest.mark.parametrize("key", KEYS)
def test_every_bit_is_a_fair_coin(key: int) -> None:
    bits = unsigned_of(counter_bits(key, 0, N))
    ones = torch.stack([((bits >> b) & 1).sum() for b in range(32)]).double()
    z = (ones - N / 2) / math.sqrt(N / 4)
    assert z.abs().max() <= Z_LIMIT, z


@pytest.mark.parametrize("shift", [0, 8, 16, 24])
def test_each_byte_is_uniform(shift: int) -> None:
    bits = unsigned_of(counter_bits(KEYS[1], 0, N))
    counts = torch.bincount(((bits >> shift) & 0xFF), minlength=256).double()
    chi2 = float(((counts - N / 256) ** 2 / (N / 256)).sum())
    assert abs(chi2 - 255) <= Z_LIMIT * math.sqrt(2 * 255), chi2


def correlation(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double() - a.double().mean(), b.double() - b.double().mean()
    return float((a * b).sum() / (a.norm() * b.norm()))


def test_neighbouring_counters_and_streams_are_uncorrelated() -> None:
    """Pearson's r of independent uniforms has standard deviation ``1 / sqrt(n)``: neighbouring counters of one
    stream, and the same counters of streams one rank, one step or one high key bit apart."""
    u = counter_uniform(KEYS[0], 0, N + 1)
    pairs = [(u[:-1], u[1:])]
    pairs += [(u[:N], counter_uniform(other, 0, N)) for other in KEYS[1:]]
    pairs.append((u[:N], counter_uniform(KEYS[0] ^ (1 << 40), 0, N)))  # keys differing in the high half alone
    for a, b in pairs:
        assert abs(correlation(a, b)) <= Z_LIMIT / math.sqrt(N)


def test_pairs_of_successive_bytes_are_uniform() -> None:
    """A 2-D frequency test: the top bytes of counters ``2i`` and ``2i + 1`` fall in 65,536 cells alike."""
    top = unsigned_of(counter_bits(KEYS[3], 0, 1 << 24)) >> 24
    cells = torch.bincount(top[0::2] * 256 + top[1::2], minlength=65536).double()
    expected = (1 << 23) / 65536
    chi2 = float(((cells - expected) ** 2 / expected).sum())
    assert abs(chi2 - 65535) <= Z_LIMIT * math.sqrt(2 * 65535), chi2


def test_stratified_positions_take_one_draw_each_and_are_uniform_within_their_strata() -> None:
    """Position ``i`` is ``floor(i high / count) + floor(b w_i / 2^32)`` of one 32-bit draw ``b`` (the stream's counters
    advance by one per position): the reference in Python integers, each position in its own stratum (so they
    ascend), and a chi-square test of the offsets within strata of 1,000 (each offset's probability is off
    ``1 / 1000`` by at most ``1000 / 2^32`` of it: invisible at this size)."""
    stream = CounterStream(KEYS[2])
    width = 1_000
    drawn = stratified_positions(stream, width * N, N, torch.device("cpu"))
    assert drawn.dtype == torch.int64 and stream.offset == N
    assert drawn.tolist()[:64] == [i * width + ((reference_bits(stream.key, i) * width) >> 32) for i in range(64)]
    offsets = drawn - torch.arange(N) * width
    assert offsets.min() >= 0 and offsets.max() < width
    counts = torch.bincount(offsets, minlength=width).double()
    chi2 = float(((counts - N / width) ** 2 / (N / width)).sum())
    assert abs(chi2 - (width - 1)) <= Z_LIMIT * math.sqrt(2 * (width - 1)), chi2


@pytest.mark.parametrize("high", [1_000_003, 7 * (1 << 31) + 5, 1 << 42])
@pytest.mark.parametrize("kind", ["counter", "generator"])
def test_stratified_positions_lie_one_in_each_stratum_of_uneven_and_wide_strata(high: int, kind: str) -> None:
    """Strata of unequal widths (``high`` not a multiple of ``count``), and strata too wide for a 32-bit draw (their
    positions from 53-bit uniforms, two draws each): every position in ``[floor(i high / count), floor((i + 1) high /
    count))``, from either kind of stream, the same again from the same stream."""
    count = 1_000

    def draws() -> CounterStream | torch.Generator:
        return CounterStream(KEYS[1]) if kind == "counter" else torch.Generator().manual_seed(3)

    drawn = stratified_positions(draws(), high, count, torch.device("cpu"))
    lows = [i * high // count for i in range(count + 1)]
    assert all(lows[i] <= p < lows[i + 1] for i, p in enumerate(drawn.tolist()))
    assert torch.equal(drawn, stratified_positions(draws(), high, count, torch.device("cpu")))
    if kind == "counter":
        stream = draws()
        stratified_positions(stream, high, count, torch.device("cpu"))
        assert stream.offset == (2 * count if high == 1 << 42 else count)  # 2^42 / 1000: strata past 2^31
    # the offsets as fractions of their strata: uniform on [0, 1) (a Kolmogorov-Smirnov bound at the same level)
    fractions = (
        (drawn - torch.tensor(lows[:-1])).double() / torch.tensor(lows[1:]).sub(torch.tensor(lows[:-1]))
    ).sort()
    ks = float((fractions.values - (torch.arange(count) + 0.5) / count).abs().max())
    assert ks <= 0.5 / count + math.sqrt(math.log(2 / 1e-6) / (2 * count)), ks


@pytest.mark.parametrize("count", [0, 11])
def test_stratified_positions_refuse_a_count_outside_one_to_high(count: int) -> None:
    with pytest.raises(ValueError, match=rf"count must be an integer in \[1, high=10\], got {count}"):
        stratified_positions(CounterStream(KEYS[0]), 10, count, torch.device("cpu"))


def test_a_stratified_sample_counts_a_set_with_at_most_the_binomial_variance() -> None:
    """What the Top-k family's margins rest on: the number of sampled positions inside a set of positions has the mean
    ``s |A| / d`` and a variance no larger than the binomial ``s p (1 - p)`` of independent positions. Over 400
    streams, for a scattered set (one position in 100, at random) and a contiguous one (the first 1% of the tensor,
    where the strata make the count all but fixed): the mean within ``Z_LIMIT`` standard errors, the variance below
    the binomial one times a chi-square bound on the sample variance's spread."""
    d, s, trials = 1_000_000, 20_000, 400
    scattered = torch.zeros(d, dtype=torch.bool)
    scattered[torch.randperm(d, generator=torch.Generator().manual_seed(4))[: d // 100]] = True
    contiguous = torch.zeros(d, dtype=torch.bool)
    contiguous[: d // 100] = True
    p = 0.01
    binomial = s * p * (1 - p)
    for members in (scattered, contiguous):
        counts = torch.tensor(
            [
                float(
                    members[
                        stratified_positions(CounterStream(stream_seed(5, 0, t, 3)), d, s, torch.device("cpu"))
                    ].sum()
                )
                for t in range(trials)
            ],
            dtype=torch.float64,
        )
        assert abs(float(counts.mean()) - s * p) <= Z_LIMIT * math.sqrt(binomial / trials)
        assert float(counts.var()) <= binomial * (1 + Z_LIMIT * math.sqrt(2 / (trials - 1)))
        if members is contiguous:  # 200 whole strata: 200 every time, where independent positions spread by 14
            assert float(counts.var()) == 0.0 and float(counts.mean()) == s * p


def test_integers_and_subsets_from_a_counter_stream_are_uniform() -> None:
    draws = random_integers(CounterStream(KEYS[0]), 10, N, torch.device("cpu"))
    counts = torch.bincount(draws, minlength=10).double()
    chi2 = float(((counts - N / 10) ** 2 / (N / 10)).sum())
    assert draws.min() >= 0 and draws.max() < 10
    assert abs(chi2 - 9) <= Z_LIMIT * math.sqrt(18), chi2
    d, k, trials = 50, 7, 4000
    stream = CounterStream(KEYS[1])
    hits = torch.zeros(d, dtype=torch.float64)
    for _ in range(trials):
        subset = random_subset(stream, d, k, torch.device("cpu"))
        assert subset.unique().numel() == k
        hits[subset] += 1
    p = k / d
    z = (hits - trials * p) / math.sqrt(trials * p * (1 - p))
    assert z.abs().max() <= Z_LIMIT, z
