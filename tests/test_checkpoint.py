"""Compression state is training state: every rank's state goes into the checkpoint and comes back."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from models import fit
from ranks import run_ranks

from lightning_gradcomp import GradCompStrategy

TIMEOUT = timedelta(seconds=60)
HALF = 4  # optimizer steps per epoch: the checkpoint lands on an epoch boundary
METHODS: dict[str, dict[str, Any]] = {
    "topk+ef": {"compressor": "topk", "density": 0.05, "memory": "ef"},
    "topk+ef/bucket": {"compressor": "topk", "density": 0.05, "memory": "ef", "granularity": "bucket"},
    "gtopk": {"compressor": "topk", "density": 0.05, "memory": "ef", "aggregator": "gtopk"},
    # random rounding: the per-rank generators' states must come back too
    "terngrad": {"compressor": "terngrad", "memory": "none", "aggregator": "allgather"},
    "diana": {"compressor": "quantizer", "memory": "diana", "aggregator": "allgather"},
}


def _strategy(method: str, **extra: Any) -> GradCompStrategy:
    return GradCompStrategy(min_compress_numel=100, timeout=TIMEOUT, **METHODS[method], **extra)


def _outcome(model: torch.nn.Module, strategy: GradCompStrategy) -> dict:
    return {
        "weights": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "memory": strategy.memory.state_dict(),
        "step": strategy.gradcomp_hook.step,
    }


def _straight(rank: int, world_size: int, out: str) -> dict:
    results = {}
    for method in METHODS:
        checkpoints = ModelCheckpoint(dirpath=Path(out) / method, filename="half", every_n_train_steps=HALF,
                                      save_top_k=-1)  # fmt: skip
        strategy = _strategy(method)
        model, _ = fit(strategy, world_size, 2 * HALF, samples=HALF * 16 * world_size, callbacks=[checkpoints])
        results[method] = _outcome(model, strategy)
    return results


def _resumed(rank: int, world_size: int, out: str) -> dict:
    results = {}
    for method in METHODS:
        strategy = _strategy(method)
        model, _ = fit(strategy, world_size, 2 * HALF, samples=HALF * 16 * world_size,
                       ckpt_path=str(Path(out) / method / "half.ckpt"))  # fmt: skip
        results[method] = _outcome(model, strategy)
    return results


@pytest.mark.parametrize("world_size", [2, 3])
def test_resume_is_bit_identical_to_training_straight_through(world_size: int, tmp_path: Path) -> None:
    straight = run_ranks(_straight, world_size, str(tmp_path), init=False)
    saved = torch.load(tmp_path / "topk+ef" / "half.ckpt", weights_only=False)["gradcomp"]
    assert saved["world_size"] == world_size and len(saved["ranks"]) == world_size
    assert all(r["memory_state"] for r in saved["ranks"])  # every rank's residuals, not rank 0's alone
    assert not torch.equal(saved["ranks"][0]["memory_state"]["net.0.weight"],
                           saved["ranks"][1]["memory_state"]["net.0.weight"])  # fmt: skip
    resumed = run_ranks(_resumed, world_size, str(tmp_path), init=False)
    for rank in range(world_size):
        for method in METHODS:
            a, b = straight[rank][method], resumed[rank][method]
            assert a["step"] == b["step"] == 2 * HALF
            assert a["memory"].keys() == b["memory"].keys()
            assert bool(a["memory"]) == (method != "terngrad")  # TernGrad is memoryless
            for name in a["memory"]:
                assert torch.equal(a["memory"][name], b["memory"][name]), f"{method} rank {rank}: {name}"
            for name in a["weights"]:
                assert torch.equal(a["weights"][name], b["weights"][name]), f"{method} rank {rank}: {name}"


def _resume_on_three(rank: int, world_size: int, ckpt: str, policy: str) -> dict:
    strategy = _strategy("topk+ef", on_world_size_change=policy)
    try:
        fit(strategy, world_size, 2 * HALF + 1, samples=HALF * 16 * world_size, ckpt_path=ckpt)
    except ValueError as err:
        return {"error": str(err)}
    return {"error": None, "memory": strategy.memory.state_dict(), "step": strategy.gradcomp_hook.step}


def _two_rank_checkpoint(rank: int, world_size: int, out: str) -> None:
    checkpoints = ModelCheckpoint(dirpath=out, filename="half", every_n_train_steps=HALF, save_top_k=-1)
    fit(_strategy("topk+ef"), world_size, HALF, samples=HALF * 16 * world_size, callbacks=[checkpoints])


def test_world_size_change_errors_by_default_and_resets_on_request(tmp_path: Path) -> None:
    run_ranks(_two_rank_checkpoint, 2, str(tmp_path), init=False)
    ckpt = str(tmp_path / "half.ckpt")
    for r in run_ranks(_resume_on_three, 3, ckpt, "error", init=False):
        assert r["error"] is not None
        assert "compression state of 2 ranks, but this run has 3" in r["error"]
        assert "on_world_size_change='reset'" in r["error"]
    for r in run_ranks(_resume_on_three, 3, ckpt, "reset", init=False):
        assert r["error"] is None
        assert r["step"] == 2 * HALF + 1 - HALF  # the hook counted only the steps of this run
