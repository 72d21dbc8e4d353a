"""hierarchy="node": dense sums inside a node, compression between nodes, on real ranks (gloo, loopback).

Four ranks play two nodes of two (node ids given to :class:`NodeLayout` as a launcher would give
them); three ranks play two uneven nodes.
"""

from __future__ import annotations

import os
from functools import partial
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from models import ShuffledClassifier, TinyClassifier, teacher_task
from ranks import EveryRank, run_cases, run_ranks
from test_hook import STEPS, _train
from test_resume import BUCKET_CAP_MB, TIMEOUT, N, _outcome
from test_sign import _Recording
from torch.utils.data import DataLoader

from lightning_gradcomp import GradCompStrategy
from lightning_gradcomp.core.comm.hierarchy import NodeLayout, NodeTopology
from lightning_gradcomp.core.compressors import IdentityCompressor, TernGradCompressor, TopKCompressor
from lightning_gradcomp.core.memory import NoMemory
from lightning_gradcomp.ddp.hook import GradCompHook

COMPRESSED = ("0.weight", "2.weight")  # the model's biases (64 and 4 elements) stay dense
TWO_BY_TWO = (0, 0, 1, 1)  # node id of each rank
UNEVEN = (0, 0, 1)


def test_a_layout_splits_the_ranks_by_node_id() -> None:
    layout = NodeLayout.of(["b", "a", "b", "a", "c"])
    assert layout.nodes == ((0, 2), (1, 3), (4,))
    assert layout.slots == 1 and layout.world_size == 5
    assert layout.locate(3) == (1, 1) and layout.locate(4) == (2, 0)
    assert NodeLayout.of(TWO_BY_TWO).slots == 2
    for bad in ((), ((0, 1), ()), ((0, 2),), ((0, 1), (1, 2))):
        with pytest.raises(ValueError, match=r"must split ranks 0\.\.P-1 into non-empty groups"):
            NodeLayout(bad)


def _case(method: str, node_ids: tuple[int, ...], scheme: str, rank: int, world_size: int) -> dict:
    """Train STEPS steps; record each rank's local gradients (autograd hooks, before DDP sees them)."""
    memory = _Recording() if method in ("topk", "gtopk") else NoMemory()
    compressor = {
        "topk": lambda: TopKCompressor(0.05),
        "gtopk": lambda: TopKCompressor(0.05),
        "terngrad": lambda: TernGradCompressor(),
        "identity": IdentityCompressor,
    }[method]()
    aggregator = {"gtopk": "gtopk", "terngrad": "allreduce", "identity": "allreduce"}.get(method, "allgather")
    local: dict[str, list[torch.Tensor]] = {name: [] for name in COMPRESSED}

    def make_hook(model: torch.nn.Module) -> GradCompHook:
        for name, p in model.named_parameters():
            if name in local:
                p.register_hook(lambda g, name=name: local[name].append(g.detach().clone()))
        topology = None if scheme == "flat" else NodeTopology(NodeLayout.of(node_ids), scheme)
        named = list(model.named_parameters())
        return GradCompHook(compressor, memory, aggregator, named, warmup_steps=1, min_compress_numel=100,
                            topology=topology)  # fmt: skip

    model, hook = _train(rank, world_size, make_hook)
    return {
        "weights": model.state_dict(),
        "local": local,
        "log": getattr(memory, "log", []),
        "history": list(hook.history),
        "owned": [u.names for u in hook.units if hook.topology.owns(u.index)],
    }


SCHEMES = ("flat", "sharded", "leader")


def _grid(world_size: int) -> tuple[tuple[int, ...], list[tuple[str, str]]]:
    """The node ids and the (method, scheme) cases of one launch: every scheme on 2 x 2, the flat and the
    sharded one on the uneven 2 + 1."""
    if world_size == 4:
        return TWO_BY_TWO, [(m, s) for m in ("topk", "gtopk", "terngrad", "identity") for s in SCHEMES]
    return UNEVEN, [(m, s) for m in ("topk", "identity") for s in ("flat", "sharded")]


def every_case(rank: int, world_size: int) -> dict:
    node_ids, cases = _grid(world_size)
    return run_cases(rank, world_size, {case: partial(_case, case[0], node_ids, case[1]) for case in cases})


@pytest.mark.parametrize(
    ("world_size", "case"), [pytest.param(w, case, id=f"{w}-{'-'.join(case)}") for w in (4, 3) for case in _grid(w)[1]]
)
def test_every_rank_ends_bit_identical(world_size: int, case: tuple[str, str], every_rank: EveryRank) -> None:
    runs = every_rank(world_size, case)
    for run in runs[1:]:
        for name, value in run["weights"].items():
            assert torch.equal(value, runs[0]["weights"][name]), name


