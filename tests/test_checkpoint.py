"""Compression state in checkpoints: one shard per rank, checked on resume, O(model) on rank 0.

Exact resume itself is tested in ``test_resume.py``; here: what is written where, what a bad or
foreign shard does, the older single-file format, a changed world size, and rank 0's memory.
"""

from __future__ import annotations

import gc
import hashlib
import re
import shutil
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy
from models import ShuffledClassifier, fit
from ranks import run_ranks
from torch import nn

from lightning_gradcomp import GradCompStrategy
from lightning_gradcomp.core.checkpoint import CHECKPOINT_KEY, shard_dir, shard_path

TIMEOUT = timedelta(seconds=60)
N = 4  # optimizer steps per epoch: checkpoints land on epoch boundaries


def _strategy(**extra: Any) -> GradCompStrategy:
    return GradCompStrategy(compressor="topk", density=0.05, min_compress_numel=100, timeout=TIMEOUT, **extra)


def _train_and_checkpoint(rank: int, world_size: int, out: str) -> None:
    """2 N steps with a checkpoint after N and 2 N (``step=4.ckpt``, ``step=8.ckpt``); in ``rolling/``
    only the latest is kept, with ``last.ckpt`` a link to it."""
    checkpoints = ModelCheckpoint(dirpath=out, filename="{step}", every_n_train_steps=N, save_top_k=-1)
    rolling = ModelCheckpoint(dirpath=Path(out) / "rolling", filename="{step}", every_n_train_steps=N, save_top_k=1,
                              monitor="step", mode="max", save_last="link")  # fmt: skip
    fit(_strategy(), world_size, 2 * N, samples=N * 16 * world_size, callbacks=[checkpoints, rolling],
        model_class=ShuffledClassifier)  # fmt: skip


def _resume_each(rank: int, world_size: int, ckpts: list[str], extra: dict) -> list[dict]:
    """Resume from each checkpoint in turn; the error message, or the state reached."""
    outcomes = []
    for ckpt in ckpts:
        strategy = _strategy(**extra)
        try:
            model, _ = fit(strategy, world_size, 3 * N, samples=N * 16 * world_size, ckpt_path=ckpt,
                           model_class=ShuffledClassifier)  # fmt: skip
        except ValueError as err:
            outcomes.append({"error": str(err)})
            continue
        outcomes.append({
            "error": None,
            "memory": strategy.memory.state_dict(),
            "step": strategy.gradcomp_hook.step,
            "weights": {k: v.clone() for k, v in model.state_dict().items()},
        })  # fmt: skip
    return outcomes


def _digest(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.rglob("*") if p.is_file()
    }


@pytest.fixture(scope="module")
def two_rank_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("checkpoints")
    run_ranks(_train_and_checkpoint, 2, str(out), init=False)
    return out


def test_each_rank_writes_its_own_shard_and_the_checkpoint_holds_a_manifest(two_rank_checkpoints: Path) -> None:
    ckpt = two_rank_checkpoints / "step=4.ckpt"
    manifest = torch.load(ckpt, weights_only=True)[CHECKPOINT_KEY]
    assert manifest["format"] == 2 and manifest["world_size"] == 2
    assert manifest["memory"] == "ef" and manifest["compressor"] == "topk"
    assert sorted(p.name for p in Path(shard_dir(ckpt)).iterdir()) == ["rank00000-of-00002.pt", "rank00001-of-00002.pt"]
    shards = [torch.load(shard_path(ckpt, r, 2), weights_only=True) for r in range(2)]
    for rank, shard in enumerate(shards):
        assert shard["rank"] == rank and shard["world_size"] == 2 and shard["tag"] == manifest["tag"]
        # Top-k carries no warm start, its schedule (the warm-ups) no state but its name
        assert shard["hook"] == {"step": N, "warm_starts": {}, "schedule": {"name": "warmup"}}
        assert set(shard["memory_state"]) == {"stem.weight", "body.weight", "head.weight"}
    assert not torch.equal(shards[0]["memory_state"]["body.weight"], shards[1]["memory_state"]["body.weight"])
    later = torch.load(two_rank_checkpoints / "step=8.ckpt", weights_only=True)[CHECKPOINT_KEY]
    assert later["tag"] != manifest["tag"]  # every save has its own tag
    # ModelCheckpoint(save_top_k=1) removed the older checkpoint and its shards; last.ckpt is a link
    rolling = two_rank_checkpoints / "rolling"
    assert sorted(p.name for p in rolling.iterdir()) == ["last.ckpt", "step=8.ckpt", "step=8.ckpt.gradcomp"]
    assert (rolling / "last.ckpt").is_symlink()


