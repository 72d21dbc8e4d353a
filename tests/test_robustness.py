"""Lose nothing, hang never: non-finite gradients, misconfigured ranks, a dead rank, one rank, AMP."""

from __future__ import annotations

import os
import time
from datetime import timedelta

import lightning.pytorch as pl
import pytest
import torch
from models import TinyClassifier, fit, teacher_task
from ranks import run_ranks
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from lightning_gradcomp import GradCompStrategy
from lightning_gradcomp.core.compressors import TopKCompressor
from lightning_gradcomp.core.memory import ErrorFeedback
from lightning_gradcomp.ddp.hook import GradCompHook, gradcomp_comm_hook

TIMEOUT = timedelta(seconds=60)
NAN_STEP = 2


def _nan_on_one_rank(rank: int, world_size: int) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))
    ddp = DistributedDataParallel(model)
    memory = ErrorFeedback()
    hook = GradCompHook(TopKCompressor(0.05), memory, "allgather", list(model.named_parameters()),
                        warmup_steps=0, min_compress_numel=100)  # fmt: skip
    ddp.register_comm_hook(hook, gradcomp_comm_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = teacher_task(n=16 * 6).tensors
    before_nan = after_nan = None
    skipped = []
    for step in range(6):
        xb = x[step * 16 : (step + 1) * 16].clone()
        if step == NAN_STEP and rank == 1:
            xb[0, 0] = float("nan")
        optimizer.zero_grad()
        nn.functional.cross_entropy(ddp(xb), y[step * 16 : (step + 1) * 16]).backward()
        if step == NAN_STEP:
            after_nan = {k: v.clone() for k, v in memory.state_dict().items()}
        finite = all(torch.isfinite(p.grad).all() for p in model.parameters())
        skipped.append(not finite)
        if finite:  # what AMP's GradScaler does with an inf/NaN step: skip it
            optimizer.step()
        if step == NAN_STEP - 1:
            before_nan = {k: v.clone() for k, v in memory.state_dict().items()}
    return {
        "before": before_nan,
        "after": after_nan,
        "final": memory.state_dict(),
        "skipped": skipped,
        "nonfinite": [s.nonfinite_units for s in hook.history],
        "weights_finite": all(torch.isfinite(p).all() for p in model.parameters()),
    }


def test_nan_on_one_rank_leaves_every_residual_as_it_was() -> None:
    for r in run_ranks(_nan_on_one_rank, 2):
        assert r["skipped"] == [s == NAN_STEP for s in range(6)]  # both ranks saw the NaN average, as under DDP
        assert r["nonfinite"][NAN_STEP] == 2 and sum(r["nonfinite"]) == 2
        for name, residual in r["before"].items():
            assert torch.equal(r["after"][name], residual), name  # the NaN step did not touch the memory
        assert all(torch.isfinite(v).all() for v in r["final"].values())
        assert not all(torch.equal(r["final"][n], r["before"][n]) for n in r["final"])  # and it moved on after
        assert r["weights_finite"]


def _mismatched_density(rank: int, world_size: int) -> dict:
    start = time.monotonic()
    try:
        fit(GradCompStrategy(compressor="topk", density=0.01 * (rank + 1), timeout=TIMEOUT), world_size, 3)
    except ValueError as err:
        return {"error": str(err), "seconds": time.monotonic() - start}
    return {"error": None, "seconds": time.monotonic() - start}


def test_ranks_with_different_densities_fail_fast_with_a_clear_error() -> None:
    for r in run_ranks(_mismatched_density, 2, init=False):
        assert r["error"] is not None, "mismatched ranks trained anyway"
        assert "settings differ across ranks" in r["error"]
        assert "rank 0 has TopKCompressor(density=0.01), rank 1 has TopKCompressor(density=0.02)" in r["error"]
        assert r["seconds"] < 30


class DieAtStep(pl.Callback):
    def __init__(self, rank: int, step: int) -> None:
        self.rank, self.step = rank, step

    def on_train_batch_start(self, trainer: pl.Trainer, *args: object) -> None:
        if trainer.global_rank == self.rank and trainer.global_step == self.step:
            os._exit(3)


def _one_rank_dies(rank: int, world_size: int, timeout_s: int) -> None:
    strategy = GradCompStrategy(compressor="topk", density=0.05, timeout=timedelta(seconds=timeout_s))
    fit(strategy, world_size, 50, callbacks=[DieAtStep(rank=1, step=3)])


def test_survivors_of_a_killed_rank_fail_within_the_timeout() -> None:
    timeout_s = 10
    start = time.monotonic()
    with pytest.raises(AssertionError) as failure:
        run_ranks(_one_rank_dies, 2, timeout_s, init=False, timeout=timeout_s + 60)
    elapsed = time.monotonic() - start
    report = str(failure.value)
    assert "hung past" in report and "hung past 70 s: []" in report  # nobody had to be killed by the harness
    assert "--- rank 0 ---" in report and ("RuntimeError" in report or "DistBackendError" in report)
    assert elapsed < timeout_s + 60


def _single_rank(rank: int, world_size: int) -> dict:
    _, trainer = fit("ddp_topk", world_size, 5)
    hook = trainer.strategy.gradcomp_hook
    return {"calls": hook.calls, "history": list(hook.history), "residuals": trainer.strategy.memory.state_dict()}


def test_world_size_one_compresses_locally() -> None:
    (r,) = run_ranks(_single_rank, 1, init=False)
    assert r["calls"] >= 5 and len(r["history"]) == 5
    compressed = [s for s in r["history"] if s.compressed]
    # four compressed steps in Accordion's first (critical) interval: 4% of the entries each, logits dense
    assert len(compressed) == 4 and all(s.bytes_sent < s.dense_bytes for s in compressed)
    assert all(s.regime == "critical" and s.planned_density == 0.04 for s in compressed)
    assert all(s.selected == int(0.04 * s.numel_compressed) for s in compressed)
    assert r["residuals"] and all(torch.isfinite(v).all() for v in r["residuals"].values())


def _mixed_precision(rank: int, world_size: int, precision: str) -> dict:
    strategy = GradCompStrategy(compressor="topk", density=0.05, min_compress_numel=100, timeout=TIMEOUT)
    pl.seed_everything(0, verbose=False)
    model = TinyClassifier()
    trainer = pl.Trainer(accelerator="cpu", devices=world_size, strategy=strategy, max_steps=6, precision=precision,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)  # fmt: skip
    trainer.fit(model, DataLoader(teacher_task(), batch_size=16))
    return {
        "history": list(strategy.gradcomp_hook.history),
        "residuals": strategy.memory.state_dict(),
        "weights": {k: v.clone() for k, v in model.state_dict().items()},
    }


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_mixed_precision_trains_with_finite_state(precision: str) -> None:
    results = run_ranks(_mixed_precision, 2, precision, init=False)
    for r in results:
        assert sum(s.compressed for s in r["history"]) == 5
        assert all(torch.isfinite(v).all() for v in r["residuals"].values())
        assert all(torch.isfinite(v).all() for v in r["weights"].values())
    for name, value in results[0]["weights"].items():
        assert torch.equal(results[1]["weights"][name], value)