#: (world size, scheme, method) of every sparsified case whose owners compress: not flat, not TernGrad/dense
OWNED = [(w, s, m) for w in (4, 3) for m, s in _grid(w)[1] if m in ("topk", "gtopk") and s != "flat"]


@pytest.mark.parametrize(("world_size", "scheme", "method"), OWNED)
def test_owners_compress_their_nodes_weighted_sum_with_exact_error_feedback(
    world_size: int, scheme: str, method: str, every_rank: EveryRank
) -> None:
    layout = NodeLayout.of(_grid(world_size)[0])
    weight = len(layout.nodes) / world_size
    runs = every_rank(world_size, (method, scheme))
    owners: dict[str, list[int]] = {name: [] for name in COMPRESSED}
    for rank, run in enumerate(runs):
        logged = {e["name"] for e in run["log"]}
        assert logged == {n for names in run["owned"] for n in names if n in COMPRESSED}  # owners only
        node = layout.nodes[layout.locate(rank)[0]]
        for name in logged:
            owners[name].append(rank)
            entries = [e for e in run["log"] if e["name"] == name]
            assert len(entries) == STEPS - 1  # every compressed step
            for step, e in enumerate(entries, start=1):
                total = runs[node[0]]["local"][name][step]
                for other in node[1:]:
                    total = total + runs[other]["local"][name][step]
                node_sum = (total * weight).reshape(e["grad"].shape)
                assert torch.equal(e["grad"], node_sum), (method, name, step)  # the node's weighted sum
                old = torch.zeros_like(e["grad"]) if e["old"] is None else e["old"]
                assert torch.equal(e["acc"], e["grad"] + old)
                assert torch.equal(e["new"], e["acc"] - e["sent"])  # what was not sent, exactly
    for ranks in owners.values():  # one owner per node
        assert sorted(layout.locate(r)[0] for r in ranks) == list(range(len(layout.nodes)))


@pytest.mark.parametrize("world_size", [4, 3])
def test_dense_through_the_hierarchy_is_the_world_mean(world_size: int, every_rank: EveryRank) -> None:
    flat = every_rank(world_size, ("identity", "flat"))[0]["weights"]
    sharded = every_rank(world_size, ("identity", "sharded"))[0]
    assert all(s.bytes_sent_intra_node > 0 for s in sharded["history"][1:])
    for name, value in sharded["weights"].items():
        torch.testing.assert_close(value, flat[name], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("scheme", ["sharded", "leader"])
@pytest.mark.parametrize("method", ["topk", "gtopk", "terngrad"])
def test_fewer_bytes_cross_between_nodes_than_a_flat_exchange_sends(
    method: str, scheme: str, every_rank: EveryRank
) -> None:
    flat_runs, runs = every_rank(4, (method, "flat")), every_rank(4, (method, scheme))
    flat = sum(s.bytes_sent for r in flat_runs for s in r["history"][1:])
    inter = sum(s.bytes_sent for r in runs for s in r["history"][1:])
    intra = sum(s.bytes_sent_intra_node for r in runs for s in r["history"][1:])
    assert inter < flat, (inter, flat)
    assert intra > 0 and all(s.bytes_sent_intra_node == 0 for s in flat_runs[0]["history"])
    if scheme == "leader":  # local rank 1 of each node talks to no other node
        assert all(s.bytes_sent == 0 for r in (runs[1], runs[3]) for s in r["history"][1:])


def _trainer_on_nodes(rank: int, world_size: int, hierarchy: str, nodes: int) -> dict:
    """A Trainer on ``nodes`` emulated nodes: each rank's NODE_RANK and LOCAL_RANK as a launcher sets them."""
    per_node = world_size // nodes
    os.environ.update(NODE_RANK=str(rank // per_node), LOCAL_RANK=str(rank % per_node))
    pl.seed_everything(0, verbose=False)
    model = TinyClassifier()
    strategy = GradCompStrategy(compressor="topk", density=0.05, hierarchy=hierarchy, min_compress_numel=100)
    trainer = pl.Trainer(accelerator="cpu", devices=per_node, num_nodes=nodes, strategy=strategy, max_steps=6,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)  # fmt: skip
    trainer.fit(model, DataLoader(teacher_task(n=1024), batch_size=16))
    hook = strategy.gradcomp_hook
    return {
        "weights": model.state_dict(),
        "topology": hook.topology.describe(),
        "history": list(hook.history),
        "global_rank": trainer.global_rank,
    }


def check_two_by_two_run(results: list[dict]) -> None:
    """What every run of a Trainer on 2 nodes x 2 ranks with ``hierarchy="node"`` must show, whatever launched it."""
    assert {r["topology"] for r in results} == {"2 nodes (2/2 ranks), sharded, 2 owner(s) per node"}
    for r in results[1:]:
        for name, value in r["weights"].items():
            assert torch.equal(value, results[0]["weights"][name]), name
    compressed = [s for r in results for s in r["history"] if s.compressed]
    assert compressed and all(s.bytes_sent_intra_node > 0 for s in compressed)


def test_the_strategy_builds_the_node_topology_from_the_cluster_environment() -> None:
    results = run_ranks(_trainer_on_nodes, 4, "node", 2, init=False)
    assert [r["global_rank"] for r in results] == [0, 1, 2, 3]
    check_two_by_two_run(results)


def test_on_a_single_node_the_hierarchy_averages_densely() -> None:
    results = run_ranks(_trainer_on_nodes, 2, "node", 1, init=False)
    plain = run_ranks(_trainer_on_nodes, 2, "none", 1, init=False)
    assert results[0]["topology"] == "flat"
    assert all(not s.numel_compressed for r in results for s in r["history"])  # nothing compressed
    assert any(s.numel_compressed for s in plain[0]["history"])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"hierarchy": "rack"}, r"hierarchy must be one of \['none', 'node'\], got 'rack'"),
        ({"hierarchy_scheme": "ring"}, r"hierarchy_scheme must be one of \['sharded', 'leader'\], got 'ring'"),
    ],
)
def test_bad_hierarchy_arguments_name_themselves(kwargs: dict, message: str) -> None:

    with pytest.raises(ValueError, match=message):
        GradCompStrategy(**kwargs)