def test_missing_corrupted_or_foreign_shards_fail_on_every_rank_naming_the_file(
    two_rank_checkpoints: Path, tmp_path: Path
) -> None:
    """Also catches: a rank whose own shard is fine going on alone to the first collective (the other waits there until
    the process group's timeout) when the other's shard holds state this run refuses (another schedule's)."""
    cases = {}
    for case in ("missing", "corrupted", "foreign", "copied", "refused"):
        shutil.copy(two_rank_checkpoints / "step=4.ckpt", tmp_path / f"{case}.ckpt")
        shutil.copytree(shard_dir(two_rank_checkpoints / "step=4.ckpt"), shard_dir(tmp_path / f"{case}.ckpt"))
        cases[case] = tmp_path / f"{case}.ckpt"
    Path(shard_path(cases["missing"], 1, 2)).unlink()
    Path(shard_path(cases["corrupted"], 0, 2)).write_bytes(b"not a torch file")
    shutil.copy(shard_path(two_rank_checkpoints / "step=8.ckpt", 1, 2), shard_path(cases["foreign"], 1, 2))
    refused = torch.load(shard_path(cases["refused"], 1, 2), weights_only=True)
    refused["hook"]["schedule"]["name"] = "accordion"  # rank 1's alone: read, it is refused by rank 1 only
    torch.save(refused, shard_path(cases["refused"], 1, 2))
    before = _digest(tmp_path)
    linked = two_rank_checkpoints / "rolling" / "last.ckpt"  # its shards are beside the file it links to
    outcomes = run_ranks(_resume_each, 2, [*map(str, cases.values()), str(linked)], {}, init=False)
    assert _digest(tmp_path) == before  # nothing was written or removed
    for rank_outcomes in outcomes:
        missing, corrupted, foreign, copied, refused, last = rank_outcomes
        assert refused["error"].startswith("the checkpoint holds the state of the 'accordion' schedule, but this run")
        assert refused["error"].endswith("(on rank 1)")
        assert last["error"] is None and last["step"] == 3 * N
        assert "the compression state of rank 1 is missing" in missing["error"]
        assert shard_path(cases["missing"], 1, 2) in missing["error"]
        assert (
            f"the compression-state shard {shard_path(cases['corrupted'], 0, 2)} cannot be read" in corrupted["error"]
        )
        assert (
            f"the compression-state shard {shard_path(cases['foreign'], 1, 2)} belongs to another checkpoint"
            in (foreign["error"])
        )
        assert copied["error"] is None and copied["step"] == 3 * N  # a checkpoint copied elsewhere with its folder


def test_older_single_file_checkpoints_still_load(two_rank_checkpoints: Path, tmp_path: Path) -> None:
    """Format 1 kept every rank's state inline (gathered to rank 0), with generator states in the hook's."""
    source = two_rank_checkpoints / "step=4.ckpt"
    checkpoint = torch.load(source, weights_only=True)
    ranks = [torch.load(shard_path(source, r, 2), weights_only=True) for r in range(2)]
    checkpoint[CHECKPOINT_KEY] = {
        "world_size": 2,
        "ranks": [
            {"memory": "ef", "memory_state": s["memory_state"], "hook": {**s["hook"], "generators": {}}} for s in ranks
        ],
    }
    torch.save(checkpoint, tmp_path / "old.ckpt")
    old, new = run_ranks(_resume_each, 2, [str(tmp_path / "old.ckpt"), str(source)], {}, init=False)[1]
    assert old["error"] is None and new["error"] is None
    for name in new["memory"]:
        assert torch.equal(old["memory"][name], new["memory"][name])
    for name in new["weights"]:
        assert torch.equal(old["weights"][name], new["weights"][name])


