"""Compressed Adam (1-bit Adam, Tang et al., 2021) on real ranks: equal to a reference loop written from the paper's
Algorithm 1 (2 ranks from the first step; 3 ranks from the recorded state at the freeze, since gloo sums three ranks'
warm-up gradients in its own order), every rank's weights alike after every step, exact resume before, at and after
the end of the warm-up on 2 and 3 ranks with DDP's bucket layout changing, the Trainer and Fabric, and refusals."""

from __future__ import annotations

import itertools
import math
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from models import quiet_trainer
from ranks import run_ranks
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset

from lightning_gradcomp import COMPRESSED_ADAM_PRESETS, CompressedAdam, CompressionMonitor, GradCompAdamStrategy
from lightning_gradcomp.compressed_adam.optimizer import build_codec
from lightning_gradcomp.core.compressors import TopKCompressor
from lightning_gradcomp.core.randomness import UnitStreams
from lightning_gradcomp.core.two_phase_average import SERVER_KEYS

FREEZE, STEPS = 4, 12
LR, BETAS, EPS, DECAY = 1e-2, (0.9, 0.95), 1e-8, 0.1


def _model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(16, 8), nn.Flatten(), nn.Linear(24, 32), nn.Tanh(), nn.Linear(32, 2))
    return model


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randint(0, 12, (16, 3), generator=generator)  # tokens 12-15 never seen: embedding rows of zero variance
    return x, torch.randn(16, 2, generator=generator) * (rank + 1)


def _loss(model: nn.Module, rank: int, step: int) -> torch.Tensor:
    x, y = _batch(rank, step)
    return nn.functional.mse_loss(model(x), y)


def _optimizer(model: nn.Module) -> torch.optim.AdamW:
    decayed = [p for p in model.parameters() if p.dim() >= 2]
    kept = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decayed}, {"params": kept, "weight_decay": 0.0}], lr=LR, betas=BETAS,
                             eps=EPS, weight_decay=DECAY)  # fmt: skip


def _run(rank: int, world_size: int, compressor: str, stop_at: int | None = None, bucket_cap_mb: float = 25.0) -> dict:
    """``STEPS`` steps of compressed Adam (freeze after ``FREEZE``) under a learning-rate schedule; with ``stop_at``, a
    restart there from the saved state: fresh objects, a fresh DDP (its first bucket layout again)."""

    def build() -> tuple[nn.Module, DistributedDataParallel, torch.optim.AdamW, Any, CompressedAdam]:
        model = _model()
        ddp = DistributedDataParallel(model, bucket_cap_mb=bucket_cap_mb)
        optimizer = _optimizer(model)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda t: 1.0 / (1 + 0.1 * t))
        adam = CompressedAdam(optimizer, **_arguments(compressor)).install(ddp)
        return model, ddp, optimizer, schedule, adam

    model, ddp, optimizer, schedule, adam = build()
    weights, grads, at_freeze = [], [], None
    for step in range(STEPS):
        if step == stop_at:
            saved = {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                     "schedule": schedule.state_dict(), "adam": adam.state_dict()}  # fmt: skip
            model, ddp, optimizer, schedule, adam = build()
            model.load_state_dict(saved["model"])
            optimizer.load_state_dict(saved["optimizer"])
            schedule.load_state_dict(saved["schedule"])
            adam.load_state_dict(saved["adam"])
        optimizer.zero_grad()
        _loss(ddp, rank, step).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        optimizer.step()
        schedule.step()
        weights.append({k: v.detach().clone() for k, v in model.state_dict().items()})
        if step + 1 == FREEZE:
            at_freeze = {"params": [p.detach().clone() for p in model.parameters()],
                         "m": [optimizer.state[p]["exp_avg"].clone() for p in model.parameters()],
                         "v": [optimizer.state[p]["exp_avg_sq"].clone() for p in model.parameters()]}  # fmt: skip
    return {"weights": weights, "grads": grads, "at_freeze": at_freeze, "adam": adam.state_dict(),
            "history": [(s.compressed, s.bytes_sent, s.dense_bytes) for s in adam.history]}  # fmt: skip


def _arguments(compressor: str) -> dict[str, Any]:
    return {**COMPRESSED_ADAM_PRESETS[compressor][1], "freeze_step": FREEZE, "seed": 3}


