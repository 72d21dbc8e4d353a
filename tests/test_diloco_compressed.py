"""DiLoCo with a compressed outer exchange: SparseLoCo (``ddp_diloco_topk``) and 4-bit QSGD (``ddp_diloco_qsgd``).

SparseLoCo's synchronisation equals a reference written in plain torch (every rank simulated in one process: error
feedback with decay, Top-k with 2-bit values, the payloads summed in rank order, outer SGD of lr 1) bit for bit on
2 ranks; after every synchronisation the ranks hold the same weights bit for bit; inner steps exchange nothing; a
synchronisation sends exactly its payloads' bytes; a run restored between two synchronisations (random compressor
included) ends where the straight run does, in a plain loop and under the Trainer at 2 and 3 ranks, where the
Trainer run also equals the plain loop; ``CompressionMonitor`` reports bytes per inner step. Bad combinations are
``ValueError``\\s naming the argument.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from models import quiet_trainer
from ranks import run_ranks
from test_diloco import EPOCH, CountCollectives, Regression, _data, _inner_step, _model
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler

from lightning_gradcomp import CompressionMonitor
from lightning_gradcomp.compressors import TopKCompressor
from lightning_gradcomp.compressors.lowbit import TwoBitValues
from lightning_gradcomp.diloco import GradCompDiLoCoStrategy, OuterSync
from lightning_gradcomp.diloco.presets import DILOCO_PRESETS, SPARSELOCO_DENSITY, SPARSELOCO_EF_DECAY

H = 4
SYNCS = 3


#: Beyond the presets: DIANA's shifts on QSGD with the small parameters (biases, the output layer) averaged densely in
#: the same synchronisation
DIANA_MIXED = {"compressor": "qsgd", "memory": "diana", "min_compress_numel": 300, "outer_momentum": 0.5}


def _preset(name: str) -> dict[str, Any]:
    """A DiLoCo preset's arguments (or :data:`DIANA_MIXED`'s) as :class:`OuterSync` takes them."""
    arguments = dict(DIANA_MIXED if name == "diana-mixed" else DILOCO_PRESETS[name][1])
    outer = {key: arguments.pop(key) for key in ("outer_lr", "outer_momentum", "nesterov") if key in arguments}
    return {**outer, **arguments}


def _wide_model() -> nn.Module:
    """Parameters large enough for Top-k at 1.56% to keep several entries of each."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 256), nn.Tanh(), nn.Linear(256, 2))


def _train(rank: int, world_size: int, preset: str, stop_at: int | None = None) -> dict[str, Any]:
    def build() -> tuple[nn.Module, torch.optim.Optimizer, OuterSync]:
        model = _wide_model()
        inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
        return model, inner, OuterSync(model.named_parameters(), sync_every=H, **_preset(preset))

    model, inner, sync = build()
    after_syncs = []
    for step in range(H * SYNCS):
        if step == stop_at:  # a restart: fresh objects, the state put back
            state = {"model": model.state_dict(), "inner": inner.state_dict(), "sync": sync.state_dict()}
            model, inner, sync = build()
            model.load_state_dict(state["model"])
            inner.load_state_dict(state["inner"])
            sync.load_state_dict(state["sync"])
        _inner_step(model, inner, rank, step)
        if sync.step():
            after_syncs.append({k: v.detach().clone() for k, v in model.state_dict().items()})
    return {
        "after_syncs": after_syncs,
        "history": [(s.synchronised, s.bytes_sent, s.payload_bytes, s.collectives) for s in sync.history],
        "residuals": {name: r.clone() for name, r in sync.memory.state_dict().items()},
    }