def test_changed_memory_is_refused_by_name(two_rank_checkpoints: Path) -> None:
    ckpt = str(two_rank_checkpoints / "step=4.ckpt")
    for outcome in run_ranks(_resume_each, 2, [ckpt], {"memory": "none"}, init=False):
        assert "holds compression state of memory='ef', but this run uses memory='none'" in outcome[0]["error"]


def test_world_size_change_errors_by_default_and_resets_on_request(two_rank_checkpoints: Path) -> None:
    ckpt = str(two_rank_checkpoints / "step=4.ckpt")
    for r in run_ranks(_resume_each, 3, [ckpt], {"on_world_size_change": "error"}, init=False):
        assert "compression state of 2 ranks, but this run has 3" in r[0]["error"]
        assert "on_world_size_change='reset'" in r[0]["error"]
    for r in run_ranks(_resume_each, 3, [ckpt], {"on_world_size_change": "reset"}, init=False):
        assert r[0]["error"] is None
        assert r[0]["step"] == 3 * N - N  # the hook counted only the steps of this run


class _Wide(pl.LightningModule):
    """One 1024 x 2048 layer: 8 MiB of float32, so one rank's residual is 8 MiB."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(1024, 2048, bias=False)

    def training_step(self, batch: tuple[torch.Tensor, ...], batch_idx: int) -> torch.Tensor:
        return self.layer(batch[0]).square().mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _kib(field: str) -> int:
    return int(re.search(rf"{field}:\s+(\d+)", Path("/proc/self/status").read_text()).group(1))


def _peak_while_saving(rank: int, world_size: int, out: str, label: str) -> dict:
    """Rank 0's peak resident growth while saving, in fresh processes (freed pages would hide a second save's)."""
    strategy = DDPStrategy(timeout=TIMEOUT) if label == "ddp" else _strategy()
    trainer = pl.Trainer(accelerator="cpu", devices=world_size, strategy=strategy, max_steps=2, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)  # fmt: skip
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(64, 1024)), batch_size=4)
    trainer.fit(_Wide(), data)
    trainer.strategy.barrier()
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # reset this process's peak resident size
    before = _kib("VmRSS")
    trainer.save_checkpoint(Path(out) / f"{label}.ckpt")
    state = strategy.memory.state_dict().values() if label != "ddp" else []
    return {"peak_kib": _kib("VmHWM") - before, "state_kib": sum(t.numel() * t.element_size() for t in state) / 1024}


def test_rank_zero_saving_costs_one_state_not_one_per_rank(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # large blocks straight from mmap, returned on free: the peak resident size then follows live memory
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", str(1 << 16))
    ddp = run_ranks(_peak_while_saving, 3, str(tmp_path), "ddp", init=False, fresh=True)[0]
    ours = run_ranks(_peak_while_saving, 3, str(tmp_path), "gradcomp", init=False, fresh=True)[0]
    state = ours["state_kib"]
    assert state >= 8 * 1024  # the 8 MiB residual exists on every rank
    extra = ours["peak_kib"] - ddp["peak_kib"]
    print(f"rank 0 peak growth while saving: plain DDP {ddp['peak_kib']} KiB, gradcomp {ours['peak_kib']} KiB; "
          f"one rank's state {state:.0f} KiB")  # fmt: skip
    # Gathering every rank's state would put 2 more residuals (16 MiB) in rank 0's memory, and even a
    # copy of its own one more 8 MiB; each rank streaming its own shard from where it lies adds about
    # nothing to what Lightning's save costs anyway (measured: under 0.3 MiB).
    assert extra <= state / 4, (ddp, ours)
    assert len(list(Path(shard_dir(tmp_path / "gradcomp.ckpt")).iterdir())) == 3
