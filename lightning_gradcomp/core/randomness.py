"""Random streams as a pure function of (seed, rank, step, unit, element): the same draws after any restart, on any
device, compiled or eager.

A generator shared by all units and consumed in the order buckets arrive would hand a unit different draws whenever
DDP's bucket layout differs, as it does between a run and its resumption. Here every unit's draws are derived afresh,
counter-style, from the numbers that identify them: a SplitMix64 mix (Steele, Lea, Flood, "Fast splittable
pseudorandom number generators", OOPSLA 2014) of ``seed``, ``rank``, ``step`` and the unit's key gives the unit's
63-bit stream key, and element ``i``'s 32 random bits are a hash of ``(key, i)`` (:func:`counter_bits`): two rounds of
a 32-bit integer finaliser (Wellons' ``lowbias32``, whose avalanche bias is among the lowest of its kind) over the
counter and the key's halves, in plain int32 tensor operations. So a draw needs no generator state: it is the same on
the CPU and the GPU, inside a function that ``torch.compile`` fuses (a ``torch.Generator`` stays an eager kernel of its
own), and in any order the units are compressed; nothing but ``seed`` and the step counter has to be checkpointed.
The bits pass frequency tests of every bit, of each byte and of pairs of successive bytes, and neighbouring counters
and streams one rank, one step or one high key bit apart are uncorrelated (``tests/test_randomness.py``).

:class:`CounterStream` is one unit's stream at one step (its key mixed once more, so that any integers, nearby ones
too, name independent streams): each draw from it takes the next block of counters, so two draws never share bits.
The compressors also take a ``torch.Generator`` (a test's, or a user's), which they use as torch does.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_gradcomp.core.host_copies import device_tensor

__all__ = [
    "SHARED",
    "CounterStream",
    "UnitStreams",
    "counter_bits",
    "counter_uniform",
    "hash_at",
    "hash_counters",
    "key_block",
    "stream_seed",
    "uniform_of",
    "unsigned_of",
]

_MASK64 = (1 << 64) - 1
_MASK32 = (1 << 32) - 1
#: The "rank" of streams every rank draws alike (no real rank is 2**64 - 1).
SHARED = _MASK64


def _splitmix64(z: int) -> int:
    z = (z + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def stream_seed(seed: int, rank: int, step: int, key: int) -> int:
    """The 63-bit key of unit ``key``'s stream on ``rank`` at ``step`` (distinct for each of the four)."""
    z = _splitmix64(seed & _MASK64)
    for part in (rank, step, key):
        z = _splitmix64(z ^ (part & _MASK64))
    return z >> 1


#: ``lowbias32``'s multipliers as the signed 32-bit integers with their bit patterns: int32 products wrap modulo 2^32.
_MULTIPLIER_1 = 0x7FEB352D
_MULTIPLIER_2 = 0x846CA68B - (1 << 32)


def _to_int32(value: int) -> int:
    """``value`` modulo 2^32 as the signed 32-bit integer with that bit pattern."""
    value &= _MASK32
    return value - (1 << 32) if value >= 1 << 31 else value


def _shift_right(x: Tensor, shift: int) -> Tensor:
    """Logical right shift of int32 bit patterns (``>>`` on int32 is arithmetic: it copies the sign bit)."""
    return (x >> shift) & ((1 << (32 - shift)) - 1)


def _lowbias32(x: Tensor) -> Tensor:
    """Wellons' ``lowbias32`` finaliser on int32 bit patterns: 32-bit multiplies, which every backend vectorises
    (int64 ones are several times slower on a CPU)."""
    x = x ^ _shift_right(x, 16)
    x = x * _MULTIPLIER_1
    x = x ^ _shift_right(x, 15)
    x = x * _MULTIPLIER_2
    return x ^ _shift_right(x, 16)


def hash_counters(block: Tensor, count: int) -> Tensor:
    """32 random bits (int32 bit patterns) for ``count`` consecutive counters of one stream: ``block`` is the int32
    tensor ``[key's low 32 bits, key's high 32 bits, first counter]`` (:meth:`CounterStream.block`); counters wrap
    modulo 2^32, the length of a stream.

    Pure integer tensor math, so the same bits on every device, eager or compiled; the key travels as a tensor so
    that a compiled caller is not specialised on it (a new key every step would recompile).
    """
    return hash_at(block, torch.arange(count, dtype=torch.int32, device=block.device))


def hash_at(block: Tensor, offsets: Tensor) -> Tensor:
    """:func:`hash_counters`' bits at the int32 ``offsets`` (any shape) from ``block``'s first counter: the bits of
    counter ``block[2] + offset``, for a kernel that draws its elements in another order than one after the other."""
    counters = offsets + block[2]
    return _lowbias32(_lowbias32(counters ^ block[0]) ^ block[1])