def _reference(world_size: int, compressor: str, grads: list[list[list[torch.Tensor]]] | None = None,
               at_freeze: dict | None = None) -> list[list[torch.Tensor]]:  # fmt: skip
    """1-bit Adam (Tang et al., 2021, Algorithm 1) for every rank in one process, with the user's AdamW's bias
    corrections and decoupled weight decay: the warm-up as AdamW on the mean gradient; then, with the variance frozen,
    ``m_i = beta1 m + (1 - beta1) g_i``; the compressed allreduce written out (chunks of the flat momentum owned rank by
    rank, each parameter's part of a chunk compressed on its own, worker error ``e_w`` and server error ``e_s``); the
    mask of zero-variance entries; ``p = p (1 - lr wd) - lr / (1 - beta1^t) m / (sqrt(v / (1 - beta2^T)) + eps)``.
    With ``grads`` and ``at_freeze`` (what a run recorded), it starts at the freeze from that state and those ranks'
    gradients."""
    model = _model()
    params = list(model.parameters())
    order = [i for i, p in enumerate(params) if p.dim() >= 2] + [i for i, p in enumerate(params) if p.dim() < 2]
    sizes = [params[i].numel() for i in order]  # the flat momentum in the optimizer's order: its groups, in turn
    decay = [DECAY if params[i].dim() >= 2 else 0.0 for i in order]
    codec = build_codec(**{k: v for k, v in _arguments(compressor).items() if k.startswith("compressor")})
    lrs = [LR / (1 + 0.1 * t) for t in range(STEPS)]
    if at_freeze is None:  # the warm-up: AdamW on the mean of the ranks' gradients
        optimizer = _optimizer(model)
        for step in range(FREEZE):
            for group in optimizer.param_groups:
                group["lr"] = lrs[step]
            optimizer.zero_grad()
            losses = [_loss(model, rank, step) for rank in range(world_size)]
            per_rank = [torch.autograd.grad(loss, params) for loss in losses]
            for i, p in enumerate(params):
                p.grad = sum(per_rank[r][i] for r in range(world_size)) / world_size
            optimizer.step()
        at_freeze = {"params": [p.detach().clone() for p in params],
                     "m": [optimizer.state[p]["exp_avg"].clone() for p in params],
                     "v": [optimizer.state[p]["exp_avg_sq"].clone() for p in params]}  # fmt: skip
    weights = [at_freeze["params"][i].clone() for i in order]
    m = torch.cat([at_freeze["m"][i].reshape(-1) for i in order])
    v = torch.cat([at_freeze["v"][i].reshape(-1) for i in order])
    denominator = v.sqrt().div_(math.sqrt(1 - BETAS[1] ** FREEZE)).add_(EPS)
    mask = (v > 0).float()
    n = m.numel()
    share, extra = divmod(n, world_size)
    edges = [i * share + min(i, extra) for i in range(world_size + 1)]
    bounds = [0, *torch.tensor(sizes).cumsum(0).tolist()]
    pieces, key = [], 0  # per chunk: (start, end, key) of each parameter's part
    for lo, hi in itertools.pairwise(edges):
        cuts = sorted({lo, hi, *(b for b in bounds if lo < b < hi)})
        pieces.append([(a, b, key + i) for i, (a, b) in enumerate(itertools.pairwise(cuts)) if b > a])
        key += len(cuts) - 1
    worker_error = [torch.zeros(n) for _ in range(world_size)]
    server_error = [torch.zeros(hi - lo) for lo, hi in itertools.pairwise(edges)]
    after = []
    for step in range(FREEZE, STEPS):
        if grads is None:
            for i, w in zip(order, weights, strict=True):
                params[i].data.copy_(w)
            per_rank = [torch.autograd.grad(_loss(model, r, step), params) for r in range(world_size)]
        else:
            per_rank = [grads[r][step] for r in range(world_size)]
        local = [torch.cat([g[i].reshape(-1) for i in order]) for g in per_rank]
        sent = []  # worker: y = beta1 m + (1 - beta1) g_i + e_w, each piece compressed, e_w = y - sent
        for r in range(world_size):
            y = worker_error[r].add_(m.mul(BETAS[0]).add_(local[r], alpha=1 - BETAS[0]))
            decoded = torch.zeros(n)
            for chunk in pieces:
                for a, b, k in chunk:
                    draws = UnitStreams(3, r).generator(torch.device("cpu"), step, k)
                    decoded[a:b] = codec.decompress(codec.compress(y[a:b], draws))
            y.sub_(decoded)
            sent.append(decoded)
        m = torch.zeros(n)  # server r: its chunk's mean, z = e_s + mean, compressed again, e_s = z - sent
        for r, chunk in enumerate(pieces):
            for a, b, k in chunk:
                mean = sum(sent[q][a:b].float() for q in range(world_size)) / world_size
                z = server_error[r][a - edges[r] : b - edges[r]].add_(mean)
                draws = UnitStreams(3, r).generator(torch.device("cpu"), step, SERVER_KEYS + k)
                m[a:b] = codec.decompress(codec.compress(z, draws))
                z.sub_(m[a:b])
        m.mul_(mask)
        offset = 0
        for i, w in enumerate(weights):
            lr, t = lrs[step], step + 1
            w.mul_(1 - lr * decay[i])
            view = slice(offset, offset + sizes[i])
            w.addcdiv_(m[view].view_as(w), denominator[view].view_as(w), value=-lr / (1 - BETAS[0] ** t))
            offset += sizes[i]
        after.append([weights[order.index(i)].clone() for i in range(len(params))])  # in the module's order
    return after