def _sparseloco_reference(world_size: int) -> list[dict[str, torch.Tensor]]:
    """SparseLoCo (Sarfi et al., 2025, Algorithm 1) for every rank in one process, in plain torch."""
    codec = TwoBitValues(TopKCompressor(SPARSELOCO_DENSITY))
    models = [_wide_model() for _ in range(world_size)]
    inners = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in models]
    previous = [p.detach().clone() for p in models[0].parameters()]
    errors = [[torch.zeros_like(p) for p in previous] for _ in range(world_size)]
    after_syncs = []
    for step in range(H * SYNCS):
        for rank in range(world_size):
            _inner_step(models[rank], inners[rank], rank, step)
        if (step + 1) % H:
            continue
        with torch.no_grad():
            sent = []
            for rank in range(world_size):
                parts = []
                for i, p in enumerate(models[rank].parameters()):
                    e = (previous[i] - p).add_(errors[rank][i], alpha=SPARSELOCO_EF_DECAY)  # e = delta + beta e
                    part = codec.decompress(codec.compress(e.reshape(-1))).view_as(p)
                    errors[rank][i] = e - part  # e -= sent
                    parts.append(part)
                sent.append(parts)
            mean = [sum((sent[r][i] for r in range(world_size)), torch.zeros_like(previous[i])).div_(world_size)
                    for i in range(len(previous))]  # fmt: skip
            previous = [a - m for a, m in zip(previous, mean, strict=True)]  # outer SGD, lr 1, no momentum
            for model in models:
                for p, a in zip(model.parameters(), previous, strict=True):
                    p.copy_(a)
        after_syncs.append({k: v.detach().clone() for k, v in models[0].state_dict().items()})
    return after_syncs


def test_sparseloco_is_the_plain_torch_reference_and_sends_exactly_its_payloads() -> None:
    ranks = run_ranks(_train, 2, "ddp_diloco_topk")
    reference = _sparseloco_reference(2)
    codec = TwoBitValues(TopKCompressor(SPARSELOCO_DENSITY))
    payload_bytes = sum(codec.payload_nbytes(p.shape, p.dtype) for p in _wide_model().parameters())
    for rank in ranks:
        for ours, expected, rank0 in zip(rank["after_syncs"], reference, ranks[0]["after_syncs"], strict=True):
            for name, value in ours.items():
                assert torch.equal(value, rank0[name]), name  # every rank alike after every synchronisation
                assert torch.equal(value, expected[name]), name
        for i, (synchronised, sent, payload, collectives) in enumerate(rank["history"]):
            assert synchronised == ((i + 1) % H == 0)
            # one allgather of fixed-size payloads (no size exchange): its input is exactly this rank's payloads
            assert (sent, payload, collectives) == ((payload_bytes, payload_bytes, 1) if synchronised else (0, 0, 0))
        assert any(r.abs().sum() > 0 for r in rank["residuals"].values())  # what was not sent waits


def _straight_and_restored(rank: int, world_size: int, preset: str) -> tuple[dict, dict]:
    return _train(rank, world_size, preset), _train(rank, world_size, preset, stop_at=H + 2)


@pytest.mark.parametrize("preset", ["ddp_diloco_topk", "ddp_diloco_qsgd", "diana-mixed"])
def test_a_plain_loop_restored_between_synchronisations_ends_where_the_straight_one_does(preset: str) -> None:
    ranks = run_ranks(_straight_and_restored, 3, preset)
    for straight, restored in ranks:
        for ours, again, rank0 in zip(straight["after_syncs"], restored["after_syncs"], ranks[0][0]["after_syncs"],
                                      strict=True):  # fmt: skip
            for name, value in ours.items():
                assert torch.equal(value, again[name]), name
                assert torch.equal(value, rank0[name]), name  # every rank alike after every synchronisation
        for name, value in straight["residuals"].items():
            assert torch.equal(value, restored["residuals"][name]), name


LIGHTNING_H = 3


