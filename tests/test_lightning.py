"""End to end through Lightning on CPU/gloo: our hook runs, and 'none' is plain DDP bit for bit."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta

import pytest
import torch
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.strategies import DDPStrategy
from models import fit
from ranks import run_ranks

import lightning_gradcomp  # noqa: F401  (registers the named strategies)
from lightning_gradcomp import GradCompStrategy

TIMEOUT = timedelta(seconds=60)
STEPS = 6


def _weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _dense_vs_plain_ddp(rank: int, world_size: int) -> dict:
    """Plain DDP; the identity compressor without memory (the hook's shortcut to DDP's own allreduce); and the
    identity compressor with error feedback, which takes the full pipeline (units, memory, compressor, aggregator)."""
    plain, _ = fit(DDPStrategy(timeout=TIMEOUT), world_size, STEPS)
    out = {"plain": _weights(plain)}
    for label, memory in (("shortcut", "none"), ("pipeline", "ef")):
        strategy = GradCompStrategy(
            compressor="none",
            memory=memory,
            aggregator="allreduce",
            warmup_steps=0,
            min_compress_numel=256,
            timeout=TIMEOUT,
        )
        ours, trainer = fit(strategy, world_size, STEPS)
        hook = trainer.strategy.gradcomp_hook
        out[label] = {
            "weights": _weights(ours),
            "calls": hook.calls,
            "steps": hook.step,
            "compressed_steps": sum(s.compressed for s in hook.history),
            "warmup_steps": sum(s.warmup for s in hook.history),
            "residuals": [r.clone() for r in hook.memory.state_dict().values()],
        }
    return out


@pytest.fixture(scope="module")
def dense_runs() -> Callable[[int], list[dict]]:
    """``dense_runs(world_size)``: :func:`_dense_vs_plain_ddp` on every rank, launched once per world size."""
    launched: dict[int, list[dict]] = {}

    def runs(world_size: int) -> list[dict]:
        if world_size not in launched:
            launched[world_size] = run_ranks(_dense_vs_plain_ddp, world_size, init=False)
        return launched[world_size]

    return runs


@pytest.mark.parametrize("world_size", [2, 4])
def test_the_dense_baseline_is_plain_ddp_bit_for_bit_through_its_shortcut(world_size: int, dense_runs) -> None:
    """The identity compressor without memory hands each bucket to DDP's own scaled allreduce."""
    results = dense_runs(world_size)
    for rank, r in enumerate(results):
        ours = r["shortcut"]
        # every step past the warm-up, none through the pipeline: the shortcut, as StepStats tells
        assert ours["steps"] == STEPS and ours["warmup_steps"] == 0 and ours["compressed_steps"] == 0
        assert ours["calls"] >= STEPS
        assert r["plain"].keys() == ours["weights"].keys()
        for name in r["plain"]:
            assert torch.equal(r["plain"][name], ours["weights"][name]), f"rank {rank}: {name} differs from plain DDP"
        # the weights really moved, and every rank holds the same model
        assert torch.equal(ours["weights"]["net.0.weight"], results[0]["shortcut"]["weights"]["net.0.weight"])


@pytest.mark.parametrize("world_size", [2, 4])
def test_the_identity_compressor_through_the_full_pipeline_is_plain_ddp(world_size: int, dense_runs) -> None:
    """Catches: a pipeline that loses, mis-scales or mixes up units (the shortcut above never runs it)."""
    results = dense_runs(world_size)
    for rank, r in enumerate(results):
        ours = r["pipeline"]
        assert ours["steps"] == STEPS and ours["compressed_steps"] == STEPS  # every step through the pipeline
        # error feedback of an identity: what was sent is what was compensated, the residual exactly zero
        assert ours["residuals"] and all(not residual.any() for residual in ours["residuals"])
        for name in r["plain"]:
            if world_size == 2:  # a sum of two is the same in any order: the pipeline is DDP bit for bit
                assert torch.equal(r["plain"][name], ours["weights"][name]), f"rank {rank}: {name}"
            else:  # gloo's ring sums a unit's chunks starting from other ranks than DDP's bucket: 4 terms reordered
                torch.testing.assert_close(ours["weights"][name], r["plain"][name], rtol=0, atol=1e-7)
            assert torch.equal(ours["weights"][name], results[0]["pipeline"]["weights"][name])