RESUME_CASES = {
    "topk": {"compressor": "topk", "density": 0.05, "memory": "ef"},
    "diana": {"compressor": "qsgd", "memory": "diana", "aggregator": "allgather"},
}


def _fit_on_nodes(case: str, steps: int, ckpt_path: str | None = None, callbacks: list | None = None) -> dict:
    """``fit`` of test_resume (a model whose DDP buckets change after the first step) on 2 nodes x 2 ranks."""
    pl.seed_everything(0, verbose=False)
    model = ShuffledClassifier()
    strategy = GradCompStrategy(hierarchy="node", min_compress_numel=100, timeout=TIMEOUT,
                                bucket_cap_mb=BUCKET_CAP_MB, **RESUME_CASES[case])  # fmt: skip
    trainer = pl.Trainer(accelerator="cpu", devices=2, num_nodes=2, strategy=strategy, max_steps=steps, logger=False,
                         enable_checkpointing=bool(callbacks), enable_progress_bar=False, enable_model_summary=False,
                         callbacks=callbacks)  # fmt: skip
    trainer.fit(model, DataLoader(teacher_task(n=N * 16 * 4), batch_size=16), ckpt_path=ckpt_path)
    return _outcome(model, strategy)


def _resume_on_nodes(rank: int, world_size: int, out: str, phase: str) -> dict:
    os.environ.update(NODE_RANK=str(rank // 2), LOCAL_RANK=str(rank % 2))
    results = {}
    for case in RESUME_CASES:
        if phase == "first":
            checkpoints = ModelCheckpoint(dirpath=Path(out) / case, filename="half", every_n_train_steps=N)
            results[case] = {"straight": _fit_on_nodes(case, 2 * N),
                             "stopped": _fit_on_nodes(case, N, callbacks=[checkpoints])}  # fmt: skip
        else:
            results[case] = _fit_on_nodes(case, 2 * N, ckpt_path=str(Path(out) / case / "half.ckpt"))
    return results


def test_a_resumed_hierarchical_run_is_the_run_that_never_stopped(tmp_path: Path) -> None:
    first = run_ranks(_resume_on_nodes, 4, str(tmp_path), "first", init=False, timeout=400)
    resumed = run_ranks(_resume_on_nodes, 4, str(tmp_path), "resumed", init=False, timeout=400)
    for case in RESUME_CASES:
        kept = [set(first[rank][case]["straight"]["memory"]) for rank in range(4)]
        assert kept[0] and kept[1] and not kept[0] & kept[1]  # the node's two ranks own different units
        assert kept[0] == kept[2] and kept[1] == kept[3]  # the same local rank owns the same units on each node
        for rank in range(4):
            straight, again = first[rank][case]["straight"], resumed[rank][case]
            assert straight["buckets"][0] == 1 and straight["buckets"][N] > 1 and again["buckets"][0] == 1
            assert straight["step"] == again["step"] == 2 * N
            assert straight["memory"].keys() == again["memory"].keys(), (case, rank)
            for name in straight["memory"]:
                assert torch.equal(straight["memory"][name], again["memory"][name]), (case, rank, name)
            for name, value in straight["weights"].items():
                assert torch.equal(value, again["weights"][name]), (case, rank, name)
                assert torch.equal(value, first[0][case]["straight"]["weights"][name]), (case, rank, name)
