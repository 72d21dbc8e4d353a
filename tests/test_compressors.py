"""Compressors and their wire format, single process: reference equivalence and exact invariants."""

from __future__ import annotations

import re

import pytest
import torch

import lightning_gradcomp.core.compressors.sparse as sparse_module
import lightning_gradcomp.core.memory as memory_module
from lightning_gradcomp.core.compressors import (
    COMPRESSORS,
    IdentityCompressor,
    RandomKCompressor,
    ScaledSignCompressor,
    SparsePayload,
    TopKCompressor,
    build_compressor,
)
from lightning_gradcomp.core.compressors.topk import k_for, kth_smallest
from lightning_gradcomp.core.compressors.wire import ByteReader, to_bytes
from lightning_gradcomp.core.memory import ErrorFeedback, NoMemory, build_memory
from lightning_gradcomp.core.randomness import CounterStream


@pytest.mark.parametrize(
    ("numel", "density", "k"),
    [(1000, 0.001, 1), (1000, 0.01, 10), (10, 0.001, 1), (7, 1.0, 7), (999, 0.5, 499), (0, 0.1, 0)],
)
def test_k_follows_the_authors_rule(numel: int, density: float, k: int) -> None:
    assert k_for(numel, density) == k


def _spied_kthvalue(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The sizes ``torch.kthvalue`` is called on from now on."""
    sizes, kthvalue = [], torch.kthvalue
    monkeypatch.setattr(torch, "kthvalue", lambda x, r: sizes.append(x.numel()) or kthvalue(x, r))
    return sizes


@pytest.mark.parametrize(
    "values", ["uniform", "cubed normal", "seven levels", "constant", "ascending", "descending", "float64 normal"]
)
@pytest.mark.parametrize("c", [65_535, 65_536, 300_001])
def test_kth_smallest_is_kthvalue_whether_its_band_holds_the_answer_or_not(
    values: str, c: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    gen = torch.Generator().manual_seed(5)
    x = {
        "uniform": lambda: torch.rand(c, generator=gen),
        "cubed normal": lambda: torch.randn(c, generator=gen) ** 3,
        "seven levels": lambda: torch.randint(0, 7, (c,), generator=gen).float(),  # ties at every cut
        "constant": lambda: torch.full((c,), 0.25),
        "ascending": lambda: torch.arange(c, dtype=torch.float32),
        "descending": lambda: torch.arange(c, 0, -1, dtype=torch.float32),
        "float64 normal": lambda: torch.randn(c, generator=gen, dtype=torch.float64),
    }[values]()
    sizes = _spied_kthvalue(monkeypatch)
    for rank in (1, 2, 1000, c // 2, c - 252_000, c - 1, c):
        if not 1 <= rank <= c:
            continue
        sizes.clear()
        assert torch.equal(kth_smallest(x, rank), torch.topk(x, rank, largest=False).values.max()), rank
        if c >= 65_536 and values in ("uniform", "cubed normal", "float64 normal") and 1 < rank < c:
            # the systematic sample's band held the answer: kthvalue ran on a few percent of the values
            assert sizes == [sizes[0]] and sizes[0] < c // 10, sizes
        if c < 65_536:
            assert sizes == [c]  # too few for a band: kthvalue of them all


@pytest.mark.parametrize("density", [0.001, 0.01, 0.3, 1.0])
def test_topk_selects_exactly_the_k_largest_magnitudes(density: float) -> None:
    x = torch.randn(5003, generator=torch.Generator().manual_seed(1))
    compressor = TopKCompressor(density)
    payload = compressor.compress(x)
    k = k_for(x.numel(), density)
    assert payload.k == k and payload.indices.unique().numel() == k
    reference = x.abs().sort(descending=True).values[:k]
    assert torch.equal(payload.values.abs().sort(descending=True).values, reference)
    assert torch.equal(payload.values, x[payload.indices])
    dense = compressor.decompress(payload)
    assert torch.count_nonzero(dense) == k
    if density == 1.0:
        assert torch.equal(dense, x)


def test_topk_is_a_contraction_with_the_theoretical_factor() -> None:
    gen = torch.Generator().manual_seed(2)
    for density in (0.001, 0.01, 0.1):
        for x in (torch.randn(10_000, generator=gen), torch.randn(10_000, generator=gen) ** 3):
            compressor = TopKCompressor(density)
            error = (x - compressor.decompress(compressor.compress(x))).pow(2).sum()
            assert error <= (1 - k_for(x.numel(), density) / x.numel()) * x.pow(2).sum()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("numel", [1, 3, 1001])
def test_sparse_wire_round_trip_is_exact(dtype: torch.dtype, numel: int) -> None:
    x = torch.randn(numel, generator=torch.Generator().manual_seed(numel)).to(dtype)
    compressor = TopKCompressor(0.3)
    payload = compressor.compress(x)
    wire = payload.to_bytes()
    assert wire.dtype == torch.uint8 and wire.numel() == payload.nbytes == compressor.payload_nbytes(x.shape, dtype)
    # the count (int64), then k = 1, 1 and 300 indices: a bitmap of ceil(numel / 8) bytes is the smallest exact form at
    # density 0.3
    assert payload.nbytes == 8 + {1: 1, 3: 1, 1001: 126}[numel] + payload.k * x.element_size()
    # parse from an odd offset inside a bigger buffer: parts are misaligned and must still read back
    shifted = torch.cat([torch.zeros(3, dtype=torch.uint8), wire])[3:]
    back = compressor.unpack(shifted, x.shape, dtype)
    order = payload.indices.argsort()  # the wire carries the entries in ascending index order
    assert torch.equal(back.indices, payload.indices[order].long()) and torch.equal(back.values, payload.values[order])
    assert torch.equal(compressor.decompress(back), compressor.decompress(payload))


def test_empty_sparse_payload_round_trips() -> None:
    payload = SparsePayload(torch.empty(0, dtype=torch.int64), torch.empty(0), torch.Size([50]))
    assert payload.nbytes == 8 and payload.to_bytes().numel() == 8  # the count alone
    back = SparsePayload.from_bytes(payload.to_bytes(), torch.Size([50]), torch.float32)
    assert back.k == 0 and torch.equal(back.accumulate(torch.zeros(50)), torch.zeros(50))


def test_truncated_or_ragged_bytes_are_rejected() -> None:
    # 2 entries of 10: the count, a 2-byte bitmap and 8 bytes of values
    two = torch.tensor([2], dtype=torch.int64).view(torch.uint8)
    with pytest.raises(ValueError, match="sparse payload of 11 bytes, expected 18 for 2 entries"):
        SparsePayload.from_bytes(torch.cat([two, torch.zeros(3, dtype=torch.uint8)]), torch.Size([10]), torch.float32)
    with pytest.raises(ValueError, match="sparse payload of 7 bytes claims -1 entries"):
        SparsePayload.from_bytes(torch.zeros(7, dtype=torch.uint8), torch.Size([10]), torch.float32)
    with pytest.raises(ValueError, match="truncated"):
        ByteReader(torch.zeros(3, dtype=torch.uint8)).take(1, torch.float32)


def test_identity_round_trip_and_bytes() -> None:
    x = torch.randn(13).to(torch.bfloat16)
    compressor = IdentityCompressor()
    payload = compressor.compress(x)
    assert payload.nbytes == 26 == compressor.payload_nbytes(x.shape, torch.bfloat16)
    assert torch.equal(compressor.unpack(payload.to_bytes(), x.shape, torch.bfloat16).values, x)
    assert to_bytes([]).numel() == 0


@pytest.mark.parametrize("density", [0, -0.1, 1.01, float("nan"), float("inf"), "0.1", True, None])
def test_bad_density_is_rejected_with_the_allowed_range(density: object) -> None:
    with pytest.raises(ValueError, match=r"density must be a number in \(0, 1\]"):
        TopKCompressor(density)  # type: ignore[arg-type]


def test_build_compressor_names_the_choices() -> None:
    assert isinstance(build_compressor("topk", density=0.5), TopKCompressor)
    with pytest.raises(ValueError, match=re.escape(f"compressor must be one of {sorted(COMPRESSORS)}")):
        build_compressor("top-k")
    with pytest.raises(ValueError, match="does not take the arguments"):
        build_compressor("none", density=0.1)
    with pytest.raises(ValueError, match="set them on the instance"):
        build_compressor(TopKCompressor(), density=0.1)


def test_error_feedback_keeps_exactly_what_was_not_sent() -> None:
    gen = torch.Generator().manual_seed(3)
    memory, compressor = ErrorFeedback(), TopKCompressor(0.05)
    old = torch.zeros(400)
    for _ in range(5):
        grad = torch.randn(400, generator=gen)
        acc = memory.compensate("w", grad)
        assert torch.equal(acc, grad + old)
        sent = compressor.decompress(compressor.compress(acc))
        memory.update("w", acc, sent, sent)
        new = memory.residual("w")
        assert torch.equal(sent + new, acc)
        assert torch.count_nonzero(new) == 400 - 20
        old = new.clone()
    state = memory.state_dict()
    restored = ErrorFeedback()
    restored.load_state_dict(state)
    assert torch.equal(restored.residual("w"), old)


def test_error_feedback_settled_by_the_hook_reads_the_tensor_only_where_the_sent_entries_do_not_vouch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Catches: the hook's half of the update (called once the mean is known finite) summing the compensated tensor or
    the entries again, a pass on the CPU and a wait for the device on a GPU, where the payload already told it was
    finite (Top-k's largest entries, a scaled sign's scale); and skipping the tensor's sum where it did not (random-k).
    The public ``update`` still checks, from the entries where they vouch."""
    sums: list[str] = []
    for module, what, names in (
        (memory_module, "tensor", ("all_finite", "finiteness")),
        (sparse_module, "entries", ("finiteness",)),
    ):
        for name in names:
            monkeypatch.setattr(module, name, lambda x, what=what: sums.append(what) or bool(x.isfinite().all()))
    cases = ((TopKCompressor(0.05), [], ["entries"]), (ScaledSignCompressor(), [], []))
    for compressor, settled, updated in (*cases, (RandomKCompressor(0.05), ["tensor"], ["tensor"])):
        memory, acc = ErrorFeedback(), torch.randn(400, generator=torch.Generator().manual_seed(4))
        payload = compressor.compress(acc, CounterStream(5))
        sums.clear()
        memory.settle_("w", acc, payload.entries(), 400)
        assert sums == settled, compressor
        assert torch.equal(memory.residual("w"), acc - compressor.decompress(payload))
        sums.clear()
        memory.update("w", acc, payload.entries(), None)
        assert sums == updated, compressor


def test_memory_registry() -> None:
    assert isinstance(build_memory("none"), NoMemory) and isinstance(build_memory("ef"), ErrorFeedback)
    with pytest.raises(ValueError, match=r"memory must be one of \['diana', 'ef', 'none'\], got 'residual'"):
        build_memory("residual")
    with pytest.raises(ValueError, match=r"memory 'ef' does not take the arguments \['alpha'\]"):
        build_memory("ef", alpha=0.5)


@pytest.mark.parametrize("world", [2, 3])
def test_the_sparse_mean_divides_only_where_entries_landed_and_equals_the_dense_division(world: int) -> None:
    compressor = TopKCompressor(density=0.05)
    numel = 4000
    payloads = []
    for rank in range(world):
        x = torch.randn(numel, generator=torch.Generator().manual_seed(rank))
        x[:50] += 10.0  # entries every rank sends: an index written once per rank, with the same value
        payloads.append(compressor.compress(x, torch.Generator().manual_seed(10 + rank)))
    mean = compressor.average_all(payloads, torch.full((numel,), 7.0), world)
    dense = compressor.accumulate_all(payloads, torch.zeros(numel)).div_(world)
    assert torch.equal(mean, dense)
    # the ranks chose different entries besides the 50 they share
    assert bool((mean[:50] != 0).all()) and int((mean != 0).sum()) > k_for(numel, 0.05)