class AttachedHookName(Callback):
    """Reads DDP's record of the attached comm hook while training runs (teardown unwraps DDP)."""

    def __init__(self) -> None:
        self.names: list[str | None] = []

    def on_train_batch_end(self, trainer: Trainer, *args: object) -> None:
        self.names.append(trainer.strategy.model._get_ddp_logging_data().get("comm_hook"))


def _fit_named_topk(rank: int, world_size: int) -> dict:
    plain_names = AttachedHookName()
    fit(DDPStrategy(timeout=TIMEOUT), world_size, 1, callbacks=[plain_names])
    names = AttachedHookName()
    model, trainer = fit("ddp_topk", world_size, STEPS, callbacks=[names])
    strategy = trainer.strategy
    hook = strategy.gradcomp_hook
    return {
        "strategy": type(strategy).__name__,
        "plain_comm_hook": plain_names.names,
        "comm_hook": names.names,
        "calls": hook.calls,
        "history": [(s.compressed, s.dense_bytes, s.bytes_sent, s.numel_compressed) for s in hook.history],
        "regimes": [(s.regime, s.planned_density) for s in hook.history],
        "residual_norm": float(sum(r.norm() ** 2 for r in hook.memory.state_dict().values()) ** 0.5),
        "weights": _weights(model),
    }


def test_named_topk_strategy_runs_its_hook_on_cpu() -> None:
    results = run_ranks(_fit_named_topk, 2, init=False)
    for r in results:
        assert r["strategy"] == "GradCompStrategy"
        assert r["plain_comm_hook"] == [None]  # Lightning's DDPStrategy attaches nothing on CPU
        assert r["comm_hook"] == ["gradcomp_comm_hook"] * STEPS
        assert r["calls"] >= STEPS
        assert len(r["history"]) == STEPS
        warm, *compressed = r["history"]
        assert warm[0] is False and warm[2] == warm[1]  # dense warm-up step: exactly DDP's bytes
        for is_compressed, dense_bytes, sent, numel_compressed in compressed:
            assert is_compressed and numel_compressed > 0
            assert sent < dense_bytes, (sent, dense_bytes)
        # the preset adapts: Accordion's first interval is critical, 4% of the entries a step, a fixed-size payload
        assert r["regimes"] == [("warmup", None)] + [("critical", 0.04)] * (STEPS - 1)
        assert len({s for _, _, s, _ in compressed}) == 1
        assert r["residual_norm"] > 0
    assert all(torch.equal(results[0]["weights"][k], results[1]["weights"][k]) for k in results[0]["weights"])


class DensityRecorder(Callback):
    def __init__(self) -> None:
        self.densities: list[tuple[int, float]] = []

    def on_train_batch_end(self, trainer: Trainer, *args: object) -> None:
        self.densities.append((trainer.current_epoch, trainer.strategy.compressor.density))


def _fit_schedule(rank: int, world_size: int) -> dict:
    recorder = DensityRecorder()
    strategy = GradCompStrategy(
        compressor="topk",
        density_schedule=[0.5, 0.01],
        keep_last_layer_dense=True,
        min_compress_numel=0,
        timeout=TIMEOUT,
    )
    # 1024 samples / (16 per batch * 2 ranks) = 32 steps per epoch: 40 steps reach epoch 1
    _, trainer = fit(strategy, world_size, 40, callbacks=[recorder])
    return {"densities": recorder.densities, "history": list(trainer.strategy.gradcomp_hook.history)}


def test_density_schedule_follows_epochs_and_last_layer_stays_dense() -> None:
    for r in run_ranks(_fit_schedule, 2, init=False):
        assert {d for e, d in r["densities"] if e == 0} == {0.5}
        assert {d for e, d in r["densities"] if e == 1} == {0.01}
        compressed = [s for s in r["history"] if s.compressed]
        assert all(s.numel_compressed == 32 * 64 + 64 for s in compressed)  # net.2 (the logits layer) is dense
        early, late = compressed[0].payload_bytes, compressed[-1].payload_bytes
        # per unit: the count, the indices (1024 of 2048 and 32 of 64: bitmaps of 256 and 8 bytes; 20 of 2048 and
        # 1 of 64: Elias-Fano, 22 and 2 bytes), the float32 values
        assert early == (8 + 256 + 4 * 1024) + (8 + 8 + 4 * 32), early
        assert late == (8 + 22 + 4 * 20) + (8 + 2 + 4 * 1), late