def _compare(run: dict, reference: list[list[torch.Tensor]]) -> None:
    for step, expected in zip(range(FREEZE, STEPS), reference, strict=True):
        for value, want in zip(run["weights"][step].values(), expected, strict=True):
            assert torch.equal(value, want), step


@pytest.mark.parametrize("compressor", ["ddp_onebit_adam", "ddp_qsgd_adam"])
def test_two_ranks_are_the_papers_loop_from_the_first_step(compressor: str) -> None:
    ranks = run_ranks(_run, 2, compressor)
    reference = _reference(2, compressor)
    for rank in ranks:
        _compare(rank, reference)
        for step in range(STEPS):  # every rank alike after every step
            for name, value in rank["weights"][step].items():
                assert torch.equal(value, ranks[0]["weights"][step][name]), (step, name)
        compressed = [c for c, *_ in rank["history"]]
        assert compressed == [False] * FREEZE + [True] * (STEPS - FREEZE)
        assert all(0 < sent < dense / 4 for c, sent, dense in rank["history"] if c)  # under a quarter of fp32


@pytest.mark.parametrize("compressor", ["ddp_onebit_adam", "ddp_topk_adam"])
def test_three_ranks_are_the_papers_loop_from_the_state_at_the_freeze(compressor: str) -> None:
    ranks = run_ranks(_run, 3, compressor)
    grads = [rank["grads"] for rank in ranks]
    reference = _reference(3, compressor, grads, ranks[0]["at_freeze"])
    for rank in ranks:
        _compare(rank, reference)


def _straight_and_restored(rank: int, world_size: int) -> dict:
    straight = _run(rank, world_size, "ddp_onebit_adam", bucket_cap_mb=0.0005)
    return {
        "straight": straight,
        **{f"stop {s}": _run(rank, world_size, "ddp_onebit_adam", s, bucket_cap_mb=0.0005) for s in (2, 4, 7)},
    }


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_run_restored_before_at_or_after_the_freeze_ends_where_the_straight_run_does(world_size: int) -> None:
    """Catches: residuals, the stage or the momentum's layout not restored (stop 7), the frozen variance taken again
    from a later step (stop 4: the state of the last warm-up step), and a warm-up average that depends on DDP's bucket
    layout (stop 2 on 3 ranks: a fresh DDP starts from its first layout; tiny buckets make several)."""
    for rank in run_ranks(_straight_and_restored, world_size):
        straight = rank["straight"]
        for stop in (2, 4, 7):
            restored = rank[f"stop {stop}"]
            for name, value in straight["weights"][-1].items():
                assert torch.equal(value, restored["weights"][-1][name]), (stop, name)
            for name, value in straight["adam"]["exchange"].items():
                assert torch.equal(value, restored["adam"]["exchange"][name]), (stop, name)
        assert straight["adam"]["exchange"]["worker_error"].abs().sum() > 0


