"""DGC's momentum correction in error feedback (Lin et al., ICLR 2018, Sec. 3.2): equations and guard rails."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
from models import TinyClassifier, fit
from ranks import run_ranks

from lightning_gradcomp import GradCompStrategy
from lightning_gradcomp.core.compressors import SparseEntries
from lightning_gradcomp.core.memory import ErrorFeedback

TIMEOUT_S = 120


def _reference(grads: list[torch.Tensor], sent_indices: list[torch.Tensor], m: float) -> list[dict]:
    """DGC's Algorithm 1 written out: u = m u + g; v = v + u; send v at the indices; zero u and v there."""
    u, v, out = torch.zeros_like(grads[0]), torch.zeros_like(grads[0]), []
    for g, idx in zip(grads, sent_indices, strict=True):
        u = m * u + g
        v = v + u
        sent = torch.zeros_like(v).index_put_((idx,), v[idx])
        v, u = v.clone(), u.clone()
        v[idx], u[idx] = 0, 0
        out.append({"sent": sent, "residual": v, "velocity": u})
    return out


def test_momentum_correction_follows_dgc_algorithm_exactly() -> None:
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(50, generator=gen, dtype=torch.float64) for _ in range(4)]
    sent_indices = [torch.tensor([3, 7]), torch.tensor([7, 9, 11]), torch.tensor([0]), torch.tensor([3, 49])]
    expected = _reference(grads, sent_indices, 0.9)
    memory = ErrorFeedback(momentum=0.9)
    for g, idx, want in zip(grads, sent_indices, expected, strict=True):
        acc = memory.compensate_("w", g.clone())
        entries = SparseEntries(idx, acc[idx].clone(), acc.numel())
        torch.testing.assert_close(entries.to_dense(), want["sent"], rtol=1e-14, atol=1e-14)
        memory.update("w", acc, entries, acc)
        torch.testing.assert_close(memory.residual("w"), want["residual"], rtol=1e-14, atol=1e-14)
        torch.testing.assert_close(memory.velocity("w"), want["velocity"], rtol=1e-14, atol=1e-14)
        assert bool((memory.residual("w")[idx] == 0).all()) and bool((memory.velocity("w")[idx] == 0).all())


def test_momentum_zero_is_plain_error_feedback_and_state_round_trips() -> None:
    gen = torch.Generator().manual_seed(1)
    plain, corrected = ErrorFeedback(), ErrorFeedback(momentum=0.5)
    for _ in range(3):
        g = torch.randn(20, generator=gen)
        for memory in (plain, corrected):
            acc = memory.compensate_("w", g.clone())
            memory.update("w", acc, SparseEntries(torch.tensor([1, 2]), acc[[1, 2]].clone(), 20), acc)
    assert plain.velocity("w") is None and set(plain.state_dict()) == {"w"}
    assert set(corrected.state_dict()) == {"w", "velocity:w"}
    restored = ErrorFeedback(momentum=0.5)
    restored.load_state_dict(corrected.state_dict())
    assert torch.equal(restored.velocity("w"), corrected.velocity("w"))
    assert torch.equal(restored.residual("w"), corrected.residual("w"))
    with pytest.raises(ValueError, match="has momentum-correction velocities; this one has momentum 0"):
        ErrorFeedback().load_state_dict(corrected.state_dict())
    with pytest.raises(ValueError, match=r"momentum must be a number in \[0, 1\), got 1\.0"):
        ErrorFeedback(momentum=1.0)


def test_momentum_correction_needs_a_sparsifier() -> None:
    with pytest.raises(ValueError, match="is DGC's momentum correction for sparsifiers"):
        GradCompStrategy(compressor="terngrad", memory="ef", memory_kwargs={"momentum": 0.9})


class SplitMomentumClassifier(TinyClassifier):
    """Compressed weights without optimizer momentum, the dense rest with it (what momentum correction needs)."""

    def configure_optimizers(self) -> torch.optim.Optimizer:
        weights = [self.net[0].weight, self.net[2].weight]
        rest = [self.net[0].bias, self.net[2].bias]
        return torch.optim.SGD([{"params": weights, "momentum": 0.0}, {"params": rest, "momentum": 0.9}], lr=self.lr)


def _fit(rank: int, world_size: int, model_class: type[TinyClassifier]) -> dict:
    strategy = GradCompStrategy(compressor="topk", density=0.1, memory_kwargs={"momentum": 0.9},
                                min_compress_numel=100, timeout=timedelta(seconds=TIMEOUT_S))  # fmt: skip
    try:
        model, trainer = fit(strategy, world_size, 4, model_class=model_class)
    except ValueError as err:
        return {"error": str(err)}
    memory = trainer.strategy.memory
    return {"velocity": memory.velocity("net.0.weight").clone(), "weights": model.state_dict()}


def test_momentum_correction_refuses_optimizer_momentum_on_compressed_parameters() -> None:
    refused = run_ranks(_fit, 2, TinyClassifier, init=False)
    for r in refused:
        assert "parameter group 0 of SGD adds momentum 0.9 again to compressed parameters" in r["error"]
        assert "net.0.weight" in r["error"]
    trained = run_ranks(_fit, 2, SplitMomentumClassifier, init=False)
    for r in trained:
        assert r["velocity"].abs().sum() > 0
    assert all(torch.equal(trained[0]["weights"][k], trained[1]["weights"][k]) for k in trained[0]["weights"])