def _fit(world_size: int, steps: int, preset: str, **kwargs: Any) -> dict[str, Any]:
    pl.seed_everything(0, verbose=False)
    module = Regression()
    strategy = GradCompDiLoCoStrategy(**{**DILOCO_PRESETS[preset][1], "sync_every": LIGHTNING_H})
    count, monitor = CountCollectives(), CompressionMonitor(every_n_steps=LIGHTNING_H, print_summary=False)
    trainer = quiet_trainer(strategy, world_size, steps, [count, monitor, *kwargs.pop("callbacks", [])])
    trainer.fit(module, DataLoader(_data(world_size), batch_size=16), **kwargs)
    summary = monitor.summary[-1]
    return {
        "weights": {k: v.detach().clone() for k, v in module.state_dict().items()},
        "anchor": {k: v.clone() for k, v in strategy.outer_sync.anchor.items()},
        "memory": {k: v.clone() for k, v in strategy.outer_sync.memory.state_dict().items()},
        "collectives": (count.inner, count.at_syncs),
        "per_inner_step": (summary.steps, summary.bytes_sent, summary.dense_bytes),
        "synchronisations": [s.bytes_sent for s in strategy.outer_sync.history if s.synchronised],
    }


def _plain(rank: int, world_size: int, steps: int, preset: str) -> dict[str, torch.Tensor]:
    """The same run in a plain torch loop: the same shard of the data in the same order, OuterSync (the parameters
    named as under the Trainer: a unit's random stream follows its name)."""
    pl.seed_everything(0, verbose=False)
    model = Regression()
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sync = OuterSync(model.named_parameters(), sync_every=LIGHTNING_H, **_preset(preset))
    sampler = DistributedSampler(_data(world_size), num_replicas=world_size, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(_data(world_size), batch_size=16, sampler=sampler)
    for epoch in range(steps // EPOCH):
        sampler.set_epoch(epoch)
        for x, y in loader:
            inner.zero_grad()
            nn.functional.mse_loss(model.net(x), y).backward()
            inner.step()
            sync.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _lightning_runs(rank: int, world_size: int, out: str, preset: str) -> dict[str, Any]:
    checkpoint = ModelCheckpoint(dirpath=out, filename="half", every_n_train_steps=EPOCH, save_top_k=-1)
    return {
        "straight": _fit(world_size, 2 * EPOCH, preset),
        "stopped": _fit(world_size, EPOCH, preset, callbacks=[checkpoint]),
    }


def _lightning_resumed(rank: int, world_size: int, out: str, preset: str) -> dict[str, Any]:
    resumed = _fit(world_size, 2 * EPOCH, preset, ckpt_path=str(Path(out) / "half.ckpt"))
    torch.distributed.barrier()
    return {"resumed": resumed, "plain": _plain(rank, world_size, 2 * EPOCH, preset)}


@pytest.mark.parametrize(("world_size", "preset"), [(2, "ddp_diloco_qsgd"), (3, "ddp_diloco_topk")])
def test_the_trainer_resumes_a_compressed_exchange_between_synchronisations(
    world_size: int, preset: str, tmp_path: Path
) -> None:
    first = run_ranks(_lightning_runs, world_size, str(tmp_path), preset, init=False)
    again = run_ranks(_lightning_resumed, world_size, str(tmp_path), preset, init=False)
    syncs = 2 * EPOCH // LIGHTNING_H
    dense_per_step = world_size * 4 * sum(p.numel() for p in _model().parameters())
    for rank in range(world_size):
        straight, resumed, plain = first[rank]["straight"], again[rank]["resumed"], again[rank]["plain"]
        assert straight["collectives"][0] == 0  # inner steps exchange nothing
        assert len(straight["synchronisations"]) == syncs
        for name, value in straight["weights"].items():
            assert torch.equal(value, plain[name]), (rank, name)  # the Trainer adds nothing to the algorithm
            assert torch.equal(value, resumed["weights"][name]), (rank, name)
        for name, value in straight["anchor"].items():
            assert torch.equal(value, resumed["anchor"][name]), (rank, name)
            assert torch.equal(value, first[0]["straight"]["anchor"][name]), (rank, name)
        for name, value in straight["memory"].items():
            assert torch.equal(value, resumed["memory"][name]), (rank, name)  # this rank's own residuals came back
        # the monitor's figures are per inner step, all ranks: the synchronisations' bytes over every step
        steps, sent, dense = straight["per_inner_step"]
        assert steps == 2 * EPOCH and dense == dense_per_step
        total = sum(sum(first[r]["straight"]["synchronisations"]) for r in range(world_size))
        assert sent == pytest.approx(total / steps, rel=1e-12)
        assert sent < dense / LIGHTNING_H  # below dense DiLoCo's, which sends every parameter once per H steps


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"compressor": "topk", "memory": "diana"}, "memory='diana' needs a compressor that is unbiased"),
        ({"compressor": "qsgd", "wire_precision": "2bit"}, "wire_precision='2bit' quantises the values"),
        ({"compressor": "topk", "wire_precision": "2bit", "aggregator": "allreduce"}, "use aggregator='allgather'"),
        ({"compressor": "topk", "memory": "ef", "memory_kwargs": {"decay": 0.0}}, "decay"),
        ({"compressor": "topk", "memory": "ef", "memory_kwargs": {"decay": 0.9, "momentum": 0.9}}, "one or the other"),
        ({"memory": "ef"}, "pass compressor= too"),
        ({"compressor": "topk", "min_compress_numel": -1}, "min_compress_numel"),
        ({"compressor": "nope"}, "compressor must be one of"),
        ({"compressor": "topk", "aggregator": None}, "aggregator must be one of"),
        ({"compressor": "powersgd", "aggregator": "allreduce"}, "needs each tensor's own shape and a warm start"),
        ({"compressor": "atomo"}, "needs each tensor's own shape"),
        ({"compressor": "terngrad", "compressor_kwargs": {"share_scale": True}}, "a scale shared over the ranks"),
        ({"compressor": "qsgd", "aggregator": "gtopk"}, "aggregator='gtopk' merges sparse payloads"),
        ({"aggregator": "allgather"}, "pass compressor= too"),
        ({"seed": 3}, "pass compressor= too"),
    ],
)
def test_bad_combinations_are_value_errors_naming_the_argument(arguments: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        OuterSync(_model().named_parameters(), sync_every=2, **arguments)
    with pytest.raises(ValueError, match=message):
        GradCompDiLoCoStrategy(sync_every=2, **arguments)


def test_the_presets_are_registered_with_their_arguments() -> None:
    for name, (_, arguments) in DILOCO_PRESETS.items():
        trainer = pl.Trainer(strategy=name, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False)
        strategy = trainer.strategy
        assert isinstance(strategy, GradCompDiLoCoStrategy)
        assert (strategy.outer_lr, strategy.outer_momentum, strategy.nesterov) == (
            arguments.get("outer_lr", 0.7),
            arguments.get("outer_momentum", 0.9),
            arguments.get("nesterov", True),
        )
        assert strategy.exchange_arguments.get("compressor") == arguments.get("compressor")


def test_one_rank_alone_sends_nothing_and_still_compresses() -> None:
    model = _wide_model()
    sync = OuterSync(model.named_parameters(), sync_every=1, **_preset("ddp_diloco_topk"))
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    _inner_step(model, inner, 0, 0)
    moved = {name: before[name] - p.detach() for name, p in model.named_parameters()}
    sync.step()
    for name, p in model.named_parameters():
        step = before[name] - p.detach()  # what the outer step applied: the sent part of the pseudo-gradient
        assert (step != 0).sum() == max(1, int(SPARSELOCO_DENSITY * p.numel())), name
        kept = sync.memory.residual(name).view_as(p)
        torch.testing.assert_close(step + kept, moved[name], rtol=0, atol=1e-6)  # sent + kept = delta
    assert sync.last_step.bytes_sent == 0 and sync.last_step.payload_bytes > 0


FABRIC_STEPS, FABRIC_SAVE_AT = 8, 4  # H = 3: the save falls between the first and the second synchronisation


def _fabric_run(rank: int, world_size: int, folder: str) -> dict[str, Any]:
    import lightning as L

    from lightning_gradcomp.diloco import GradCompDiLoCoFabricStrategy

    def start(init: int) -> tuple[Any, nn.Module, Any, GradCompDiLoCoFabricStrategy]:
        arguments = {**DILOCO_PRESETS["ddp_diloco_qsgd"][1], "sync_every": LIGHTNING_H}
        strategy = GradCompDiLoCoFabricStrategy(**arguments)
        fabric = L.Fabric(accelerator="cpu", devices=world_size, strategy=strategy)
        fabric.launch()
        model = _wide_model()
        if init:  # other initial weights: everything a resumed run goes on from comes from the checkpoint
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(float(init))
        model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
        return fabric, model, optimizer, strategy

    def train(fabric: Any, model: nn.Module, optimizer: Any, steps: range) -> None:
        for step in steps:
            x, y = _batch_for(rank, step)
            optimizer.zero_grad()
            fabric.backward(nn.functional.mse_loss(model(x), y))
            optimizer.step()

    fabric, model, optimizer, strategy = start(0)
    train(fabric, model, optimizer, range(FABRIC_STEPS))
    straight = {k: v.detach().clone() for k, v in model.state_dict().items()}
    syncs = [s.bytes_sent for s in strategy.outer_sync.history if s.synchronised]
    plain = _plain_fabric_reference(rank)
    fabric, model, optimizer, strategy = start(0)
    train(fabric, model, optimizer, range(FABRIC_SAVE_AT))
    path = Path(folder) / "diloco.ckpt"
    saved = {k: v.detach().clone() for k, v in model.state_dict().items()}
    fabric.save(path, {"model": model, "optimizer": optimizer, "step": FABRIC_SAVE_AT})
    fabric, model, optimizer, strategy = start(3)
    state = {"model": model, "optimizer": optimizer, "step": 0}
    remainder = fabric.load(path, state)
    train(fabric, model, optimizer, range(state["step"], FABRIC_STEPS))
    resumed = {k: v.detach().clone() for k, v in model.state_dict().items()}
    fabric, model, optimizer, strategy = start(5)
    fabric.load(path, {"model": model})  # to evaluate: the checkpoint's weights (rank 0's), no shard
    evaluated = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {"straight": straight, "plain": plain, "resumed": resumed, "syncs": syncs, "remainder": sorted(remainder),
            "saved": saved, "evaluated": evaluated}  # fmt: skip


def _batch_for(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * (rank + 1) + step)
    x = torch.randn(16, 8, generator=generator)
    return x, x[:, :2] * (rank + 1)


def _plain_fabric_reference(rank: int) -> dict[str, torch.Tensor]:
    """The Fabric loop's algorithm in plain torch: OuterSync over the same (already initialised) process group."""
    model = _wide_model()
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sync = OuterSync(model.named_parameters(), sync_every=LIGHTNING_H, **_preset("ddp_diloco_qsgd"))
    for step in range(FABRIC_STEPS):
        x, y = _batch_for(rank, step)
        inner.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        inner.step()
        sync.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("world_size", [2])
def test_fabric_runs_the_plain_loop_and_resumes_between_synchronisations(world_size: int, tmp_path: Path) -> None:
    ranks = run_ranks(_fabric_run, world_size, str(tmp_path), init=False)
    for result in ranks:
        assert len(result["syncs"]) == FABRIC_STEPS // LIGHTNING_H and all(result["syncs"])
        assert result["remainder"] == []  # the manifest is the strategy's; nothing else was left over
        for name, value in result["straight"].items():
            assert torch.equal(value, result["plain"][name]), name  # Fabric adds nothing to the algorithm
            assert torch.equal(value, result["resumed"][name]), name  # each rank's own state came back
            assert torch.equal(result["evaluated"][name], ranks[0]["saved"][name]), name  # a model-only load
    assert not torch.equal(ranks[0]["saved"]["0.weight"], ranks[1]["saved"]["0.weight"])  # saved between syncs


def test_a_checkpoint_of_another_exchange_is_refused_by_name() -> None:
    from lightning_gradcomp.checkpoint import manifest

    strategy = GradCompDiLoCoStrategy(**DILOCO_PRESETS["ddp_diloco_qsgd"][1])
    saved = manifest(2, "tag", "ef", "topk+2bit")  # what ddp_diloco_topk writes
    message = r"memory 'ef' and compressor 'topk\+2bit', but this run has memory 'ef' and compressor 'qsgd'"
    with pytest.raises(ValueError, match=message):
        strategy.read_diloco_shard("run.ckpt", 0, 2, saved)
    with pytest.raises(ValueError, match="holds the DiLoCo state of 2 ranks, but this run has 3"):
        strategy.read_diloco_shard("run.ckpt", 0, 3, saved)


class Tunable(Regression):
    """A learning rate for the tuner, a frozen parameter and a buffer, each drawn from the rank's own seed."""

    def __init__(self) -> None:
        super().__init__()
        self.lr = 1e-2
        self.frozen = nn.Parameter(torch.randn(3), requires_grad=False)
        self.register_buffer("stat", torch.randn(2))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.net.parameters(), lr=self.lr)


