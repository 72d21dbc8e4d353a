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
        "layers": [(s.step, sum(u.payload_bytes for u in s.layers.values()), s.payload_bytes) for s in topk.history],
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
        assert len(rank["bytes"]) == STEPS  # one record per step: its three units, one collective each
        assert all(0 < sent < dense and calls == 3 for sent, dense, calls in rank["bytes"])
        assert all(step == i and units == total for i, (step, units, total) in enumerate(rank["layers"]))


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
    from torch.distributed.fsdp import fully_shard

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
    whole = _model()
    fully_shard(whole)  # no mesh: over every rank, not the shard dimension
    for bad_mesh, bad_model in (
        (mesh["shard"], model),
        (mesh, _model()),
        (mesh, _sharded(mesh, native=True)),
        (mesh, whole),
    ):
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
    assert len(messages) == 8
    assert "needs each tensor's own shape and a warm start" in messages[0]
    assert "aggregator='gtopk' merges sparse payloads" in messages[1]
    assert "memory='diana' needs a compressor that is unbiased" in messages[2]
    assert "mesh must be a 2-D device mesh with dimensions 'replicate' and 'shard'" in messages[3]
    assert "module holds no FSDP unit" in messages[4]
    assert "were sharded over the 2-D mesh (FSDP2's own HSDP" in messages[5]
    assert "were sharded over other ranks than mesh['shard'] ([" in messages[6]
    assert "the saved replica exchange has units ['_orig_mod.0#shard0'], which this model lacks" in messages[7]


def test_history_is_checked_before_anything_else() -> None:
    with pytest.raises(ValueError, match="history"):
        ReplicaExchange(nn.Linear(2, 2), None, history=0)  # type: ignore[arg-type]


class _Twice(nn.Module):
    """One layer called twice in the forward (weights shared across depth)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.stem, self.shared, self.head = nn.Linear(8, 64), nn.Linear(64, 64), nn.Linear(64, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.shared(torch.tanh(self.shared(torch.tanh(self.stem(x)))))))


def _records_and_starts(rank: int, world_size: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = _mesh()
    model = _Twice()
    for unit in (model.stem, model.shared, model.head, model):
        fully_shard(unit, mesh=mesh["shard"])
    if rank >= 2:  # the second replica starts elsewhere: the exchange gives it the first replica's shards
        with torch.no_grad():
            for p in model.parameters():
                p.to_local().add_(1.0)
    exchange = ReplicaExchange(model, mesh, compressor="topk", density=0.1, memory="ef")
    started = {name: p.full_tensor().clone() for name, p in model.named_parameters()}
    _train(model, rank, range(STEPS))
    lone = init_device_mesh("cpu", (1, 4), mesh_dim_names=("replicate", "shard"))
    plain, alone = _model(), _model()
    for one in (plain, alone):
        for layer in (one[0], one[2], one[4], one):
            fully_shard(layer, mesh=lone["shard"])
    with pytest.warns(UserWarning, match="the mesh has one replica"):
        single = ReplicaExchange(alone, lone, compressor="topk", density=0.1, memory="ef")
    return {
        "started": started,
        "records": [(s.step, s.collectives, {k: v.numel for k, v in s.layers.items()}) for s in exchange.history],
        "shard_numel": {n: p.to_local().numel() for n, p in model.named_parameters()},
        "plain": _train(plain, rank, range(STEPS))[-1],
        "alone": _train(alone, rank, range(STEPS))[-1],
        "single": [(s.compressed, s.bytes_sent) for s in single.history],
    }


def test_replicas_start_alike_a_layer_called_twice_records_once_a_step_and_one_replica_exchanges_nothing() -> None:
    ranks = run_ranks(_records_and_starts, 4)
    for rank in ranks:
        for name, value in rank["started"].items():
            assert torch.equal(value, ranks[0]["started"][name]), name
        assert [step for step, *_ in rank["records"]] == list(range(STEPS))  # one record per backward pass
        for _, calls, layers in rank["records"]:
            assert calls == 3  # FSDP2 reduce-scatters the shared layer's two uses once: one exchange a unit
            shared = rank["shard_numel"]["shared.weight"] + rank["shard_numel"]["shared.bias"]
            assert [numel for name, numel in layers.items() if name.startswith("shared#")] == [shared]
        for name, value in rank["plain"].items():
            assert torch.equal(rank["alone"][name], value), name  # with one replica, FSDP2's own average
        assert rank["single"] == [(False, 0)] * STEPS
