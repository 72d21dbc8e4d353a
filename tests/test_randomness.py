"""The counter-based streams: the hash is the published finaliser, its bits pass frequency and independence tests
(tolerances from the binomial and chi-square variances at ``test_terngrad.FALSE_ALARM``), and a draw depends only on
its key and counter, whatever piece it is drawn in."""

from __future__ import annotations

import math

import pytest
import torch
from test_terngrad import Z_LIMIT

from lightning_gradcomp.core.compressors.draws import random_integers, random_positions, random_subset
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
    key = KEYS[0]
    whole = counter_bits(key, 0, 1000)
    assert torch.equal(counter_bits(key, 300, 200), whole[300:500])
    stream = CounterStream(key)
    assert torch.equal(torch.cat([stream.bits(10), stream.bits(20)]), whole[:30])  # successive draws never overlap
    assert torch.equal(stream.uniform(5), counter_uniform(key, 30, 5))
    wide = CounterStream(key).bits53(3).tolist()  # two draws each: the first's 32 bits over the second's top 21
    assert wide == [(reference_bits(key, 2 * i) << 21) | (reference_bits(key, 2 * i + 1) >> 11) for i in range(3)]
    assert torch.equal(UnitStreams(0, 1).generator(torch.device("cpu"), 0, 17).bits(64), counter_bits(KEYS[2], 0, 64))


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


def test_sample_positions_take_one_draw_each_and_are_uniform_to_high_over_two_to_the_32() -> None:
    """A position is ``floor(b high / 2^32)`` of one 32-bit draw ``b`` (the stream's counters advance by one per
    position): the reference in Python integers, every value below ``high``, and a chi-square test over 1,000 cells
    (each value's probability is off ``1 / high`` by at most ``high / 2^32`` of it: invisible at this size)."""
    stream = CounterStream(KEYS[2])
    high = 1_000
    drawn = random_positions(stream, high, N, torch.device("cpu"))
    assert drawn.dtype == torch.int64 and stream.offset == N
    assert drawn.tolist()[:64] == [(reference_bits(KEYS[2], i) * high) >> 32 for i in range(64)]
    assert drawn.min() >= 0 and drawn.max() < high
    counts = torch.bincount(drawn, minlength=high).double()
    chi2 = float(((counts - N / high) ** 2 / (N / high)).sum())
    assert abs(chi2 - (high - 1)) <= Z_LIMIT * math.sqrt(2 * (high - 1)), chi2
    big = (1 << 31) + 5  # past 2^31 a product would not fit in int64: the 53-bit integers instead
    assert torch.equal(CounterStream(KEYS[3]).positions(big, 1000), CounterStream(KEYS[3]).integers(big, 1000))
    top = random_positions(CounterStream(KEYS[3]), 1 << 31, N, torch.device("cpu"))
    assert top.max() < 1 << 31 and top.min() >= 0


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
