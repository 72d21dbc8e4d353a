"""Aggregators over real gloo ranks (2, 3, 4): exact results, identical on every rank, bytes counted."""

from __future__ import annotations

import pytest
import torch
from ranks import EveryRank, run_cases

from lightning_gradcomp.core.comm import AllgatherAggregator, AllreduceAggregator, Collectives, Contribution
from lightning_gradcomp.core.comm.collectives import BROADCAST_GATHER_BYTES
from lightning_gradcomp.core.compressors import IdentityCompressor, TopKCompressor
from lightning_gradcomp.core.compressors.indices import encoded_nbytes

NUMELS = (1000, 37, 4096)


class ThresholdSelection(TopKCompressor):
    """Keeps entries with |x| > 2.5: a variable count per rank, zero for a rank with small values."""

    def select(self, x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        return torch.nonzero(x.abs() > 2.5).reshape(-1)

    def payload_nbytes(self, numel: int, dtype: torch.dtype) -> None:
        return None


def _local_inputs(rank: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + rank)
    scale = 0.0 if rank == 1 else 1.0  # rank 1 has nothing above the threshold: it sends no entry
    return [torch.randn(n, generator=gen) * scale * 1.2 for n in NUMELS]


def _allgather_variable(rank: int, world_size: int) -> dict:
    codec = ThresholdSelection()
    collectives = Collectives()
    payloads = [codec.compress(x) for x in _local_inputs(rank)]
    results = AllgatherAggregator().aggregate([Contribution(codec, p) for p in payloads], collectives)
    return {
        "means": [r.mean for r in results],
        "sent": [r.sent for r in results],
        "k": [p.k for p in payloads],
        "bytes_sent": collectives.counter.bytes_sent,
        "calls": collectives.counter.calls,
    }


def every_case(rank: int, world_size: int) -> dict:
    """All cases in one launch per world size (starting ranks costs seconds; the cases are independent)."""
    cases = {
        "variable": _allgather_variable,
        "empty": _allgather_all_empty,
        "fixed": _topk_and_dense,
        "parts": _bytes_in_parts,
        "broadcast": _bytes_by_broadcasts,
    }
    return run_cases(rank, world_size, cases)


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_allgather_of_variable_sparse_payloads_is_exact_on_every_rank(world_size: int, every_rank: EveryRank) -> None:
    results = every_rank(world_size, "variable")
    codec = ThresholdSelection()
    assert results[1]["k"] == [0, 0, 0]
    assert all(sum(r["k"]) > 0 for i, r in enumerate(results) if i != 1)
    for i, numel in enumerate(NUMELS):
        total = torch.zeros(numel)
        for rank in range(world_size):
            total += codec.decompress(codec.compress(_local_inputs(rank)[i]))
        expected = total / world_size
        for rank, r in enumerate(results):
            assert torch.equal(r["means"][i], expected), f"rank {rank}, unit {i}"
            assert torch.equal(r["sent"][i], codec.decompress(codec.compress(_local_inputs(rank)[i])))
    # each payload: its count, its indices (as few bytes as the count allows), its float32 values
    longest = max(sum(8 + encoded_nbytes(n, k) + 4 * k for n, k in zip(NUMELS, r["k"], strict=True)) for r in results)
    for r in results:
        assert r["calls"] == 2  # one size exchange + one gather, for all three units together
        assert r["bytes_sent"] == 8 * len(NUMELS) + longest


def _allgather_all_empty(rank: int, world_size: int) -> dict:
    codec = ThresholdSelection()
    collectives = Collectives()
    payload = codec.compress(torch.zeros(10))
    (result,) = AllgatherAggregator().aggregate([Contribution(codec, payload)], collectives)
    return {"mean": result.mean, "bytes_sent": collectives.counter.bytes_sent}


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_allgather_when_no_rank_selects_anything(world_size: int, every_rank: EveryRank) -> None:
    for r in every_rank(world_size, "empty"):
        assert torch.equal(r["mean"], torch.zeros(10))
        assert r["bytes_sent"] == 8 + 8  # the size, then the payload: its count of no entries


def _topk_and_dense(rank: int, world_size: int) -> dict:
    topk, identity = TopKCompressor(0.01), IdentityCompressor()
    gen = torch.Generator().manual_seed(rank)
    xs = [torch.randn(n, generator=gen) for n in NUMELS]
    contributions = [
        Contribution(topk, topk.compress(xs[0])),
        Contribution(identity, identity.compress(xs[1])),
        Contribution(topk, topk.compress(xs[2])),
    ]
    collectives = Collectives()
    gathered = AllgatherAggregator().aggregate(contributions, collectives)
    reduced_collectives = Collectives()
    reduced = AllreduceAggregator().aggregate(contributions, reduced_collectives)
    return {
        "xs": xs,
        "gathered": [g.mean for g in gathered],
        "reduced": [g.mean for g in reduced],
        "counts": (collectives.counter.calls, collectives.counter.bytes_sent),
        "reduced_counts": (reduced_collectives.counter.calls, reduced_collectives.counter.bytes_sent),
    }


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_fixed_size_payloads_skip_the_size_exchange_and_match_allreduce(world_size: int, every_rank: EveryRank) -> None:
    results = every_rank(world_size, "fixed")
    topk = TopKCompressor(0.01)
    for i in range(len(NUMELS)):
        for r in results:
            assert torch.equal(r["gathered"][i], results[0]["gathered"][i])
            assert torch.equal(r["reduced"][i], results[0]["reduced"][i])
            # two exact sums of the same sparse vectors in different orders: equal to rounding
            torch.testing.assert_close(r["gathered"][i], r["reduced"][i], rtol=1e-6, atol=1e-7)
    dense_mean = sum(r["xs"][1] for r in results) / world_size
    torch.testing.assert_close(results[0]["gathered"][1], dense_mean, rtol=1e-6, atol=1e-7)
    sparse_bytes = sum(topk.payload_nbytes(torch.Size([n]), torch.float32) for n in (NUMELS[0], NUMELS[2]))
    for r in results:
        assert r["counts"] == (2, 37 * 4 + sparse_bytes)  # dense allreduce + one gather, no size exchange
        # float sums: one allreduce each, so a unit's sum never depends on what travels with it
        assert r["reduced_counts"] == (3, 4 * sum(NUMELS))


def _rank_bytes(rank: int, numel: int) -> torch.Tensor:
    return torch.arange(numel, dtype=torch.int64).mul_(7).add_(rank).to(torch.uint8)


def _bytes_in_parts(rank: int, world_size: int) -> dict:
    """Rank r sends 10 r + 3 bytes in three parts (one empty) with sizes exchanged, then one part of a size every
    rank has (sent as it lies), then the same buffer with the sizes given."""
    collectives = Collectives()
    whole = _rank_bytes(rank, 10 * rank + 3)
    parts = [whole[:2], whole[2:2], whole[2:]]
    same = _rank_bytes(rank, 5)
    sizes = [10 * r + 3 for r in range(world_size)]
    return {
        "parts": collectives.all_gather_bytes(parts),
        "same": collectives.all_gather_bytes(same),
        "known": collectives.all_gather_bytes(parts, sizes=sizes),
        "sent_intact": torch.equal(torch.cat(parts), _rank_bytes(rank, 10 * rank + 3)),
    }


@pytest.mark.parametrize("world_size", [2, 3])
def test_bytes_gathered_from_parts_arrive_whole_on_every_rank(world_size: int, every_rank: EveryRank) -> None:
    for r in every_rank(world_size, "parts"):
        for key, numel in (("parts", lambda q: 10 * q + 3), ("same", lambda q: 5), ("known", lambda q: 10 * q + 3)):
            rows = r[key]
            assert len(rows) == world_size
            for q, row in enumerate(rows):
                assert torch.equal(row, _rank_bytes(q, numel(q))), (key, q)
        assert r["sent_intact"]


def _bytes_by_broadcasts(rank: int, world_size: int) -> dict:
    """Rows of at least BROADCAST_GATHER_BYTES: gathered on gloo by a broadcast per rank, into kept buffers whose
    sizes are recorded: one part of a size every rank has (no row kept for this rank's own), two parts that lie end
    to end in one tensor (likewise), then parts of separate tensors padded to the longest (every row kept), then a
    plain tensor gather."""
    collectives = Collectives()
    asked: list[int] = []
    kept: dict[int, torch.Tensor] = {}

    def rows(numel: int) -> torch.Tensor:
        asked.append(numel)
        return kept.setdefault(numel, torch.full((numel,), 255, dtype=torch.uint8))

    same_numel = BROADCAST_GATHER_BYTES + 5
    same = _rank_bytes(rank, same_numel)
    before = collectives.counter.copy()
    gathered_same = collectives.all_gather_bytes(same, sizes=[same_numel] * world_size, rows=rows)
    same_counts = collectives.counter.since(before)
    span = _rank_bytes(rank, same_numel + 3)
    gathered_span = collectives.all_gather_bytes([span[:4], span[4:]], sizes=[same_numel + 3] * world_size, rows=rows)
    whole = _rank_bytes(rank, BROADCAST_GATHER_BYTES + 10 * rank + 3)
    parts = [whole[:2].clone(), whole[2:].clone()]
    sizes = [BROADCAST_GATHER_BYTES + 10 * r + 3 for r in range(world_size)]
    gathered_parts = collectives.all_gather_bytes(parts, sizes=sizes, rows=rows)
    ints = torch.arange(BROADCAST_GATHER_BYTES, dtype=torch.int32) * (rank + 1)
    return {
        "same": gathered_same,
        "same_is_own": gathered_same[rank].data_ptr() == same.data_ptr(),
        "same_counts": (same_counts.calls, same_counts.bytes_sent, same_counts.bytes_received),
        "span": gathered_span,
        "span_is_own": gathered_span[rank].data_ptr() == span.data_ptr(),
        "parts": gathered_parts,
        "asked": asked,
        "ints": collectives.all_gather(ints),
    }


@pytest.mark.parametrize("world_size", [2, 3])
def test_rows_gathered_by_broadcasts_arrive_whole_on_every_rank(world_size: int, every_rank: EveryRank) -> None:
    same_numel = BROADCAST_GATHER_BYTES + 5
    longest = BROADCAST_GATHER_BYTES + 10 * (world_size - 1) + 3
    for rank, r in enumerate(every_rank(world_size, "broadcast")):
        for q in range(world_size):
            assert torch.equal(r["same"][q], _rank_bytes(q, same_numel)), (rank, q)
            assert torch.equal(r["span"][q], _rank_bytes(q, same_numel + 3)), (rank, q)
            assert torch.equal(r["parts"][q], _rank_bytes(q, BROADCAST_GATHER_BYTES + 10 * q + 3)), (rank, q)
            assert torch.equal(r["ints"][q], torch.arange(BROADCAST_GATHER_BYTES, dtype=torch.int32) * (q + 1))
        assert r["same_is_own"] and r["span_is_own"]  # this rank's row is what it sent, not a copy
        # kept buffers: the other ranks' rows for what is sent as it lies, every row for the padded parts
        others = world_size - 1
        assert r["asked"] == [others * same_numel, others * (same_numel + 3), world_size * longest]
        # counted as one gather, with the bytes an allgather hands over
        assert r["same_counts"] == (1, same_numel, world_size * same_numel)