class AtTrainStart(pl.Callback):
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        sync = trainer.strategy.outer_sync
        self.seen = {
            "inner_steps": sync.inner_steps,
            "anchor_is_weights": all(
                torch.equal(sync.anchor[n], p) for n, p in pl_module.named_parameters() if p.requires_grad
            ),
            "state": {k: v.detach().clone() for k, v in pl_module.state_dict().items()},
        }


def _tuned(rank: int, world_size: int) -> dict[str, Any]:
    from lightning.pytorch.callbacks import LearningRateFinder

    torch.manual_seed(rank)  # every rank initialised apart: the strategy starts them all from rank 0's state
    module = Tunable()
    with torch.no_grad():
        for p in module.net.parameters():
            p.add_(rank)
    start = AtTrainStart()
    strategy = GradCompDiLoCoStrategy(**{**DILOCO_PRESETS["ddp_diloco_topk"][1], "sync_every": 3})
    finder = LearningRateFinder(min_lr=1e-4, max_lr=1.0, num_training_steps=8, update_attr=False)
    trainer = quiet_trainer(strategy, world_size, 4, [finder, start])
    trainer.fit(module, DataLoader(_data(world_size), batch_size=16))
    return start.seen


def test_a_tuners_restore_inside_fit_puts_back_the_outer_state_and_every_rank_starts_from_rank_zeros_module() -> None:
    """Catches: the learning-rate finder's sweep (7 inner steps, 2 synchronisations) left in theta_prev and the step
    count after the tuner restored the weights and optimizer from its checkpoint."""
    ranks = run_ranks(_tuned, 2, init=False)
    for seen in ranks:
        assert seen["inner_steps"] == 0 and seen["anchor_is_weights"]
        for name, value in seen["state"].items():  # frozen parameters and buffers too, as DDP starts
            assert torch.equal(value, ranks[0]["state"][name]), name


def _read_with_rank_one_missing(rank: int, world_size: int, folder: str) -> str:
    from lightning_gradcomp.checkpoint import manifest, write_shard

    path = Path(folder) / "run.ckpt"
    if rank == 0:  # rank 1's shard is missing
        write_shard(path, 0, world_size, {"tag": "tag"})
    torch.distributed.barrier()
    strategy = GradCompDiLoCoStrategy(**DILOCO_PRESETS["ddp_diloco_topk"][1])
    try:
        strategy.read_diloco_shard(path, rank, world_size, manifest(world_size, "tag", "ef", "topk+2bit"))
    except ValueError as error:  # ShardError
        return str(error)
    return ""


def test_a_shard_missing_on_one_rank_is_refused_on_every_rank(tmp_path: Path) -> None:
    # rank 0's own shard is there: without the ranks agreeing, it would go on alone to the first collective
    for message in run_ranks(_read_with_rank_one_missing, 2, str(tmp_path)):
        assert "the compression state of rank 1 is missing" in message
