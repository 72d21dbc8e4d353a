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
    for messages in run_ranks(_refusals, 4):
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


def _nonfinite_steps(rank: int, world_size: int) -> list[dict[str, Any]]:
    """A finite step, a step with a NaN in rank 0's input, one with rank 3's loss times infinity (neither taken by the
    optimizer, as a loss scaler skips them), then a finite step: what each moved of this rank's memory."""
    mesh = _mesh()
    model = _sharded(mesh, native=False)
    exchange = ReplicaExchange(model, mesh, compressor="topk", density=0.1, memory="ef")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    outcomes = []
    for step, poison in enumerate((None, "nan", "inf", None)):
        before = {k: v.clone() for k, v in exchange.memory.state_dict().items()}
        x = torch.randn(8, 8, generator=torch.Generator().manual_seed(100 * rank + step))
        if poison == "nan" and rank == 0:
            x[0, 0] = float("nan")
        optimizer.zero_grad()
        loss = model(x).pow(2).mean()
        (loss * float("inf") if poison == "inf" and rank == 3 else loss).backward()
        if poison is None:
            optimizer.step()
        after = exchange.memory.state_dict()
        outcomes.append({
            "moved": sum(name not in before or not torch.equal(before[name], t) for name, t in after.items()),
            "nonfinite_units": exchange.last_step.nonfinite_units,
        })  # fmt: skip
    return outcomes


def test_a_nan_or_inf_gradient_shard_leaves_every_replicas_memory_as_it_was_and_is_counted() -> None:
    """Catches: an average taken as finite whatever it holds (the replica with finite shards would move its residuals
    by a step never taken), and the units not counted as non-finite."""
    for outcomes in run_ranks(_nonfinite_steps, 4):
        assert [o["moved"] for o in outcomes] == [3, 0, 0, 3]  # every unit's residual, then none, then every one
        assert [o["nonfinite_units"] for o in outcomes] == [0, 3, 3, 0]


def _restores(rank: int, world_size: int, folder: str) -> dict[str, str]:
    """Each rank's exchange state written beside a checkpoint, then read back with rank 1's shard missing, and with
    rank 2's naming a unit this model lacks; and the strategy's refusal of a parameter in no FSDP unit."""
    from pathlib import Path

    from torch.distributed.fsdp import fully_shard

    from lightning_gradcomp.core.checkpoint import read_shard, shard_path, write_shard
    from lightning_gradcomp.hsdp.settings import HSDPSettings

    settings = HSDPSettings(density=0.1)
    mesh = settings.build_mesh("cpu", world_size, 2)
    model = _sharded(mesh, native=False)
    settings.install_exchange(model, mesh)
    _train(model, rank, range(2))
    outcomes = {}
    for case in ("intact", "missing", "foreign unit"):
        path = Path(folder) / f"{case}.ckpt"
        saved = settings.write_hsdp_shard(path, rank, world_size)
        if case == "missing" and rank == 1:
            Path(shard_path(path, rank, world_size)).unlink()
        if case == "foreign unit" and rank == 2:
            shard = read_shard(path, rank, saved)
            shard["exchange"]["steps"]["_orig_mod.0#shard0"] = 1
            write_shard(path, rank, world_size, shard)
        dist.barrier()
        try:
            settings.read_hsdp_shard(path, rank, world_size, saved)
            outcomes[case] = ""
        except ValueError as error:  # ShardError for the missing one
            outcomes[case] = f"{type(error).__name__}: {error}"
    partly = _model()
    fully_shard(partly[0], mesh=mesh["shard"])
    try:
        settings.shard(partly, mesh, lightning_module=False)
    except ValueError as error:
        outcomes["in no unit"] = str(error)
    return outcomes


def test_a_shard_missing_or_refused_on_one_rank_is_refused_on_every_rank(tmp_path) -> None:
    """Catches: the ranks whose own shard is fine going on alone to the next collective (the others wait there until
    the process group's timeout) when one rank's shard is missing or names units this model lacks."""
    for outcomes in run_ranks(_restores, 4, str(tmp_path)):
        assert outcomes["intact"] == ""
        assert outcomes["missing"].startswith("ShardError: the compression state of rank 1 is missing")
        assert outcomes["foreign unit"] == (
            "ValueError: the saved replica exchange has units ['_orig_mod.0#shard0'], which this model lacks: "
            "['0#shard0', '2#shard0', '4#shard0', '<root>#shard0'] (on rank 2)"
        )
        assert outcomes["in no unit"].startswith("parameters ['2.weight', '2.bias', '4.weight', '4.bias'] are in no")
