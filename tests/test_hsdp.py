"""Compressed HSDP on FSDP2 (:class:`~lightning_gradcomp.hsdp.ReplicaExchange`), 4 gloo processes as 2 replicas x 2
shards: the identity compressor gives FSDP2's own HSDP bit for bit; Top-k with error feedback leaves every replica with
the same shards after every step and sends fewer bytes between replicas than the dense exchange; a run stopped and
restored from each rank's shards (weights, the exchange's state) ends where the straight run does, random compressor
included; bad arguments are ``ValueError``\\s naming them."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from ranks import run_ranks
from torch import nn

from lightning_gradcomp.hsdp import ReplicaExchange

STEPS = 5


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 3))


def _mesh():
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))


def _sharded(mesh, native: bool) -> nn.Sequential:
    from torch.distributed.fsdp import fully_shard

    model = _model()
    on = mesh if native else mesh["shard"]  # native HSDP: the 2-D mesh; ours: the shard dimension, our hook between
    for layer in (model[0], model[2], model[4]):
        fully_shard(layer, mesh=on)
    fully_shard(model, mesh=on)
    return model


def _train(model: nn.Module, rank: int, steps: range) -> list[dict[str, torch.Tensor]]:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    after = []
    for step in steps:
        x = torch.randn(8, 8, generator=torch.Generator().manual_seed(100 * rank + step))
        optimizer.zero_grad()
        model(x).pow(2).mean().backward()
        optimizer.step()
        after.append({name: p.full_tensor().detach().clone() for name, p in model.named_parameters()})
    return after


def _runs(rank: int, world_size: int) -> dict[str, Any]:
    mesh = _mesh()
    native = _train(_sharded(mesh, native=True), rank, range(STEPS))
    model = _sharded(mesh, native=False)
    identity = ReplicaExchange(model, mesh, compressor="none", memory="none", aggregator="allreduce")
    ours = _train(model, rank, range(STEPS))
    model = _sharded(mesh, native=False)
    topk = ReplicaExchange(model, mesh, compressor="topk", density=0.1, memory="ef", aggregator="allgather")
    sparse = _train(model, rank, range(STEPS))
    return {
        "native": native,
        "identity": ours,
        "identity_units": sorted({s.step for s in identity.history}),
        "topk": sparse,
        "bytes": [(s.bytes_sent, s.dense_bytes, s.collectives) for s in topk.history],
    }


def test_the_identity_is_fsdp2s_own_hsdp_and_top_k_keeps_every_replica_alike_with_fewer_bytes() -> None:
    ranks = run_ranks(_runs, 4)
    for rank in ranks:
        assert rank["identity_units"] == list(range(STEPS))
        for step in range(STEPS):
            for name, value in rank["native"][step].items():
                # two replicas: a sum of two in any order is exact, and both pre-divide by 2 (a power of two)
                assert torch.equal(rank["identity"][step][name], value), (step, name)
                assert torch.equal(rank["topk"][step][name], ranks[0]["topk"][step][name]), (step, name)
        assert not torch.equal(rank["topk"][-1]["0.weight"], rank["native"][-1]["0.weight"])  # it compressed
        assert len(rank["bytes"]) == 3 * STEPS  # one record per unit and step, one collective each
        assert all(0 < sent < dense and calls == 1 for sent, dense, calls in rank["bytes"])


def _checkpointed(rank: int, world_size: int) -> dict[str, Any]:
    mesh = _mesh()
    arguments = {"compressor": "randomk", "compressor_kwargs": {"scaled": False}, "density": 0.2, "memory": "ef"}
    model = _sharded(mesh, native=False)
    ReplicaExchange(model, mesh, **arguments)
    straight = _train(model, rank, range(STEPS))[-1]
    model = _sharded(mesh, native=False)
    exchange = ReplicaExchange(model, mesh, **arguments)
    _train(model, rank, range(3))
    # each rank's own shards: its slice of every parameter, and its exchange's state
    saved = {
        "weights": {n: p.to_local().clone() for n, p in model.named_parameters()},
        "exchange": exchange.state_dict(),
    }
    model = _sharded(mesh, native=False)
    exchange = ReplicaExchange(model, mesh, **arguments)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.to_local().copy_(saved["weights"][name])
    exchange.load_state_dict(saved["exchange"])
    resumed = _train(model, rank, range(3, STEPS))[-1]
    return {"straight": straight, "resumed": resumed, "residuals": len(saved["exchange"]["memory"])}


def test_a_run_restored_from_each_ranks_shards_ends_where_the_straight_run_does() -> None:
    for rank in run_ranks(_checkpointed, 4):
        assert rank["residuals"] == 3  # one per unit: this rank's shard of it
        for name, value in rank["straight"].items():
            assert torch.equal(value, rank["resumed"][name]), name


def _refusals(rank: int, world_size: int) -> list[str]:
    mesh = _mesh()
    model = _sharded(mesh, native=False)
    messages = []
    for arguments in (
        {"compressor": "powersgd", "aggregator": "allreduce"},
        {"compressor": "qsgd", "aggregator": "gtopk"},
        {"compressor": "topk", "memory": "diana"},
    ):
        try:
            ReplicaExchange(model, mesh, **arguments)
        except ValueError as error:
            messages.append(str(error))
    for bad_mesh, bad_model in ((mesh["shard"], model), (mesh, _model()), (mesh, _sharded(mesh, native=True))):
        try:
            ReplicaExchange(bad_model, bad_mesh)
        except ValueError as error:
            messages.append(str(error))
    exchange = ReplicaExchange(model, mesh)
    try:
        exchange.load_state_dict({"steps": {"_orig_mod.0#shard0": 1}, "memory": {}})
    except ValueError as error:
        messages.append(str(error))
    dist.barrier()
    return messages


def test_bad_arguments_are_value_errors_naming_them() -> None:
    messages = run_ranks(_refusals, 4)[0]
    assert len(messages) == 7
    assert "needs each tensor's own shape and a warm start" in messages[0]
    assert "aggregator='gtopk' merges sparse payloads" in messages[1]
    assert "memory='diana' needs a compressor that is unbiased" in messages[2]
    assert "mesh must be a 2-D device mesh with dimensions 'replicate' and 'shard'" in messages[3]
    assert "module holds no FSDP unit" in messages[4]
    assert "were sharded over the 2-D mesh (FSDP2's own HSDP" in messages[5]
    assert "the saved replica exchange has units ['_orig_mod.0#shard0'], which this model lacks" in messages[6]


def test_history_is_checked_before_anything_else() -> None:
    with pytest.raises(ValueError, match="history"):
        ReplicaExchange(nn.Linear(2, 2), None, history=0)  # type: ignore[arg-type]
