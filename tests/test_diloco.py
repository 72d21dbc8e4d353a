"""DiLoCo's synchronisation (:class:`~lightning_gradcomp.diloco.OuterSync`) on real ranks.

Each rank trains its own copy with AdamW on its own data and synchronises every ``H`` inner steps. The weights
after three synchronisations equal a reference written in plain torch (every rank simulated in one process: the
pseudo-gradients summed in rank order, divided by the number of ranks, the outer Nesterov step from the last
synchronisation's weights) bit for bit on 2 ranks, and within the last bits of gloo's summation order on 3, every
rank holding the same weights bit for bit; inner steps issue no collective; a run stopped between two
synchronisations and restored from its state ends where the straight run does; where torchft is installed (the
``test`` extra), its own DiLoCo on the same seeds, data and hyper-parameters ends with the same weights bit for
bit. Bad arguments are ``ValueError``\\s naming them.
"""

from __future__ import annotations

import importlib.util
import multiprocessing
import os
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from ranks import run_ranks
from torch import nn

from lightning_gradcomp.diloco import OuterSync

H = 5
SYNCS = 3
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "broadcast", "reduce_scatter", "all_to_all")


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * (rank + 1) + step)
    x = torch.randn(16, 8, generator=generator)
    return x, x[:, :2] * (rank + 1) + 0.1 * torch.randn(16, 2, generator=generator)


def _inner_step(model: nn.Module, inner: torch.optim.Optimizer, rank: int, step: int) -> None:
    x, y = _batch(rank, step)
    inner.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    inner.step()


def _train(rank: int, world_size: int, steps: int = H * SYNCS, stop_at: int | None = None) -> dict[str, Any]:
    model = _model()
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sync = OuterSync(model.named_parameters(), sync_every=H)
    counted = {name: 0 for name in COLLECTIVES}
    originals = {name: getattr(dist, name) for name in COLLECTIVES}

    def counting(name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            counted[name] += 1
            return originals[name](*args, **kwargs)

        return call

    at_syncs = 0
    for step in range(steps):
        if step == stop_at:  # a restart: fresh objects, the state put back
            state = {"model": model.state_dict(), "inner": inner.state_dict(), "sync": sync.state_dict()}
            model = _model()
            inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
            sync = OuterSync(model.named_parameters(), sync_every=H)
            model.load_state_dict(state["model"])
            inner.load_state_dict(state["inner"])
            sync.load_state_dict(state["sync"])
        for name in COLLECTIVES:  # every collective torch.distributed offers, counted through the whole step
            setattr(dist, name, counting(name))
        try:
            _inner_step(model, inner, rank, step)
            before = sum(counted.values())
            if sync.step():  # what a synchronisation sends is counted apart
                at_syncs += sum(counted.values()) - before
        finally:
            for name in COLLECTIVES:
                setattr(dist, name, originals[name])
    return {
        "weights": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "inner_collectives": sum(counted.values()) - at_syncs,
        "collectives_at_syncs": at_syncs,
        "sync_calls": sync.counter.calls,
        "bytes": sync.counter.bytes_sent,
    }


def _reference(world_size: int) -> dict[str, torch.Tensor]:
    """Every rank in one process, in plain torch: DiLoCo (Douillard et al., 2023, Algorithm 1) as written."""
    models = [_model() for _ in range(world_size)]
    inners = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in models]
    outers = [torch.optim.SGD(m.parameters(), lr=0.7, momentum=0.9, nesterov=True) for m in models]
    previous = [[p.detach().clone() for p in m.parameters()] for m in models]
    for step in range(H * SYNCS):
        for rank in range(world_size):
            _inner_step(models[rank], inners[rank], rank, step)
        if (step + 1) % H:
            continue
        with torch.no_grad():
            deltas = [
                [a - p for a, p in zip(previous[r], models[r].parameters(), strict=True)] for r in range(world_size)
            ]
            mean = [sum(deltas[r][i] for r in range(1, world_size)) for i in range(len(deltas[0]))]
            mean = [(deltas[0][i] + mean[i]) / world_size for i in range(len(mean))]
            for rank, model in enumerate(models):
                for p, a, g in zip(model.parameters(), previous[rank], mean, strict=True):
                    p.copy_(a)
                    p.grad = g.clone()
                outers[rank].step()
                outers[rank].zero_grad(set_to_none=True)
                previous[rank] = [p.detach().clone() for p in model.parameters()]
    return {k: v.detach().clone() for k, v in models[0].state_dict().items()}


@pytest.mark.parametrize("world_size", [2, 3])
def test_synchronisations_are_the_plain_torch_reference_and_inner_steps_exchange_nothing(world_size: int) -> None:
    ranks = run_ranks(_train, world_size)
    reference = _reference(world_size)
    for rank in ranks:
        assert rank["inner_collectives"] == 0 and rank["collectives_at_syncs"] == SYNCS  # one allreduce each
        assert rank["sync_calls"] == SYNCS  # one allreduce per synchronisation (one dtype), counted
        assert rank["bytes"] == SYNCS * sum(p.numel() for p in _model().parameters()) * 4
        for name, value in rank["weights"].items():
            assert torch.equal(value, ranks[0]["weights"][name]), name  # every rank alike, bit for bit
            if world_size == 2:
                assert torch.equal(value, reference[name]), name
            else:  # gloo sums three ranks in its own order: the last bits may differ
                torch.testing.assert_close(value, reference[name], rtol=1e-6, atol=1e-7)
    assert not torch.equal(ranks[0]["weights"]["0.weight"], _model().state_dict()["0.weight"])


