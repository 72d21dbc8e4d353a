"""The hook under torch's own DDP on real gloo ranks: error-feedback bookkeeping, k, dense equivalence."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from models import teacher_task
from ranks import EveryRank, run_cases
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from lightning_gradcomp.core.compressors import IdentityCompressor, SparseEntries, TopKCompressor
from lightning_gradcomp.core.compressors.topk import k_for
from lightning_gradcomp.core.memory import ErrorFeedback, NoMemory
from lightning_gradcomp.core.schedule import DensityWarmup
from lightning_gradcomp.core.stats import StepStats, bytes_per_compressed_step
from lightning_gradcomp.ddp.hook import GradCompHook, gradcomp_comm_hook

STEPS = 5


class RecordingErrorFeedback(ErrorFeedback):
    """Error feedback that keeps a copy of every quantity it sees, for the invariants below."""

    def __init__(self) -> None:
        super().__init__()
        self.log: list[dict] = []

    def compensate_(self, name: str, x: torch.Tensor) -> torch.Tensor:
        old, grad = self.residual(name), x.clone()
        acc = super().compensate_(name, x)
        self.log.append({"name": name, "grad": grad, "old": None if old is None else old.clone(), "acc": acc.clone()})
        return acc

    def settle_(self, name: str, compensated: torch.Tensor, sent: SparseEntries, unit_numel: int, finite=True) -> None:
        assert isinstance(sent, SparseEntries)  # a sparse payload's entries: one scatter, no dense subtraction
        super().settle_(name, compensated, sent, unit_numel, finite)
        entry = next(e for e in reversed(self.log) if e["name"] == name)
        entry.update(sent=sent.to_dense(), new=self.residual(name).clone(), compensated=compensated.clone())


class CountingTopK(TopKCompressor):
    def __init__(self, density: float) -> None:
        super().__init__(density)
        self.counts: list[tuple[int, int]] = []

    def compress(self, x: torch.Tensor, generator: torch.Generator | None = None, scale: torch.Tensor | None = None):
        payload = super().compress(x, generator, scale)
        self.counts.append((x.numel(), payload.k))
        return payload


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))


HookFactory = Callable[[nn.Module], GradCompHook]


def _train(
    rank: int,
    world_size: int,
    make_hook: HookFactory | None,
    bucket_cap_mb: float = 0.001,
    after_step: Callable[[int, GradCompHook], None] | None = None,
    comm_hook: Callable = gradcomp_comm_hook,
    build: Callable[[], nn.Module] | None = None,
) -> tuple[nn.Module, GradCompHook | None]:
    model = _model() if build is None else build()
    ddp = DistributedDataParallel(model, bucket_cap_mb=bucket_cap_mb)
    hook = None if make_hook is None else make_hook(model)
    if hook is not None:
        ddp.register_comm_hook(hook, comm_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    data = teacher_task(n=16 * world_size * STEPS)
    for step in range(STEPS):
        lo = (step * world_size + rank) * 16
        x, y = data.tensors[0][lo : lo + 16], data.tensors[1][lo : lo + 16]
        optimizer.zero_grad()
        nn.functional.cross_entropy(ddp(x), y).backward()
        optimizer.step()
        if after_step is not None:
            after_step(step, hook)
    return model, hook


def _make_hook(compressor, memory, granularity: str, aggregator: str = "allgather", warmup: int = 0) -> HookFactory:
    return lambda model: GradCompHook(
        compressor,
        memory,
        aggregator,
        list(model.named_parameters()),
        granularity=granularity,
        warmup_steps=warmup,
        min_compress_numel=100,
    )


def _ef_bookkeeping(rank: int, world_size: int, granularity: str) -> dict:
    memory, compressor = RecordingErrorFeedback(), CountingTopK(0.05)
    _, hook = _train(rank, world_size, _make_hook(compressor, memory, granularity, warmup=1))
    return {"log": memory.log, "counts": compressor.counts, "history": list(hook.history), "buckets": hook.calls}


@pytest.mark.parametrize(("world_size", "granularity"), [(2, "layer"), (3, "layer"), (3, "model")])
def test_error_feedback_sent_plus_residual_is_grad_plus_old_residual(
    world_size: int, granularity: str, every_rank: EveryRank
) -> None:
    for r in every_rank(world_size, f"ef/{granularity}"):
        assert r["log"], "the compressed path never ran"
        names = {e["name"] for e in r["log"]}
        assert names == {"0.weight", "2.weight"}  # biases (64, 4 elements) stay dense
        for e in r["log"]:
            old = torch.zeros_like(e["grad"]) if e["old"] is None else e["old"]
            assert torch.equal(e["acc"], e["grad"] + old)
            assert torch.equal(e["sent"] + e["new"], e["grad"] + old)
        for numel, k in r["counts"]:
            assert k == k_for(numel, 0.05)
        if granularity == "model":
            assert all(numel == 2304 for numel, _ in r["counts"])  # one unit: both weights, whatever the buckets
        history = r["history"]
        assert len(history) == STEPS and not history[0].compressed and all(s.compressed for s in history[1:])
        assert history[0].warmup and not any(s.warmup for s in history[1:])
        assert history[-1].buckets == 2  # rebuilt buckets (1296 and 8192 bytes): each went through the hook
        for s in history[1:]:
            assert s.numel_compressed == 2048 + 256
            assert s.bytes_sent < s.dense_bytes / 3


def _density_one_vs_dense(rank: int, world_size: int) -> dict:
    plain, _ = _train(rank, world_size, None)
    full, _ = _train(rank, world_size, _make_hook(TopKCompressor(1.0), ErrorFeedback(), "layer"))
    return {"plain": plain.state_dict(), "full": full.state_dict()}


@pytest.mark.parametrize("world_size", [2, 3])
def test_topk_at_density_one_trains_like_dense_ddp(world_size: int, every_rank: EveryRank) -> None:
    for r in every_rank(world_size, "density one"):
        for name, value in r["plain"].items():
            # same sums in another order (gathered then added vs ring allreduce): equal to rounding
            torch.testing.assert_close(r["full"][name], value, rtol=1e-5, atol=1e-6)


def _no_memory_topk(rank: int, world_size: int) -> dict:
    model, hook = _train(rank, world_size, _make_hook(TopKCompressor(0.1), NoMemory(), "layer", aggregator="allreduce"))
    return {"weights": model.state_dict(), "history": list(hook.history)}


def test_allreduce_aggregator_with_sparse_payloads_keeps_ranks_in_sync(every_rank: EveryRank) -> None:
    results = every_rank(2, "no memory")
    for name, value in results[0]["weights"].items():
        assert torch.equal(results[1]["weights"][name], value)
    for s in results[0]["history"]:
        assert s.bytes_sent == s.dense_bytes  # decompressed, then a dense allreduce: no bytes saved


def _captures(rank: int, world_size: int) -> dict:
    memory, compressor = ErrorFeedback(), TopKCompressor(0.05)
    make = _make_hook(compressor, memory, "model", warmup=1)

    def make_and_request(model: nn.Module) -> GradCompHook:
        hook = make(model)
        hook.track_layers = True
        hook.request_capture({"0.weight"})
        hook.request_capture({"2.weight"})  # requests add up
        return hook

    seen: dict[int, dict] = {}

    def record(step: int, hook: GradCompHook) -> None:
        if hook.last_step.captures:
            seen[step] = dict(hook.last_step.captures)

    _, hook = _train(rank, world_size, make_and_request, after_step=record)
    return {"history": list(hook.history), "norm": memory.norm(), "residuals": memory.state_dict(), "seen": seen}


def test_captures_layer_stats_and_memory_norm(every_rank: EveryRank) -> None:
    for r in every_rank(2, "captures"):
        assert list(r["seen"]) == [1]  # one-shot, at the first compressed step
        assert sorted(r["seen"][1]) == ["0.weight", "2.weight"]
        assert not any(s.captures for s in r["history"])  # later steps dropped it: no tensors kept
        c = r["seen"][1]["0.weight"]
        assert c.raw.shape == c.compensated.shape == c.compressed.shape == c.sent.shape == (2048,)
        assert torch.equal(c.compensated, c.raw)  # no residual yet at the first compressed step
        assert torch.equal(c.sent, c.compressed)  # allgather: the whole local payload reached the result
        nonzero = c.compressed != 0
        assert torch.equal(c.compressed[nonzero], c.compensated[nonzero])
        for s in r["history"][1:]:
            assert s.selected == sum(layer.selected for layer in s.layers.values())
            assert s.density == pytest.approx(s.selected / s.numel_compressed)
            assert sum(layer.numel for layer in s.layers.values()) == s.numel_compressed == 2304
        expected = torch.stack([v.norm() for v in r["residuals"].values()]).norm()
        assert r["norm"] == pytest.approx(float(expected))


def _overlap(rank: int, world_size: int) -> dict:
    calls: list[dict] = []
    futures: list[torch.futures.Future] = []

    def recording(state, bucket):  # unannotated: DDP checks a hook's annotations, which are strings here
        future = state(bucket)
        step = state.step - 1 if bucket.is_last() else state.step  # the last bucket ends the step
        calls.append({"step": step, "last": bucket.is_last(), "open": not future.done()})
        futures.append(future)
        return future

    def all_done(step: int, hook: GradCompHook) -> None:
        calls.append({"step": step, "all done after the step": all(f.done() for f in futures)})
        futures.clear()

    make = _make_hook(TopKCompressor(0.05), ErrorFeedback(), "layer", warmup=1)
    _train(rank, world_size, make, after_step=all_done, comm_hook=recording)
    return {"calls": calls}


def _density_warmup(rank: int, world_size: int) -> dict:
    compressor, warmup = CountingTopK(0.01), DensityWarmup(0.01, steps=3, start=0.5)

    def make(model: nn.Module) -> GradCompHook:
        named = list(model.named_parameters())
        return GradCompHook(compressor, ErrorFeedback(), "allgather", named, granularity="model",
                            warmup_steps=1, min_compress_numel=100, density_warmup=warmup)  # fmt: skip

    _, hook = _train(rank, world_size, make)
    return {"counts": compressor.counts, "history": list(hook.history)}


def _mixed_dtypes(rank: int, world_size: int) -> dict:
    """A unit of float32 and float64 parameters, which DDP buckets apart (so they never lie in one bucket), under
    the dense wire, Top-k and plain DDP."""

    def build() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), _ToDouble(), nn.Linear(64, 4).double())

    results = {"plain": _train(rank, world_size, None, build=build)[0].state_dict()}
    for label, compressor, memory in (
        ("none", IdentityCompressor(), NoMemory()),
        ("topk", TopKCompressor(0.5), ErrorFeedback()),
    ):
        # the compressed unit: the two weights, one of each dtype (the biases stay dense, below 100 elements)
        results[label] = _train(rank, world_size, _make_hook(compressor, memory, "model"), build=build)[0].state_dict()
    return results


class _ToDouble(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.double()


def _choosers_in_pieces(rank: int, world_size: int) -> dict:
    """Top-k's mean over the ranks that chose each index, decoded into the pieces of a unit across DDP's buckets
    and into one flat bucket."""
    weights = {}
    for label, cap in (("pieces", 0.001), ("one bucket", 100.0)):
        make = _make_hook(TopKCompressor(0.3), ErrorFeedback(), "model", aggregator="allgather_choosers")
        model, _ = _train(rank, world_size, make, bucket_cap_mb=cap)
        weights[label] = model.state_dict()
    return weights


def every_case(rank: int, world_size: int) -> dict:
    """Every workload below in one launch per world size (starting ranks costs seconds)."""
    cases = {
        "ef/layer": lambda r, w: _ef_bookkeeping(r, w, "layer"),
        "ef/model": lambda r, w: _ef_bookkeeping(r, w, "model"),
        "density one": _density_one_vs_dense,
        "no memory": _no_memory_topk,
        "captures": _captures,
        "overlap": _overlap,
        "density warmup": _density_warmup,
        "mixed dtypes": _mixed_dtypes,
        "choosers in pieces": _choosers_in_pieces,
    }
    return run_cases(rank, world_size, cases)


def test_a_unit_of_two_dtypes_is_copied_flat_and_averages_as_plain_ddp(every_rank: EveryRank) -> None:
    results = every_rank(2, "mixed dtypes")
    for r in results:
        for name, value in r["plain"].items():
            assert r["none"][name].dtype == value.dtype
            torch.testing.assert_close(r["none"][name], value, rtol=1e-6, atol=1e-7)
    for name, value in results[0]["topk"].items():
        assert torch.isfinite(value).all() and torch.equal(results[1]["topk"][name], value)


def test_the_choosers_mean_lands_in_pieces_as_in_one_bucket(every_rank: EveryRank) -> None:
    for r in every_rank(2, "choosers in pieces"):
        for name, value in r["one bucket"].items():
            assert torch.equal(r["pieces"][name], value), name


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_compressed_bucket_is_still_in_flight_when_the_hook_returns(world_size: int, every_rank: EveryRank) -> None:
    # a compressed bucket's collective runs on while the backward pass computes the next bucket:
    # its future stays open when the hook returns, and only the last bucket completes everything
    for result in every_rank(world_size, "overlap"):
        compressed = [c for c in result["calls"] if "open" in c and c["step"] >= 1]
        assert len({c["step"] for c in compressed}) == STEPS - 1
        assert all(c["open"] for c in compressed if not c["last"]) and any(not c["last"] for c in compressed)
        assert not any(c["open"] for c in compressed if c["last"])
        assert all(c["all done after the step"] for c in result["calls"] if "all done after the step" in c)


def test_density_warmup_sets_k_of_each_compressed_step_from_the_step_counter(every_rank: EveryRank) -> None:
    # one dense step, then densities 0.5, 0.5 * 0.02 ** (1/3), 0.5 * 0.02 ** (2/3), then the target 0.01
    densities = [0.5, 0.5 * 0.02 ** (1 / 3), 0.5 * 0.02 ** (2 / 3), 0.01]
    for result in every_rank(2, "density warmup"):
        numel = result["counts"][0][0]  # one unit: the whole model but the 4 biases
        assert numel == 32 * 64 + 64 * 4
        assert result["counts"] == [(numel, k_for(numel, d)) for d in densities]
        assert [s.selected for s in result["history"] if s.compressed] == [k_for(numel, d) for d in densities]


def test_bytes_per_compressed_step_leaves_the_dense_steps_out() -> None:
    history = [
        StepStats(step=0, compressed=False, bytes_sent=400, dense_bytes=400),
        StepStats(step=1, compressed=True, bytes_sent=30, dense_bytes=400),
        StepStats(step=2, compressed=True, bytes_sent=50, dense_bytes=400),
    ]
    assert bytes_per_compressed_step(history) == (40.0, 400.0)
    assert bytes_per_compressed_step(history[:1]) is None