def uniform_of(bits: Tensor) -> Tensor:
    """Uniforms on ``[0, 1)`` (float32) from the top 24 of 32 random bits: exact multiples of ``2^-24``."""
    return _shift_right(bits, 8).to(torch.float32) * 2.0**-24


def unsigned_of(bits: Tensor) -> Tensor:
    """32 random bits as the int64 integers in ``[0, 2^32)`` they spell."""
    return bits.to(torch.int64) & _MASK32


def key_block(key: int, start: int, device: torch.device | str = "cpu") -> Tensor:
    """The :func:`hash_counters` block of stream ``key`` from counter ``start``, on ``device``. On CUDA it is copied
    from pinned memory without waiting (no host synchronisation)."""
    return device_tensor([_to_int32(key), _to_int32(key >> 32), _to_int32(start)], torch.int32, device)


def counter_bits(key: int, start: int, count: int, device: torch.device | str = "cpu") -> Tensor:
    """32 random bits (int32 bit patterns) for counters ``start .. start + count`` of stream ``key``: a pure function
    of the key and the counter, identical on every device."""
    return hash_counters(key_block(key, start, device), count)


def counter_uniform(key: int, start: int, count: int, device: torch.device | str = "cpu") -> Tensor:
    """Uniforms on ``[0, 1)`` (float32, 24 random bits each) for counters ``start .. start + count`` of stream
    ``key``."""
    return uniform_of(counter_bits(key, start, count, device))


class CounterStream:
    """One unit's draws at one step: successive draws take successive blocks of counters of one key.

    ``key`` is any integer: it is mixed (SplitMix64) into the stream's 64-bit key :attr:`key`, so that streams of
    nearby integers (seeds ``0, 1, 2, ...``) are independent. Unmixed, they would not be: the hash XORs the counter
    with the key's low half, so key ``s`` at counter ``c`` would be key ``0`` at counter ``c ^ s``.
    """

    def __init__(self, key: int, device: torch.device | str = "cpu") -> None:
        self.key = _splitmix64(key & _MASK64)
        self.device = torch.device(device)
        self.offset = 0

    def _take(self, count: int) -> int:
        start = self.offset
        self.offset += count
        return start

    def block(self, count: int) -> Tensor:
        """Reserve the next ``count`` counters and return their :func:`hash_counters` block (for a kernel that
        hashes them itself, fused with what it computes from the bits)."""
        return key_block(self.key, self._take(count), self.device)

    def bits(self, count: int) -> Tensor:
        """The next ``count`` draws of 32 bits (int32 bit patterns)."""
        return hash_counters(self.block(count), count)

    def uniform(self, count: int, dtype: torch.dtype = torch.float32) -> Tensor:
        """The next ``count`` uniforms on ``[0, 1)``."""
        return uniform_of(self.bits(count)).to(dtype)

    def bytes(self, count: int) -> Tensor:
        """The next ``count`` random bytes (uint8): four from each draw of 32 bits."""
        words = self.bits(-(-count // 4))
        shifts = torch.arange(0, 32, 8, dtype=torch.int32, device=self.device)
        return ((words.unsqueeze(1) >> shifts) & 0xFF).to(torch.uint8).reshape(-1)[:count]

    def integers(self, high: int, count: int) -> Tensor:
        """The next ``count`` integers in ``[0, high)`` (int64), ``floor(u high)`` of 53-bit uniforms ``u`` made of two
        draws each: any value's probability is ``1 / high`` to within ``2^-53`` (a 32-bit modulo would be off by up to
        ``high / 2^32`` of it: 0.6% at 25M)."""
        u53 = self.bits53(count).double()
        return torch.clamp(u53.mul_(2.0**-53 * high).floor_().long(), max=high - 1)

    def bits53(self, count: int) -> Tensor:
        """The next ``count`` 53-bit random integers (int64 in ``[0, 2^53)``), each from two draws of 32 bits."""
        words = unsigned_of(self.bits(2 * count)).view(count, 2)
        return (words[:, 0] << 21) | (words[:, 1] >> 11)


class UnitStreams:
    """Each unit's :class:`CounterStream` at each step on this rank, and streams every rank draws alike."""

    def __init__(self, seed: int, rank: int) -> None:
        self.seed = seed
        self.rank = rank

    def generator(self, device: torch.device, step: int, key: int) -> CounterStream:
        """The stream of unit ``key`` at ``step`` on ``device``, for it alone."""
        return CounterStream(stream_seed(self.seed, self.rank, step, key), device)

    def shared(self, device: torch.device, key: int) -> torch.Generator:
        """A generator for unit ``key`` seeded alike on every rank, from the seed and the key alone (for state every
        rank must start with the same: PowerSGD's initial ``Q``, drawn once; ``torch.randn`` from it is device-
        specific, which only that first state sees)."""
        generator = torch.Generator(device=device)
        return generator.manual_seed(stream_seed(self.seed, SHARED, 0, key))