def _straight_and_restored(rank: int, world_size: int) -> tuple[dict, dict]:
    return _train(rank, world_size), _train(rank, world_size, stop_at=H + 2)


def test_a_run_restored_between_two_synchronisations_ends_where_the_straight_run_does() -> None:
    for straight, restored in run_ranks(_straight_and_restored, 2):
        for name, value in straight["weights"].items():
            assert torch.equal(value, restored["weights"][name]), name


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"sync_every": 0}, "sync_every"),
        ({"sync_every": 2.5}, "sync_every"),
        ({"outer_lr": 0.0}, "outer_lr"),
        ({"outer_momentum": 1.0}, "outer_momentum"),
        ({"outer_momentum": 0.0}, "nesterov=True needs outer_momentum > 0"),
    ],
)
def test_bad_arguments_are_value_errors_naming_them(arguments: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        OuterSync(_model().named_parameters(), **{"sync_every": H, **arguments})
    with pytest.raises(ValueError, match="no trainable parameter"):
        OuterSync(_model().requires_grad_(False).named_parameters(), sync_every=H)


def _torchft_replica(replica: int, lighthouse: str, out: str) -> None:
    """One replica group of one process running torchft's DiLoCo on the same model, data and hyper-parameters."""
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    import torchft.manager
    from torchft.local_sgd import DiLoCo
    from torchft.process_group import ProcessGroupGloo

    server = torchft.manager.ManagerServer

    def on_loopback(*args: Any, bind: str, **kwargs: Any) -> Any:  # torchft binds every interface ("[::]:port")
        return server(*args, bind=f"127.0.0.1:{bind.rsplit(':', 1)[1]}", **kwargs)

    torchft.manager.ManagerServer = on_loopback
    model = _model()
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    timeout = timedelta(seconds=60)
    manager = torchft.manager.Manager(
        pg=ProcessGroupGloo(timeout=timeout),
        load_state_dict=model.load_state_dict,
        state_dict=model.state_dict,
        min_replica_size=2,
        use_async_quorum=False,
        timeout=timeout,
        quorum_timeout=timeout,
        connect_timeout=timeout,
        rank=0,
        world_size=1,
        store_addr="127.0.0.1",
        store_port=store.port,
        lighthouse_addr=lighthouse,
        replica_id=str(replica),
        hostname="127.0.0.1",
        init_sync=False,  # the same seeded start on both, as ours (True would copy replica 0's state to replica 1)
    )
    try:
        with DiLoCo(manager, [model], inner, outer, sync_every=H):
            for step in range(H * SYNCS):
                _inner_step(model, inner, replica, step)
        torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, Path(out) / f"{replica}.pt")
    finally:
        manager.shutdown(wait=False)


@pytest.mark.skipif(importlib.util.find_spec("torchft") is None, reason="needs torchft (the test extra)")
def test_the_dense_synchronisation_equals_torchfts_diloco_bit_for_bit(tmp_path: Path) -> None:
    from torchft._torchft import LighthouseServer

    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=2)
    address = f"http://127.0.0.1:{lighthouse.address().rsplit(':', 1)[1]}"
    context = multiprocessing.get_context("spawn")
    replicas = [context.Process(target=_torchft_replica, args=(r, address, str(tmp_path))) for r in range(2)]
    try:
        for process in replicas:
            process.start()
        for process in replicas:
            process.join(timeout=180)
    finally:
        for process in replicas:
            if process.is_alive():
                process.kill()
        lighthouse.shutdown()
    assert [process.exitcode for process in replicas] == [0, 0]
    theirs = [torch.load(tmp_path / f"{r}.pt", weights_only=True) for r in range(2)]
    ours = run_ranks(_train, 2)
    for rank in range(2):
        for name, value in ours[rank]["weights"].items():
            assert torch.equal(value, theirs[rank][name]), (rank, name)


def _different_starts(rank: int, world_size: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(rank)  # each rank initialised on its own: OuterSync starts every rank from rank 0's weights
    model = nn.Linear(4, 2)
    OuterSync(model.named_parameters(), sync_every=H)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_every_rank_starts_from_rank_zeros_weights_and_a_parameter_frozen_later_is_refused() -> None:
    first, second = run_ranks(_different_starts, 2)
    for name, value in first.items():
        assert torch.equal(value, second[name]), name
    torch.manual_seed(0)
    assert torch.equal(first["weight"], nn.Linear(4, 2).weight.detach())
    model = _model()
    sync = OuterSync(model.named_parameters(), sync_every=1)  # no process group: alone, the average is its own
    model[2].requires_grad_(False)
    with pytest.raises(RuntimeError, match=r"parameters \['2.bias', '2.weight'\] were frozen after OuterSync"):
        sync.step()
