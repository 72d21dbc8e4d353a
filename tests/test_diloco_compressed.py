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

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from models import quiet_trainer
from ranks import run_ranks
from test_diloco import EPOCH, CountCollectives, Regression, _data, _inner_step, _model
from test_terngrad import Z_LIMIT
from torch import Tensor, nn
from torch.utils.data import DataLoader, DistributedSampler

from lightning_gradcomp import CompressionMonitor
from lightning_gradcomp.core.compressors import ChunkedTopKCompressor, SparseEntries, TopKCompressor
from lightning_gradcomp.core.compressors.lowbit import TwoBitValues
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
    arguments.pop("sync_every", None)  # each test sets its own
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


#: ``send(rank, synchronisation, name, e) -> entries``: what a rank's compressor sends of its error-fed outer gradient
#: (``e`` in the parameter's shape)
Send = Callable[[int, int, str, torch.Tensor], SparseEntries]
#: ``outer(theta_prev, mean) -> theta``: the outer optimizer's step, every tensor in parameter order
Outer = Callable[[list[torch.Tensor], list[torch.Tensor]], list[torch.Tensor]]


def _compressed_diloco_reference(
    world_size: int, send: Send, decay: float, outer: Outer, over_choosers: bool = False
) -> list[dict[str, Tensor]]:
    """DiLoCo (Douillard et al., 2023, Algorithm 1) with each rank's outer gradient compressed under error feedback,
    for every rank in one process in plain torch: ``e_r = delta_r + decay e_r``; ``sent_r = send(e_r)``;
    ``e_r -= sent_r``; the mean ``sum_r sent_r / P`` (in rank order; ``over_choosers``: each entry's sum over the
    ranks that sent it, divided by their number) goes to ``outer``; the weights after every synchronisation."""
    models = [_wide_model() for _ in range(world_size)]
    names = [name for name, _ in models[0].named_parameters()]
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
            sent, chosen = [], []
            for rank in range(world_size):
                parts, masks = [], []
                for i, p in enumerate(models[rank].parameters()):
                    e = (previous[i] - p).add_(errors[rank][i], alpha=decay)
                    payload = send(rank, (step + 1) // H - 1, names[i], e)
                    part = torch.zeros(p.numel()).index_add_(0, payload.indices, payload.values).view_as(p)
                    errors[rank][i] = e - part
                    parts.append(part)
                    masks.append(torch.zeros(p.numel()).index_put_((payload.indices,), torch.tensor(1.0)).view_as(p))
                sent.append(parts)
                chosen.append(masks)
            mean = []
            for i in range(len(previous)):
                total = sum((sent[r][i] for r in range(world_size)), torch.zeros_like(previous[i]))
                count = sum(chosen[r][i] for r in range(world_size)).clamp(min=1) if over_choosers else world_size
                mean.append(total.div_(count))
            previous = outer(previous, mean)
            for model in models:
                for p, a in zip(model.parameters(), previous, strict=True):
                    p.copy_(a)
        after_syncs.append({k: v.detach().clone() for k, v in models[0].state_dict().items()})
    return after_syncs


def _sparseloco_reference(world_size: int) -> list[dict[str, torch.Tensor]]:
    """SparseLoCo (Sarfi et al., 2025, Algorithm 1): Top-k with 2-bit values, ``e = delta + beta e``, outer SGD of lr 1
    without momentum."""
    codec = TwoBitValues(TopKCompressor(SPARSELOCO_DENSITY))
    return _compressed_diloco_reference(
        world_size,
        lambda rank, synchronisation, name, e: codec.compress(e.reshape(-1)).entries(),
        SPARSELOCO_EF_DECAY,
        _plain_outer_step,
    )


def _plain_outer_step(previous: list[Tensor], mean: list[Tensor]) -> list[Tensor]:
    return [a - m for a, m in zip(previous, mean, strict=True)]  # outer SGD, lr 1, no momentum


def _faithful_sparseloco_reference(world_size: int) -> list[dict[str, Tensor]]:
    """SparseLoCo as its reference configuration runs it: Top-64 of every 64 x 64 chunk with 4-bin 2-bit values (the
    selection and the bins tested against their definitions in test_sparseloco.py), ``e = delta + 0.95 e``, each index
    averaged over the ranks that chose it, outer SGD of lr 1."""
    codec = ChunkedTopKCompressor()
    return _compressed_diloco_reference(
        world_size, lambda rank, synchronisation, name, e: codec.compress(e).entries(), SPARSELOCO_EF_DECAY,
        _plain_outer_step,
        over_choosers=True,
    )  # fmt: skip


def test_sparseloco_as_its_reference_configuration_runs_it_is_the_papers_loop() -> None:
    """Catches: a sum divided by the world instead of each index's mean over its choosers (a step shrunk by the ranks
    that did not choose it), the chunked selection or the bins changed, the decay or the outer step changed."""
    ranks = run_ranks(_train, 2, "ddp_diloco_sparseloco")
    reference = _faithful_sparseloco_reference(2)
    codec = ChunkedTopKCompressor()
    payload_bytes = sum(codec.payload_nbytes(p.shape, p.dtype) for p in _wide_model().parameters())
    for rank in ranks:
        for ours, expected, rank0 in zip(rank["after_syncs"], reference, ranks[0]["after_syncs"], strict=True):
            for name, value in ours.items():
                assert torch.equal(value, rank0[name]), name
                assert torch.equal(value, expected[name]), name
        sent = {s[1] for s in rank["history"] if s[0]}
        assert sent == {payload_bytes}  # one gather of fixed-size payloads a synchronisation, no size exchange


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


@pytest.mark.parametrize("preset", ["ddp_diloco_topk", "ddp_diloco_sparseloco", "ddp_diloco_qsgd", "diana-mixed"])
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


@pytest.mark.parametrize(
    ("world_size", "preset"), [(2, "ddp_diloco_qsgd"), (3, "ddp_diloco_topk"), (2, "ddp_diloco_sparseloco")]
)
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
        ({"compressor": "qsgd", "aggregator": "allgather_choosers"}, "sends no chosen entries"),
        ({"compressor": "chunked_topk", "aggregator": "gtopk"}, "aggregator='gtopk' merges sparse payloads"),
        ({"compressor": "chunked_topk", "compressor_kwargs": {"quantization_bins": 3}}, "power of two"),
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
    from lightning_gradcomp.core.checkpoint import manifest

    strategy = GradCompDiLoCoStrategy(**DILOCO_PRESETS["ddp_diloco_qsgd"][1])
    saved = manifest(2, "tag", "ef", "topk+2bit")  # what ddp_diloco_topk writes
    message = r"memory 'ef' and compressor 'topk\+2bit', but this run has memory 'ef' and compressor 'qsgd'"
    with pytest.raises(ValueError, match=message):
        strategy.read_diloco_shard("run.ckpt", 0, 2, saved, _model())
    with pytest.raises(ValueError, match="holds the DiLoCo state of 2 ranks, but this run has 3"):
        strategy.read_diloco_shard("run.ckpt", 0, 3, saved, _model())


class Tunable(Regression):
    """A learning rate for the tuner, a frozen parameter and a buffer, each drawn from the rank's own seed (after
    ``Regression`` seeded 0 for its weights: drawn before that, every rank's would be alike)."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.lr = 1e-2
        generator = torch.Generator().manual_seed(rank)
        self.frozen = nn.Parameter(torch.randn(3, generator=generator), requires_grad=False)
        self.register_buffer("stat", torch.randn(2, generator=generator))

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

    module = Tunable(rank)  # every rank initialised apart: the strategy starts them all from rank 0's state
    with torch.no_grad():
        for p in module.net.parameters():
            p.add_(rank)
    drawn = {k: v.detach().clone() for k, v in module.state_dict().items()}
    start = AtTrainStart()
    strategy = GradCompDiLoCoStrategy(**{**DILOCO_PRESETS["ddp_diloco_topk"][1], "sync_every": 3})
    finder = LearningRateFinder(min_lr=1e-4, max_lr=1.0, num_training_steps=8, update_attr=False)
    trainer = quiet_trainer(strategy, world_size, 4, [finder, start])
    trainer.fit(module, DataLoader(_data(world_size), batch_size=16))
    return {**start.seen, "drawn": drawn}


def test_a_tuners_restore_inside_fit_puts_back_the_outer_state_and_every_rank_starts_from_rank_zeros_module() -> None:
    """Catches: the learning-rate finder's sweep (7 inner steps, 2 synchronisations) left in theta_prev and the step
    count after the tuner restored the weights and optimizer from its checkpoint; and ranks that start DiLoCo from
    their own frozen parameters and buffers (rank 0's not broadcast)."""
    ranks = run_ranks(_tuned, 2, init=False)
    for name in ("frozen", "stat", "net.0.weight"):  # the ranks really started apart
        assert not torch.equal(ranks[0]["drawn"][name], ranks[1]["drawn"][name]), name
    for seen in ranks:
        assert seen["inner_steps"] == 0 and seen["anchor_is_weights"]
        for name, value in seen["state"].items():  # frozen parameters and buffers too, as DDP starts
            assert torch.equal(value, ranks[0]["state"][name]), name
        for name in ("frozen", "stat"):  # rank 0's own, as drawn (a tuner's restore leaves them alone)
            assert torch.equal(seen["state"][name], ranks[0]["drawn"][name]), name


def _read_with_one_rank_refused(rank: int, world_size: int, folder: str) -> dict[str, str]:
    """Rank 1's shard missing; then rank 1's shard holding theta_prev of another model: what each rank raised."""
    from lightning_gradcomp.core.checkpoint import manifest, write_shard

    saved = manifest(world_size, "tag", "ef", "topk+2bit")
    strategy = GradCompDiLoCoStrategy(**DILOCO_PRESETS["ddp_diloco_topk"][1])
    model = _model()
    outer = OuterSync(model.named_parameters(), sync_every=2).state_dict()
    wrong = {**outer, "anchor": {**outer["anchor"], "0.weight": torch.zeros(3, 3)}}
    messages = {}
    for case, path, shard in (("missing", Path(folder) / "missing.ckpt", outer if rank == 0 else None),
                              ("other model", Path(folder) / "other.ckpt", outer if rank == 0 else wrong)):  # fmt: skip
        if shard is not None:
            write_shard(path, rank, world_size, {"tag": "tag", "outer": shard})
        torch.distributed.barrier()
        try:
            strategy.read_diloco_shard(path, rank, world_size, saved, model)
            messages[case] = ""
        except ValueError as error:  # ShardError for the missing one
            messages[case] = f"{type(error).__name__}: {error}"
    return messages


def test_a_shard_missing_or_refused_on_one_rank_is_refused_on_every_rank(tmp_path: Path) -> None:
    """Catches: a rank whose own shard is fine going on alone to the first collective (the others wait there until the
    process group's timeout) when another rank's shard is missing or holds theta_prev of another model."""
    for messages in run_ranks(_read_with_one_rank_refused, 2, str(tmp_path)):
        assert messages["missing"].startswith("ShardError: the compression state of rank 1 is missing")
        assert messages["other model"].startswith("ValueError: the saved DiLoCo state has theta_prev for")
        assert messages["other model"].endswith("(on rank 1)")


#: 1-level QSGD (Alistarh et al., 2017) on the whole tensor, no memory, outer SGD of lr 1: the outer step is the
#: ranks' mean of their unbiased draws of the pseudo-gradient
ONE_LEVEL = {"compressor": "qsgd", "compressor_kwargs": {"levels": 1, "block_size": None}, "aggregator": "allgather",
             "outer_lr": 1.0, "outer_momentum": 0.0, "nesterov": False}  # fmt: skip
DRAWS = 300


def _pseudo_gradient() -> torch.Tensor:
    return torch.randn(64, generator=torch.Generator().manual_seed(7))


def _outer_steps_of_one_pseudo_gradient(rank: int, world_size: int) -> torch.Tensor:
    """``DRAWS`` synchronisations in which every rank's pseudo-gradient is the same: the outer steps taken."""
    parameter = nn.Parameter(torch.zeros(64))
    sync = OuterSync([("w", parameter)], sync_every=1, **ONE_LEVEL)
    delta = _pseudo_gradient()
    steps = []
    with torch.no_grad():
        for _ in range(DRAWS):
            sync.anchor["w"].zero_()  # theta_prev = 0 (plain outer SGD keeps no state): the step is -theta after
            parameter.copy_(-delta)
            sync.step()
            steps.append(-sync.anchor["w"].clone())
    return torch.stack(steps)


def test_every_rank_and_every_synchronisation_draw_their_own_numbers() -> None:
    """The mean over P ranks of independent unbiased draws has 1/P of one draw's variance: E||mean - delta||^2 is
    sum_j (N/s)^2 u_j (1 - u_j) / P (u = s |delta| / N, Lemma 3.1), checked within Z_LIMIT standard errors of the
    measured spread over the synchronisations. Catches: every rank seeding its streams alike (the mean of P equal
    draws keeps one draw's variance, 3x the expected), and every synchronisation drawing the same numbers (the
    synchronisations' outer steps all equal, no spread to average out)."""
    world_size = 3
    ranks = run_ranks(_outer_steps_of_one_pseudo_gradient, world_size)
    delta = _pseudo_gradient().double()
    u = delta.abs() / delta.norm()
    expected = float(delta.norm() ** 2 * (u * (1 - u)).sum()) / world_size
    for steps in ranks:
        assert torch.equal(steps, ranks[0])  # every rank took the same outer steps
        assert not torch.equal(steps[0], steps[1])  # successive synchronisations drew anew
        errors = (steps.double() - delta).pow(2).sum(dim=1)
        tolerance = Z_LIMIT * float(errors.std()) / math.sqrt(DRAWS)
        assert abs(float(errors.mean()) - expected) <= tolerance, (float(errors.mean()), expected, tolerance)


def _nonfinite_synchronisations(rank: int, world_size: int, preset: str) -> dict[str, Any]:
    """A finite synchronisation, then one with a NaN (rank 0) or an Inf (rank 1) in one parameter's
    pseudo-gradient: which memory entries moved, and the record's count of non-finite units."""
    outcomes = {}
    for bad, on_rank in (("nan", 0), ("inf", 1)):
        model = _wide_model()
        inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
        sync = OuterSync(model.named_parameters(), sync_every=1, **_preset(preset))
        _inner_step(model, inner, rank, 0)
        sync.step()
        before = {k: v.clone() for k, v in sync.memory.state_dict().items()}
        _inner_step(model, inner, rank, 1)
        if rank == on_rank:
            with torch.no_grad():
                model[0].weight[3, 1] = float(bad)
        sync.step()
        after = sync.memory.state_dict()
        outcomes[bad] = {
            "moved": sorted(k for k in before if not torch.equal(before[k], after[k])),
            "kept": sorted(k for k in before if torch.equal(before[k], after[k])),
            "nonfinite_units": sync.last_step.nonfinite_units,
        }
    return outcomes


@pytest.mark.parametrize(
    ("preset", "moved", "kept"),
    [
        ("ddp_diloco_topk", ["0.bias", "2.bias", "2.weight"], ["0.weight"]),
        ("diana-mixed", ["h/2.weight", "h_local/2.weight"], ["h/0.weight", "h_local/0.weight"]),
    ],
)
def test_a_nan_or_inf_pseudo_gradient_leaves_every_ranks_memory_of_its_unit_as_it_was(
    preset: str, moved: list[str], kept: list[str]
) -> None:
    """Catches: an average taken as finite whatever it holds (the other rank's residual would move by a step never
    taken; DIANA's shifts h and h_i would turn NaN for good), and a non-finite unit not counted."""
    for outcomes in run_ranks(_nonfinite_synchronisations, 2, preset):
        for bad, outcome in outcomes.items():
            assert outcome["nonfinite_units"] == 1, bad  # the one unit with the NaN/Inf; the others settled
            assert (outcome["moved"], outcome["kept"]) == (moved, kept), bad


def _qsgd_preset_runs(rank: int, world_size: int) -> list[dict[str, torch.Tensor]]:
    return _train(rank, world_size, "ddp_diloco_qsgd")["after_syncs"]


def _qsgd_paper_reference(world_size: int) -> list[dict[str, torch.Tensor]]:
    """4-bit QSGD under plain error feedback, its draws those of (seed 0, rank, synchronisation, parameter), and the
    paper's outer Nesterov momentum written out (Sutskever et al., 2013, as torch's SGD states it): ``v = mu v + g``,
    ``theta = theta_prev - lr (g + mu v)``, lr 0.7, mu 0.9."""
    from lightning_gradcomp.core.compressors import QSGDCompressor
    from lightning_gradcomp.core.randomness import UnitStreams
    from lightning_gradcomp.core.units import unit_key

    codec = QSGDCompressor(**DILOCO_PRESETS["ddp_diloco_qsgd"][1]["compressor_kwargs"])
    lr, mu = 0.7, 0.9
    velocity: list[torch.Tensor] = []

    def send(rank: int, synchronisation: int, name: str, e: torch.Tensor) -> SparseEntries:
        draws = UnitStreams(0, rank).generator(e.device, synchronisation, unit_key([name]))
        dense = codec.decompress(codec.compress(e.reshape(-1), draws))
        return SparseEntries(torch.arange(dense.numel()), dense, dense.numel())  # every entry sent

    def nesterov(previous: list[torch.Tensor], mean: list[torch.Tensor]) -> list[torch.Tensor]:
        # the sums ``a + alpha * b`` written as torch's SGD takes them (one add with alpha: fused where the CPU can,
        # so ``a - lr * b`` in two roundings differs in the last bit)
        velocity[:] = mean if not velocity else [v.mul(mu).add(g) for v, g in zip(velocity, mean, strict=True)]
        return [a.add(g.add(v, alpha=mu), alpha=-lr) for a, g, v in zip(previous, mean, velocity, strict=True)]

    return _compressed_diloco_reference(world_size, send, 1.0, nesterov)


def test_the_four_bit_preset_is_the_papers_loop_with_compressed_outer_gradients() -> None:
    ranks = run_ranks(_qsgd_preset_runs, 2)
    reference = _qsgd_paper_reference(2)
    for after_syncs in ranks:
        for ours, expected, rank0 in zip(after_syncs, reference, ranks[0], strict=True):
            for name, value in ours.items():
                assert torch.equal(value, rank0[name]), name
                assert torch.equal(value, expected[name]), name


class AfreshAtStart(pl.Callback):
    """What the outer loop holds when (each) ``fit`` starts training."""

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        sync = trainer.strategy.outer_sync
        self.seen = {
            "inner_steps": sync.inner_steps,
            "anchor": {name: value.clone() for name, value in sync.anchor.items()},
            "outer_state": len(sync.outer.state),
            "memory": len(sync.memory.state_dict()),
            "sync": sync,
        }


def _fitted_twice(rank: int, world_size: int) -> dict[str, Any]:
    strategy = GradCompDiLoCoStrategy(**{**DILOCO_PRESETS["ddp_diloco_qsgd"][1], "sync_every": LIGHTNING_H})
    module = Regression()
    start = AfreshAtStart()
    trainer = quiet_trainer(strategy, world_size, EPOCH, [start])
    trainer.fit(module, DataLoader(_data(world_size), batch_size=16))
    first = start.seen.pop("sync")
    ended = {f"net.{k}": v.detach().clone() for k, v in module.net.state_dict().items()}
    memory, momentum = len(first.memory.state_dict()), len(first.outer.state)
    trainer.fit_loop.epoch_loop.max_steps = 2 * EPOCH  # the same Trainer and strategy, fitted on
    trainer.fit(module, DataLoader(_data(world_size), batch_size=16))
    return {"ended": ended, "first_fit_state": (memory, momentum), "second": start.seen,
            "new_loop": start.seen.pop("sync") is not first}  # fmt: skip


def test_a_second_fit_on_the_same_strategy_starts_diloco_afresh_from_rank_zeros_weights() -> None:
    """Catches: a second ``fit`` going on with the first one's step count, theta_prev, outer momentum or memory."""
    ranks = run_ranks(_fitted_twice, 2, init=False)
    assert not torch.equal(ranks[0]["ended"]["net.0.weight"], ranks[1]["ended"]["net.0.weight"])  # ended apart
    for outcome in ranks:
        assert outcome["first_fit_state"] == (4, 4)  # the first fit left residuals and momentum to forget
        assert outcome["new_loop"]
        second = outcome["second"]
        assert (second["inner_steps"], second["outer_state"], second["memory"]) == (0, 0, 0)
        for name, value in second["anchor"].items():
            assert torch.equal(value, ranks[0]["ended"][name]), name  # rank 0's weights, on every rank