class _VariableTopK(TopKCompressor):
    """Top-k that does not declare its payload's size (as a compressor whose size follows the data would not)."""

    def payload_nbytes(self, shape: torch.Size, dtype: torch.dtype) -> None:
        return None


def test_bad_arguments_and_other_optimizers_are_refused_by_name() -> None:
    model = _model()
    with pytest.raises(ValueError, match=r"takes torch\.optim\.Adam or torch\.optim\.AdamW; the optimizer is SGD"):
        CompressedAdam(torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ValueError, match=r"does not support amsgrad=True \(parameter group 0"):
        CompressedAdam(torch.optim.Adam(model.parameters(), amsgrad=True))
    adam = torch.optim.Adam(model.parameters())
    for arguments, message in (
        ({"freeze_step": 0}, "freeze_step"),
        ({"variance_refresh": "sometimes"}, "variance_refresh must be one of"),
        ({"compressor": "powersgd"}, "the two-phase average compresses flat pieces"),
        ({"compressor": _VariableTopK(0.1)}, "sends payloads whose size depends on the data"),
        ({"compressor": "terngrad"}, r"needs a tensor's own shape, a warm start or a scale shared over the ranks"),
        ({"compressor": "nope"}, "compressor must be one of"),
        ({"compressor": "topk", "compressor_kwargs": {"density": 2.0}}, "density"),
    ):
        with pytest.raises(ValueError, match=message):
            CompressedAdam(adam, **arguments)
        with pytest.raises(ValueError, match=message):
            GradCompAdamStrategy(**arguments)
    with pytest.raises(ValueError, match=r"installs its own communication hook; do not pass \['ddp_comm_hook'\]"):
        GradCompAdamStrategy(ddp_comm_hook=print)


def test_alone_it_compresses_nothing_and_is_adam_until_the_freeze() -> None:
    plain, ours = _model(), _model()
    reference, optimizer = _optimizer(plain), _optimizer(ours)
    adam = CompressedAdam(optimizer, freeze_step=3).install()
    for step in range(6):
        for model, opt in ((plain, reference), (ours, optimizer)):
            opt.zero_grad()
            _loss(model, 0, step).backward()
            opt.step()
        same = all(torch.equal(a, b) for a, b in zip(plain.parameters(), ours.parameters(), strict=True))
        assert same == (step < 3)  # AdamW itself until the freeze; then the frozen variance
    assert adam.phase == "compressed" and adam.frozen_at == 3 and adam.exchange is None


class Regression(pl.LightningModule):
    def __init__(self, optimizer: str = "adamw") -> None:
        super().__init__()
        self.net = _model()
        self.optimizer_name = optimizer

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        if self.optimizer_name == "sgd":
            return torch.optim.SGD(self.parameters(), lr=0.1)
        optimizer = _optimizer(self.net)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda t: 1.0 / (1 + 0.1 * t))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


EPOCH = 6  # steps per epoch per rank: the checkpoint at its end is past the freeze


