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

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from models import quiet_trainer
from ranks import run_ranks
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import lightning_gradcomp.core.comm.collectives as collectives_module
from lightning_gradcomp.diloco import GradCompDiLoCoStrategy, OuterSync

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
    model = _model()
    model[0].requires_grad_(False)
    sync = OuterSync(model.named_parameters(), sync_every=1)
    model[0].requires_grad_(True)  # gradual unfreezing: those would train apart on every rank, never averaged
    with pytest.raises(RuntimeError, match=r"parameters \['0.bias', '0.weight'\] were unfrozen after OuterSync"):
        sync.step()


class Regression(pl.LightningModule):
    """The same model and inner AdamW under the Trainer."""

    def __init__(self) -> None:
        super().__init__()
        self.net = _model()

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


EPOCH = 4  # optimizer steps per epoch on each rank: a checkpoint at its end falls between two synchronisations
LIGHTNING_H = 3


def _data(world_size: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(16 * EPOCH * world_size, 8, generator=generator)
    return TensorDataset(x, x[:, :2] * 2 + 0.1 * torch.randn(len(x), 2, generator=generator))


class CountCollectives(pl.Callback):
    """Every torch.distributed collective from the start to the end of each training batch (the strategy's part:
    Lightning's loop broadcasts its SIGTERM flag just before), the synchronisations' apart."""

    def __init__(self) -> None:
        self.inner = 0
        self.at_syncs = 0
        self._originals: dict[str, Any] = {}
        self._counted = 0

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self._counted, self._calls = 0, trainer.strategy.outer_sync.counter.calls
        self._originals = {name: getattr(dist, name) for name in COLLECTIVES}
        for name, original in self._originals.items():
            setattr(dist, name, self._counting(original))
        self._gather = collectives_module._all_gather_single  # bound at import: patched where it lives
        collectives_module._all_gather_single = self._counting(self._gather)

    def _counting(self, original: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            self._counted += 1
            return original(*args, **kwargs)

        return call

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        for name, original in self._originals.items():
            setattr(dist, name, original)
        collectives_module._all_gather_single = self._gather
        syncs = trainer.strategy.outer_sync.counter.calls - self._calls
        self.at_syncs += syncs
        self.inner += self._counted - syncs


def _fit(world_size: int, steps: int, **kwargs: Any) -> dict[str, Any]:
    pl.seed_everything(0, verbose=False)
    module = Regression()
    strategy = GradCompDiLoCoStrategy(sync_every=LIGHTNING_H)
    count = CountCollectives()
    trainer = quiet_trainer(strategy, world_size, steps, [count, *kwargs.pop("callbacks", [])])
    trainer.fit(module, DataLoader(_data(world_size), batch_size=16), **kwargs)
    return {
        "weights": {k: v.detach().clone() for k, v in module.state_dict().items()},
        "anchor": {k: v.clone() for k, v in strategy.outer_sync.anchor.items()},
        "outer": strategy.outer_sync.state_dict()["outer"],
        "inner_steps": strategy.outer_sync.inner_steps,
        "collectives": (count.inner, count.at_syncs),
    }


def _plain(rank: int, world_size: int, steps: int) -> dict[str, torch.Tensor]:
    """The same run in a plain torch loop: the same shard of the data in the same order, OuterSync."""
    pl.seed_everything(0, verbose=False)
    model = _model()
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sync = OuterSync(model.named_parameters(), sync_every=LIGHTNING_H)
    # the sampler Lightning puts in a training loader: shuffled from the global seed, reshuffled every epoch
    sampler = DistributedSampler(_data(world_size), num_replicas=world_size, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(_data(world_size), batch_size=16, sampler=sampler)
    batches = []
    for epoch in range(steps // EPOCH):
        sampler.set_epoch(epoch)
        batches += list(loader)
    for x, y in batches:
        inner.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        inner.step()
        sync.step()
    return {f"net.{k}": v.detach().clone() for k, v in model.state_dict().items()}


def _lightning_runs(rank: int, world_size: int, out: str) -> dict[str, Any]:
    checkpoint = ModelCheckpoint(dirpath=out, filename="half", every_n_train_steps=EPOCH, save_top_k=-1)
    return {
        "straight": _fit(world_size, 2 * EPOCH),
        "stopped": _fit(world_size, EPOCH, callbacks=[checkpoint]),
    }


def _lightning_resumed(rank: int, world_size: int, out: str) -> dict[str, Any]:
    resumed = _fit(world_size, 2 * EPOCH, ckpt_path=str(Path(out) / "half.ckpt"))
    torch.distributed.barrier()
    return {"resumed": resumed, "plain": _plain(rank, world_size, 2 * EPOCH)}


@pytest.mark.parametrize("world_size", [2, 3])
def test_the_trainer_strategy_is_the_plain_loop_and_resumes_between_synchronisations(
    world_size: int, tmp_path: Path
) -> None:
    first = run_ranks(_lightning_runs, world_size, str(tmp_path), init=False)
    again = run_ranks(_lightning_resumed, world_size, str(tmp_path), init=False)
    syncs = 2 * EPOCH // LIGHTNING_H
    for rank in range(world_size):
        straight, resumed, plain = first[rank]["straight"], again[rank]["resumed"], again[rank]["plain"]
        assert straight["collectives"] == (0, syncs)  # inner steps exchange nothing; one allreduce per sync
        assert first[rank]["stopped"]["inner_steps"] == EPOCH and resumed["inner_steps"] == 2 * EPOCH
        for name, value in straight["weights"].items():
            assert torch.equal(value, plain[name]), (rank, name)  # the Trainer adds nothing to the algorithm
            assert torch.equal(value, resumed["weights"][name]), (rank, name)  # this rank's own weights came back
        for name, value in straight["anchor"].items():
            assert torch.equal(value, resumed["anchor"][name]), (rank, name)
            assert torch.equal(value, first[0]["straight"]["anchor"][name]), (rank, name)  # theta_prev: shared
    # after the last synchronisation the ranks trained on alone: their weights differ, as in DiLoCo
    assert not torch.equal(
        first[0]["straight"]["weights"]["net.0.weight"], first[1]["straight"]["weights"]["net.0.weight"]
    )


class ScaledByRank(Regression):
    """Rank 1's loss 100 times rank 0's: under a loss scaler, its gradients overflow at a lower scale."""

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return super().training_step(batch, batch_idx) * (1 + 99 * self.global_rank)


AMP_INIT_SCALE = 2.0**14


def _amp_fit(world_size: int, steps: int, **kwargs: Any) -> dict[str, Any]:
    """DiLoCo under ``16-mixed`` on the CPU, each rank with its own ``GradScaler`` (it grows after every step without
    an overflow and halves at each overflow, which skips the step)."""
    from lightning.pytorch.plugins.precision import MixedPrecision

    pl.seed_everything(0, verbose=False)
    module = ScaledByRank()
    scaler = torch.amp.GradScaler("cpu", init_scale=AMP_INIT_SCALE, growth_interval=1)
    precision = MixedPrecision("16-mixed", "cpu", scaler)
    strategy = GradCompDiLoCoStrategy(sync_every=LIGHTNING_H)
    trainer = quiet_trainer(strategy, world_size, steps, kwargs.pop("callbacks", []), plugins=[precision])
    trainer.fit(module, DataLoader(_data(world_size), batch_size=16), **kwargs)
    return {"weights": {k: v.detach().clone() for k, v in module.state_dict().items()}, "scaler": scaler.state_dict()}


def _amp_runs(rank: int, world_size: int, out: str) -> dict[str, Any]:
    checkpoint = ModelCheckpoint(dirpath=out, filename="amp", every_n_train_steps=EPOCH, save_top_k=-1)
    straight = _amp_fit(world_size, 2 * EPOCH)
    stopped = _amp_fit(world_size, EPOCH, callbacks=[checkpoint])
    torch.distributed.barrier()
    resumed = _amp_fit(world_size, 2 * EPOCH, ckpt_path=str(Path(out) / "amp.ckpt"))
    return {"straight": straight, "stopped": stopped["scaler"], "resumed": resumed}


def test_a_run_under_16_mixed_resumes_each_ranks_own_loss_scaler(tmp_path: Path) -> None:
    """Catches: each rank's scaler state left out of its shard or not restored (every rank would resume with rank 0's
    scaler from Lightning's own checkpoint, or a fresh one, and skip other steps)."""
    ranks = run_ranks(_amp_runs, 2, str(tmp_path), init=False)
    scales = [rank["stopped"]["scale"] for rank in ranks]
    assert scales[0] != scales[1] and AMP_INIT_SCALE not in scales  # the ranks' scalers moved, each its own way
    for rank in ranks:
        assert rank["resumed"]["scaler"] == rank["straight"]["scaler"]
        for name, value in rank["straight"]["weights"].items():
            assert torch.equal(value, rank["resumed"]["weights"][name]), name


def test_the_strategy_refuses_ddp_wrapper_arguments_and_bad_outer_settings() -> None:
    with pytest.raises(ValueError, match=r"do not pass its arguments \['find_unused_parameters'\]"):
        GradCompDiLoCoStrategy(find_unused_parameters=True)
    assert GradCompDiLoCoStrategy(ddp_comm_hook=None).sync_every == 500  # a config parser's explicit defaults
    with pytest.raises(ValueError, match="sync_every"):
        GradCompDiLoCoStrategy(sync_every=0)
    with pytest.raises(ValueError, match="outer_lr"):
        GradCompDiLoCoStrategy(outer_lr=-1.0)
    trainer = pl.Trainer(strategy="ddp_diloco", accelerator="cpu", devices=1, logger=False)
    assert isinstance(trainer.strategy, GradCompDiLoCoStrategy)


class TwoOptimizers(Regression):
    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        return [torch.optim.AdamW(self.net[0].parameters()), torch.optim.AdamW(self.net[2].parameters())]

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        return None


def _two_optimizers(rank: int, world_size: int) -> str:
    trainer = quiet_trainer(GradCompDiLoCoStrategy(sync_every=2), world_size, 2)
    module = TwoOptimizers()
    module.automatic_optimization = False
    try:
        trainer.fit(module, DataLoader(_data(world_size), batch_size=16))
    except ValueError as error:
        return str(error)
    return "trained"


def test_the_strategy_refuses_more_than_one_inner_optimizer() -> None:
    assert (
        run_ranks(_two_optimizers, 2, init=False)
        == [
            "GradCompDiLoCoStrategy synchronises after every sync_every-th step of one inner optimizer; "
            "configure_optimizers returned 2"
        ]
        * 2
    )
