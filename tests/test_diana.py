"""DIANA memory: the update rules of Mishchenko et al. (2019), Algorithm 1, checked exactly."""

from __future__ import annotations

import pytest
import torch

from lightning_gradcomp.memory import Diana, build_memory


def test_shifts_follow_the_paper_updates_exactly() -> None:
    gen = torch.Generator().manual_seed(0)
    world, alpha = 3, 0.25
    memories = [Diana(alpha=alpha) for _ in range(world)]
    h_local = [torch.zeros(10) for _ in range(world)]
    h = torch.zeros(10)
    for _ in range(4):
        grads = [torch.randn(10, generator=gen) for _ in range(world)]
        deltas = []
        for rank, memory in enumerate(memories):
            x = memory.compensate("w", grads[rank])
            assert torch.equal(x, grads[rank] - h_local[rank])
            # a stand-in for an unbiased quantizer's output: any tensor works for the algebra
            deltas.append(x + torch.randn(10, generator=gen))
        mean = sum(deltas) / world
        for rank, memory in enumerate(memories):
            assert torch.equal(memory.reconstruct("w", mean), h + mean)
            memory.update("w", grads[rank] - h_local[rank], deltas[rank], mean)
        h_local = [hl + alpha * d for hl, d in zip(h_local, deltas, strict=True)]
        h = h + alpha * mean
        for rank, memory in enumerate(memories):
            local, shared = memory.shifts("w")
            torch.testing.assert_close(local, h_local[rank], rtol=0, atol=1e-6)
            torch.testing.assert_close(shared, h, rtol=0, atol=1e-6)
    # h stays the mean of the h_i on every rank (the paper's invariant)
    torch.testing.assert_close(memories[0].shifts("w")[1], sum(m.shifts("w")[0] for m in memories) / world)


def test_exact_compression_with_alpha_one_learns_the_gradient_in_one_step() -> None:
    memory = Diana(alpha=1.0)
    g = torch.tensor([1.0, -2.0, 3.0])
    x = memory.compensate("w", g)
    memory.update("w", x, x, x)  # lossless "quantizer", one rank
    assert torch.equal(memory.compensate("w", g), torch.zeros(3))  # nothing left to send
    assert torch.equal(memory.reconstruct("w", torch.zeros(3)), g)


def test_default_alpha_is_one_over_omega_plus_one() -> None:
    memory = Diana(variance_bound=lambda numel: numel**0.5 - 1)
    assert memory.alpha_for("w", 100) == pytest.approx(1 / 10)
    assert memory.alpha_for("b", 4) == pytest.approx(1 / 2)


@pytest.mark.parametrize("alpha", [0, -0.5, 1.01, float("nan"), True])
def test_alpha_outside_zero_one_is_rejected(alpha: object) -> None:
    with pytest.raises(ValueError, match=r"alpha must be a number in \(0, 1\]"):
        Diana(alpha=alpha)  # type: ignore[arg-type]


def test_state_round_trips() -> None:
    memory = Diana(alpha=0.5)
    x = memory.compensate("a.weight", torch.ones(4))
    memory.update("a.weight", x, x, 2 * x)
    restored = build_memory("diana", alpha=0.5)
    restored.load_state_dict(memory.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(restored.shifts("a.weight"), memory.shifts("a.weight"), strict=True))
    with pytest.raises(ValueError, match="unexpected DIANA state entry"):
        restored.load_state_dict({"bogus": torch.zeros(1)})