def _data(world_size: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(5)
    x = torch.randint(0, 12, (16 * EPOCH * world_size, 3), generator=generator)
    return TensorDataset(x, torch.randn(len(x), 2, generator=generator))


def _fit(world_size: int, steps: int, **kwargs: Any) -> dict[str, Any]:
    pl.seed_everything(0, verbose=False)
    module = Regression(kwargs.pop("optimizer", "adamw"))
    strategy = GradCompAdamStrategy.from_preset("ddp_onebit_adam", freeze_step=kwargs.pop("freeze_step", FREEZE))
    monitor = CompressionMonitor(every_n_steps=steps, print_summary=False)
    trainer = quiet_trainer(strategy, world_size, steps, [monitor, *kwargs.pop("callbacks", [])])
    trainer.fit(module, DataLoader(_data(world_size), batch_size=16), **kwargs)
    adam = strategy.compressed_adam
    summary = monitor.summary[-1] if monitor.summary else None
    return {"weights": {k: v.detach().clone() for k, v in module.state_dict().items()},
            "adam": adam.state_dict() if adam is not None else None,
            "records": [s.bytes_sent for s in adam.history] if adam is not None else [],
            "monitor": (summary.steps, summary.bytes_sent) if summary is not None else None}  # fmt: skip


def _trainer_runs(rank: int, world_size: int, out: str) -> dict[str, Any]:
    checkpoint = ModelCheckpoint(dirpath=out, filename="half", every_n_train_steps=EPOCH, save_top_k=-1)
    straight = _fit(world_size, 2 * EPOCH)
    _fit(world_size, EPOCH, callbacks=[checkpoint])
    torch.distributed.barrier()
    resumed = _fit(world_size, 2 * EPOCH, ckpt_path=str(Path(out) / "half.ckpt"))
    refused = []
    for kwargs in ({"optimizer": "sgd"},):
        try:
            _fit(world_size, 2, **kwargs)
        except ValueError as error:
            refused.append(str(error))
    if rank == 0:  # said once, on rank 0
        with pytest.warns(UserWarning, match=r"none of the run's 3 steps was compressed \(freeze_step=50\)"):
            _fit(world_size, 3, freeze_step=50)
    else:
        _fit(world_size, 3, freeze_step=50)
    return {"straight": straight, "resumed": resumed, "refused": refused}


def test_the_trainer_strategy_resumes_exactly_refuses_other_optimizers_and_warns_when_never_compressed(
    tmp_path: Path,
) -> None:
    ranks = run_ranks(_trainer_runs, 2, str(tmp_path), init=False)
    for rank in ranks:
        for name, value in rank["straight"]["weights"].items():
            assert torch.equal(value, rank["resumed"]["weights"][name]), name
            assert torch.equal(value, ranks[0]["straight"]["weights"][name]), name  # every rank alike
        for name, value in rank["straight"]["adam"]["exchange"].items():
            assert torch.equal(value, rank["resumed"]["adam"]["exchange"][name]), name  # this rank's own residuals
        assert rank["straight"]["adam"]["frozen_at"] == FREEZE and rank["resumed"]["adam"]["steps"] == 2 * EPOCH
        steps, sent = rank["straight"]["monitor"]  # the monitor reads the records: all ranks' bytes per step
        total = sum(sum(r["straight"]["records"]) for r in ranks)
        assert steps == 2 * EPOCH and sent == pytest.approx(total / steps, rel=1e-12)
        assert rank["refused"] == [
            "GradCompAdamStrategy compresses Adam's momentum and takes torch.optim.Adam or torch.optim.AdamW; the "
            "optimizer is SGD"
        ]


def _fabric_run(rank: int, world_size: int, folder: str) -> dict[str, Any]:
    import lightning as L

    def start() -> tuple[Any, nn.Module, Any]:
        fabric = L.Fabric(accelerator="cpu", devices=world_size, strategy="ddp_onebit_adam")
        fabric.strategy.adam_arguments["freeze_step"] = FREEZE
        fabric.launch()
        model = _model()
        model, optimizer = fabric.setup(model, _optimizer(model))
        return fabric, model, optimizer

    def train(fabric: Any, model: nn.Module, optimizer: Any, steps: range) -> None:
        for step in steps:
            optimizer.zero_grad()
            fabric.backward(_loss(model, rank, step))
            optimizer.step()

    fabric, model, optimizer = start()
    train(fabric, model, optimizer, range(STEPS))
    straight = {k: v.detach().clone() for k, v in model.state_dict().items()}
    fabric, model, optimizer = start()
    train(fabric, model, optimizer, range(7))
    fabric.save(Path(folder) / "adam.ckpt", {"model": model, "optimizer": optimizer})
    fabric, model, optimizer = start()
    fabric.load(Path(folder) / "adam.ckpt", {"model": model, "optimizer": optimizer})
    train(fabric, model, optimizer, range(7, STEPS))
    return {"straight": straight, "resumed": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def test_fabric_trains_and_resumes_after_the_freeze_exactly(tmp_path: Path) -> None:
    ranks = run_ranks(_fabric_run, 2, str(tmp_path), init=False)
    for rank in ranks:
        for name, value in rank["straight"].items():
            assert torch.equal(value, rank["resumed"][name]), name
            assert torch.equal(value, ranks[0]["straight"][name]), name
