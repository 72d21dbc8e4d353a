"""gTop-k over real gloo ranks: every world size from 2 to 8 in one spawn of 8 processes.

Each world size runs in a process group of its own (odd sizes on the last ranks, so group ranks
differ from global ranks). Each group aggregates, over two error-feedback steps, Top-k units
(one with many ties), a thresholded unit (counts vary, some above k) and a dense unit in one
call, and checks the result against an independent pure-Python butterfly. The same spawn runs
the allgather of sparse payloads of different sizes, a hand-built case where an entry is dropped on the way,
the argument checks, and the hook under torch's own DDP on a 3-rank group.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
from models import teacher_task
from ranks import run_ranks
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from lightning_gradcomp.core.comm import AllgatherAggregator, Collectives, Contribution
from lightning_gradcomp.core.comm.gtopk import GTopKAggregator, SparseSet, merge_tracked
from lightning_gradcomp.core.compressors import IdentityCompressor, SparseEntries, TopKCompressor
from lightning_gradcomp.core.compressors.indices import encoded_nbytes
from lightning_gradcomp.core.compressors.topk import k_for
from lightning_gradcomp.core.memory import ErrorFeedback
from lightning_gradcomp.ddp.hook import GradCompHook, gradcomp_comm_hook

WORLD = 8
SIZES = tuple(range(2, WORLD + 1))
DENSITY = 0.01
# (name, numel, kind): Top-k units, one of +-1 entries (ties everywhere), a threshold, and a dense unit.
UNITS = (
    ("a", 1000, "topk"),
    ("b", 4096, "topk"),
    ("ties", 600, "topk"),
    ("g", 5000, "threshold"),
    ("bias", 37, "dense"),
)
SPARSE = [i for i, (_, _, kind) in enumerate(UNITS) if kind != "dense"]
STEPS = 2


class Threshold(TopKCompressor):
    """Keeps ``|x| > 2.5``: about 1.2% of N(0, 1) entries, a count that varies and often exceeds ``k``
    (which gTop-k cuts to its ``k`` largest first)."""

    def select(self, x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        return torch.nonzero(x.reshape(-1).abs() > 2.5).reshape(-1)

    def payload_nbytes(self, shape: torch.Size, dtype: torch.dtype) -> None:
        return None


def _group_ranks(world_size: int) -> list[int]:
    return list(range(WORLD - world_size, WORLD)) if world_size % 2 else list(range(world_size))


def _grads(world_size: int, rank: int, step: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * world_size + 10 * rank + step)
    grads = []
    for _, numel, _ in UNITS:
        x = torch.randn(numel, generator=gen)
        grads.append(torch.where(x > 0, 1.0, -1.0) if numel == 600 else x)
    return grads


def _gtopk_steps(collectives: Collectives) -> dict:
    rank, world = collectives.rank, collectives.world_size
    codecs = {"topk": TopKCompressor(DENSITY), "threshold": Threshold(DENSITY), "dense": IdentityCompressor()}
    memory, aggregator = ErrorFeedback(), GTopKAggregator()
    steps = []
    for step in range(STEPS):
        contributions, accs, payloads = [], [], []
        for (name, _, kind), grad in zip(UNITS, _grads(world, rank, step), strict=True):
            acc = grad if kind == "dense" else memory.compensate(name, grad)
            payload = codecs[kind].compress(acc)
            contributions.append(Contribution(codecs[kind], payload))
            accs.append(acc.clone())
            payloads.append((payload.indices, payload.values) if kind != "dense" else None)
        counter = collectives.counter
        before = (counter.bytes_sent, counter.bytes_received, counter.calls)
        results = aggregator.aggregate(contributions, collectives)
        residuals = []
        for (name, _, kind), acc, result in zip(UNITS, accs, results, strict=True):
            if kind != "dense":
                memory.update(name, acc, result.sent, result.mean)
                residuals.append(memory.residual(name).clone())
            else:
                residuals.append(None)
        steps.append(
            {
                "acc": accs,
                "payload": payloads,
                "mean": [r.mean for r in results],
                "sent": [r.sent for r in results],
                "residual": residuals,
                "counts": (
                    counter.bytes_sent - before[0],
                    counter.bytes_received - before[1],
                    counter.calls - before[2],
                ),
            }
        )
    return {"steps": steps, "allgather": _allgather_variable(collectives)}


def _allgather_variable(collectives: Collectives) -> dict:
    codec = Threshold(0.002)
    x = torch.randn(20000, generator=torch.Generator().manual_seed(7 + collectives.rank)) * (1 + collectives.rank)
    x[:50] *= 4.0 + collectives.rank  # heavier tails on higher ranks: the counts differ
    payload = codec.compress(x)
    (result,) = AllgatherAggregator().aggregate([Contribution(codec, payload)], collectives)
    return {"x": x, "k": payload.k, "mean": result.mean}


def _dropped_on_the_way(collectives: Collectives) -> dict:
    """Rank 0's entry at index 0 is dropped in round 0 (rank 1's is larger), yet index 0 wins via ranks 2 and 3."""
    local = [[1.0, 0, 0, 0], [0, 2.0, 0, 0], [3.0, 0, 0, 0], [0, 0, 0, 0.5]][collectives.rank]
    codec, memory = TopKCompressor(0.25), ErrorFeedback()
    acc = memory.compensate("w", torch.tensor(local))
    (result,) = GTopKAggregator().aggregate([Contribution(codec, codec.compress(acc))], collectives)
    memory.update("w", acc, result.sent, result.mean)
    return {"mean": result.mean, "sent": result.sent, "residual": memory.residual("w")}


def _survivors_vouching(collectives: Collectives) -> dict:
    """Rank 1's tensor holds a NaN, which its Top-k set holds too; a threshold's set leaves it out (it vouches for
    nothing)."""
    x = torch.randn(1000, generator=torch.Generator().manual_seed(collectives.rank))
    if collectives.rank == 1:
        x[500] = float("nan")
    topk, threshold = TopKCompressor(DENSITY), Threshold(DENSITY)
    contributions = [Contribution(topk, topk.compress(x)), Contribution(threshold, threshold.compress(x))]
    results = GTopKAggregator().aggregate(contributions, collectives)
    return {
        "vouches": [r.reached.vouches_finite for r in results],
        "finite": [r.reached.all_finite() for r in results],
        "survivors_finite": [bool(r.reached.values.isfinite().all()) for r in results],
        "mean_finite": [bool(r.mean.isfinite().all()) for r in results],
        "x": x,
    }


class _NotSparse(TopKCompressor):
    sparse = False


class _NoDensity(TopKCompressor):
    def __init__(self) -> None:
        super().__init__(0.5)
        self.density = None  # type: ignore[assignment]


def _argument_errors(collectives: Collectives) -> list[str]:
    messages = []
    for codec in (_NotSparse(0.5), _NoDensity()):
        try:
            GTopKAggregator().aggregate([Contribution(codec, TopKCompressor(0.5).compress(torch.ones(4)))], collectives)
        except ValueError as err:
            messages.append(str(err))
    return messages


def _hook_under_ddp(group: dist.ProcessGroup) -> dict:
    """Five SGD steps of a small MLP under torch's DDP with the gradcomp hook and gTop-k (whole-model unit)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))
    ddp = DistributedDataParallel(model, process_group=group, bucket_cap_mb=0.001)
    memory = ErrorFeedback()
    hook = GradCompHook(
        TopKCompressor(0.05), memory, GTopKAggregator(), list(model.named_parameters()),
        granularity="model", warmup_steps=1, min_compress_numel=100, group=group,
    )  # fmt: skip
    ddp.register_comm_hook(hook, gradcomp_comm_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    data = teacher_task(n=16 * world * 5)
    for step in range(5):
        lo = (step * world + rank) * 16
        optimizer.zero_grad()
        nn.functional.cross_entropy(ddp(data.tensors[0][lo : lo + 16]), data.tensors[1][lo : lo + 16]).backward()
        optimizer.step()
    return {"weights": model.state_dict(), "history": list(hook.history), "residuals": memory.state_dict()}


def _worker(rank: int, world_size: int) -> dict:
    out = {}
    for size in SIZES:
        members = _group_ranks(size)
        group = dist.new_group(members)
        if rank not in members:
            continue
        collectives = Collectives(group)
        result = _gtopk_steps(collectives)
        if size == 4:
            result["dropped"] = _dropped_on_the_way(Collectives(group))
        if size == 2:
            result["errors"] = _argument_errors(Collectives(group))
            result["vouching"] = _survivors_vouching(Collectives(group))
        if size == 3:
            result["ddp"] = _hook_under_ddp(group)
        out[size] = result
    return out


@pytest.fixture(scope="module")
def by_size() -> dict[int, list[dict]]:
    """Per world size, the results of the group's ranks in group-rank order (one spawn of 8 processes)."""
    ranks = run_ranks(_worker, WORLD, timeout=240)
    return {size: [ranks[g][size] for g in _group_ranks(size)] for size in SIZES}


def _merge(a: dict[int, torch.Tensor], b: dict[int, torch.Tensor], k: int) -> dict[int, torch.Tensor]:
    out = dict(a)
    for i, v in b.items():
        out[i] = out[i] + v if i in out else v
    return dict(sorted(out.items(), key=lambda e: (-abs(float(e[1])), e[0]))[:k])


def _reference(sets: list[dict[int, torch.Tensor]], k: int) -> dict[int, torch.Tensor]:
    """gTop-k by hand: fold ranks above the largest power of two, then the butterfly; every rank's result."""
    base = 1 << int(math.log2(len(sets)))
    held = [_merge(dict(s), sets[base + j], k) if base + j < len(sets) else dict(s) for j, s in enumerate(sets[:base])]
    stride = 1
    while stride < base:
        held = [_merge(held[j], held[j ^ stride], k) for j in range(base)]
        stride *= 2
    assert all(h == held[0] for h in held)
    return held[0]


def _local_set(indices: torch.Tensor, values: torch.Tensor, k: int) -> dict[int, torch.Tensor]:
    entries = sorted(zip(indices.tolist(), values.unbind(), strict=True), key=lambda e: (-abs(float(e[1])), e[0]))
    return dict(entries[:k])


def _dense(entries: dict[int, torch.Tensor], numel: int) -> torch.Tensor:
    out = torch.zeros(numel)
    for i, v in entries.items():
        out[i] = v
    return out


@pytest.mark.parametrize("k", [500, 1200])  # fewer than the distinct indices, then all of them
@pytest.mark.parametrize("shared", [0.0, 0.3, 1.0])
@pytest.mark.parametrize("ties", [False, True])
def test_a_merge_is_the_reference_merge_and_tracks_where_every_entry_went(shared: float, ties: bool, k: int) -> None:
    """Both sides' entries: a position in the merged set when their index is there, -1 when a merge dropped it (an
    index both sides hold goes where their sum went, from either side)."""
    gen = torch.Generator().manual_seed(int(10 * shared) + 7 * ties)
    numel, count = 5000, 600
    pool = torch.randperm(numel, generator=gen)
    overlap = int(shared * count)
    a_indices = pool[:count].sort().values
    b_indices = torch.cat([pool[:overlap], pool[count : 2 * count - overlap]]).sort().values
    draw = (lambda: torch.randint(-4, 5, (count,), generator=gen).float()) if ties else (
        lambda: torch.randn(count, generator=gen))  # fmt: skip
    a, b = SparseSet(a_indices, draw()), SparseSet(b_indices, draw())
    merged, moved_a, moved_b = merge_tracked(a, b, k)
    as_dict = [dict(zip(side.indices.tolist(), side.values, strict=True)) for side in (a, b)]
    expected = _merge(*as_dict, k)
    assert merged.indices.tolist() == sorted(expected)
    assert torch.equal(merged.values, torch.stack([expected[i] for i in sorted(expected)]))
    place = {i: p for p, i in enumerate(merged.indices.tolist())}
    for side, moved in ((a, moved_a), (b, moved_b)):
        assert moved.tolist() == [place.get(i, -1) for i in side.indices.tolist()]


def test_a_merge_of_indices_past_int32_sorts_them_as_int64() -> None:
    big = 2**33
    a = SparseSet(torch.tensor([1, big, big + 7]), torch.tensor([1.0, 4.0, -2.0]))
    b = SparseSet(torch.tensor([5, big]), torch.tensor([3.0, -1.0]))
    merged, moved_a, moved_b = merge_tracked(a, b, 3)
    assert merged.indices.dtype == torch.int64 and merged.indices.tolist() == [5, big, big + 7]
    assert merged.values.tolist() == [3.0, 3.0, -2.0]
    assert moved_a.tolist() == [-1, 1, 2] and moved_b.tolist() == [0, 1]


def test_a_merge_ranks_a_nan_first_and_tracks_it() -> None:
    a = SparseSet(torch.tensor([1, 4, 6, 9]), torch.tensor([5.0, float("nan"), -1.0, 0.5]))
    b = SparseSet(torch.tensor([2, 4, 9]), torch.tensor([-3.0, 2.0, 0.25]))
    merged, moved_a, moved_b = merge_tracked(a, b, 3)
    assert merged.indices.tolist() == [1, 2, 4] and bool(merged.values[2].isnan())
    assert merged.values[:2].tolist() == [5.0, -3.0]
    assert moved_a.tolist() == [0, 2, -1, -1] and moved_b.tolist() == [1, 2, -1]


@pytest.mark.parametrize("size", SIZES)
def test_every_rank_gets_the_same_global_topk_as_a_reference_butterfly(by_size: dict, size: int) -> None:
    results = by_size[size]
    for step in range(STEPS):
        for u in SPARSE:
            _, numel, _ = UNITS[u]
            k = k_for(numel, DENSITY)
            sets = [_local_set(*r["steps"][step]["payload"][u], k) for r in results]
            expected = _dense(_reference(sets, k), numel) / size
            for rank, r in enumerate(results):
                mean = r["steps"][step]["mean"][u]
                assert torch.equal(mean, results[0]["steps"][step]["mean"][u]), (step, u, rank)
                assert torch.equal(mean, expected), (step, u, rank)
                assert 0 < torch.count_nonzero(mean) <= k
        dense = sum(r["steps"][step]["acc"][-1] for r in results) / size
        for r in results:
            torch.testing.assert_close(r["steps"][step]["mean"][-1], dense, rtol=1e-6, atol=1e-7)
    counts = {r["steps"][s]["payload"][3][0].numel() for r in results for s in range(STEPS)}
    assert len(counts) > 1 and max(counts) > k_for(5000, DENSITY), counts  # varying, some above k


def test_two_ranks_get_topk_of_the_sum_of_their_sparse_vectors(by_size: dict) -> None:
    for step in range(STEPS):
        for u in SPARSE:
            _, numel, _ = UNITS[u]
            k = k_for(numel, DENSITY)
            total = torch.zeros(numel)
            for r in by_size[2]:
                local = _local_set(*r["steps"][step]["payload"][u], k)  # more than k: cut to k first
                total += _dense(local, numel)
            ties = u == 2  # sums of +-1: many equal magnitudes, so compare magnitudes only
            best = torch.topk(total.abs(), k).values
            mean = by_size[2][0]["steps"][step]["mean"][u]
            assert torch.equal((mean * 2).abs().sort(descending=True).values[:k], best)
            if not ties:
                expected = torch.zeros(numel)
                top = torch.topk(total.abs(), k).indices
                expected[top] = total[top]
                assert torch.equal(mean * 2, expected)


@pytest.mark.parametrize("size", [2, 3, 5, 8])
def test_error_feedback_keeps_exactly_what_did_not_reach_the_result(by_size: dict, size: int) -> None:
    results = by_size[size]
    for step in range(STEPS):
        for u in SPARSE:
            total_sent = torch.zeros(UNITS[u][1])
            for r in results:
                s = r["steps"][step]
                acc, sent, residual = s["acc"][u], s["sent"][u], s["residual"][u]
                assert torch.equal(sent + residual, acc)
                assert torch.equal(sent[sent != 0], acc[sent != 0])
                total_sent += sent
            # what the ranks report as sent is exactly what the result is made of (up to summation order)
            torch.testing.assert_close(total_sent, results[0]["steps"][step]["mean"][u] * size, rtol=1e-6, atol=1e-6)


def test_an_entry_dropped_on_the_way_stays_in_the_residual(by_size: dict) -> None:
    outcome = [r["dropped"] for r in by_size[4]]
    for r in outcome:
        assert torch.equal(r["mean"], torch.tensor([0.75, 0, 0, 0]))  # index 0 won, carried by ranks 2 and 3
    # rank 0 selected index 0 too, but its 1.0 was dropped when merged with rank 1: it was not sent
    assert torch.equal(outcome[0]["sent"], torch.zeros(4))
    assert torch.equal(outcome[0]["residual"], torch.tensor([1.0, 0, 0, 0]))
    assert torch.equal(outcome[2]["sent"], torch.tensor([3.0, 0, 0, 0]))
    assert torch.equal(outcome[1]["residual"], torch.tensor([0, 2.0, 0, 0]))


def test_what_survived_the_merges_vouches_for_the_tensor_as_the_payload_did(by_size: dict) -> None:
    rank0, rank1 = (r["vouching"] for r in by_size[2])
    assert rank0["vouches"] == rank1["vouches"] == [True, False]  # Top-k's set vouches, a threshold's does not
    # rank 1's NaN outranked every finite entry and reached the mean; rank 0's survivors are finite, and so was its
    # tensor, which is what its whole set reports
    assert rank0["mean_finite"][0] is False and rank1["mean_finite"][0] is False
    assert rank0["finite"] == [True, True] and rank0["survivors_finite"] == [True, True]
    assert rank1["finite"][0] is False  # rank 1's whole set holds its NaN
    # the threshold's survivors are finite although rank 1's tensor is not: why its set does not vouch
    assert rank1["finite"][1] is True and not rank1["x"].isfinite().all()


@pytest.mark.parametrize("vouches", [True, False])
def test_a_survivor_set_that_vouches_settles_without_reading_the_tensor(
    monkeypatch: pytest.MonkeyPatch, vouches: bool
) -> None:
    import lightning_gradcomp.core.memory as memory_module

    reads: list[int] = []
    read = memory_module.finiteness
    monkeypatch.setattr(memory_module, "finiteness", lambda t: reads.append(t.numel()) or read(t))
    x = torch.randn(1000, generator=torch.Generator().manual_seed(3))
    payload = TopKCompressor(DENSITY).compress(x)
    survivors = SparseEntries(
        payload.indices[::2],
        payload.values[::2],
        x.numel(),
        vouches_finite=vouches,
        finite_of=payload.values if vouches else None,
    )
    memory = ErrorFeedback()
    memory.settle_("w", x.clone(), survivors, unit_numel=x.numel())
    assert torch.equal(memory.residual("w") + survivors.to_dense(), x)
    assert torch.equal(memory.residual("w")[payload.indices[1::2]], x[payload.indices[1::2]])  # dropped: kept
    assert reads == ([] if vouches else [x.numel()])  # without vouching, the whole tensor is summed


def _unit_bytes(flags: bool = False) -> int:
    """Per sparse unit: an int64 count, the indices in the format of k of them, k float32 values (and k flags)."""
    return sum(
        8 + encoded_nbytes(numel, k_for(numel, DENSITY)) + k_for(numel, DENSITY) * (4 + int(flags))
        for _, numel, kind in UNITS
        if kind != "dense"
    )


@pytest.mark.parametrize("size", SIZES)
def test_bytes_and_messages_per_rank_grow_like_log2_of_world_size(by_size: dict, size: int) -> None:
    base = 1 << int(math.log2(size))
    rounds = int(math.log2(base))
    dense = 4 * 37  # the dense unit: one allreduce of its own
    message, flagged = _unit_bytes(), _unit_bytes(flags=True)
    for rank, r in enumerate(by_size[size]):
        for s in r["steps"]:
            if rank >= base:  # folded: send the set, receive the result with its survivor flags
                expected = (dense + message, dense + flagged, 1 + 2)
            elif rank + base < size:  # receive the folded set, the butterfly, send back the result
                expected = (dense + (rounds * message) + flagged, dense + message + rounds * message, 1 + rounds + 2)
            else:
                expected = (dense + rounds * message, dense + rounds * message, 1 + rounds)
            assert s["counts"] == expected, (rank, s["counts"], expected)


def test_allgather_sums_sparse_payloads_of_different_sizes(by_size: dict) -> None:
    codec = Threshold(0.002)
    for size in (3, 5):
        results = [r["allgather"] for r in by_size[size]]
        assert len({r["k"] for r in results}) > 1, [r["k"] for r in results]
        total = torch.zeros(20000)
        for r in results:
            codec.accumulate(codec.compress(r["x"]), total)
        for r in results:
            assert torch.equal(r["mean"], total / size)


def test_gtopk_rejects_compressors_without_sparse_payloads_or_density(by_size: dict) -> None:
    for r in by_size[2]:
        not_sparse, no_density = r["errors"]
        assert "not sparse" in not_sparse and "_NotSparse" in not_sparse
        assert "density" in no_density and "None" in no_density


def test_hook_under_ddp_keeps_ranks_in_sync_with_gtopk(by_size: dict) -> None:
    runs = [r["ddp"] for r in by_size[3]]
    for name, value in runs[0]["weights"].items():
        for r in runs[1:]:
            assert torch.equal(r["weights"][name], value), name
    for r in runs:
        assert r["residuals"], "the compressed path never ran"
        compressed = [s for s in r["history"] if s.compressed]
        assert len(compressed) == 4
        assert all(0 < s.bytes_sent < s.dense_bytes for s in compressed)


MNIST_STEPS = 750  # 6 epochs of the 8,000 training images on 2 ranks
MNIST_SCHEDULE = {"lr_milestones": [4], "lr_gamma": 0.1}


def test_mnist_with_gtopk_is_within_one_point_of_dense(mnist_fit: Callable[..., dict]) -> None:
    dense = mnist_fit({"compressor": "none", "memory": "none"}, steps=MNIST_STEPS, model_kwargs=MNIST_SCHEDULE)
    gtopk = mnist_fit(
        {"compressor": "topk", "density": 0.01, "aggregator": "gtopk", "granularity": "group"},
        steps=MNIST_STEPS,
        model_kwargs=MNIST_SCHEDULE,
    )
    print(f"MNIST LeNet-5, 2 ranks, {MNIST_STEPS} steps, seed 0: dense {dense['val_acc']:.4f}, gtopk (density 0.01) "
          f"{gtopk['val_acc']:.4f}, bytes/step {gtopk['bytes_sent']:.0f} vs {gtopk['dense_bytes']:.0f}")  # fmt: skip
    assert gtopk["val_acc"] >= dense["val_acc"] - 0.01
    assert gtopk["bytes_sent"] < gtopk["dense_bytes"] / 10
