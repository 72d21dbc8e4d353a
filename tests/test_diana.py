"""DIANA memory: the update rules of Mishchenko et al. (2019), Algorithm 1, checked exactly."""

from __future__ import annotations

import pytest
import torch
from ranks import run_ranks

from lightning_gradcomp.core.compressors import BlockQuantizer
from lightning_gradcomp.core.memory import Diana, build_memory


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
    assert memory.alpha_for(100) == pytest.approx(1 / 10)
    assert memory.alpha_for(4) == pytest.approx(1 / 2)


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


# --- The paper's headline (Sec. 5): batch-mode logistic regression on heterogeneous data. ---

FEATURES, PER_RANK, L2 = 20, 200, 1.0
RANKS = 4


def _logistic_data(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s shard: features shifted by a rank-specific mean, labels from one noisy teacher."""
    gen = torch.Generator().manual_seed(7)
    teacher = torch.randn(FEATURES, generator=gen, dtype=torch.float64)
    shifts = torch.randn(RANKS, FEATURES, generator=gen, dtype=torch.float64)
    gen = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(PER_RANK, FEATURES, generator=gen, dtype=torch.float64) + shifts[rank]
    noise = 0.5 * torch.randn(PER_RANK, generator=gen, dtype=torch.float64)
    return x, torch.sign(x @ teacher / FEATURES**0.5 + noise)


def _optimum() -> tuple[torch.Tensor, float]:
    """Newton's method on the full objective (mean of the ranks' losses) and its smoothness constant L."""
    x = torch.cat([_logistic_data(r)[0] for r in range(RANKS)])
    y = torch.cat([_logistic_data(r)[1] for r in range(RANKS)])
    w = torch.zeros(FEATURES, dtype=torch.float64)
    for _ in range(30):
        sig = torch.sigmoid(-y * (x @ w))
        grad = -(x * (y * sig)[:, None]).mean(0) + L2 * w
        hessian = (x * (sig * (1 - sig))[:, None]).T @ x / len(y) + L2 * torch.eye(FEATURES, dtype=torch.float64)
        w = w - torch.linalg.solve(hessian, grad)
    smoothness = max(
        float(torch.linalg.eigvalsh(xr.T @ xr / PER_RANK).max()) for xr, _ in map(_logistic_data, range(RANKS))
    )
    return w, 0.25 * smoothness + L2


def _batch_descent(rank: int, world_size: int, steps: int) -> dict[str, list[float]]:
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    from lightning_gradcomp.core.compressors import BlockQuantizer
    from lightning_gradcomp.core.memory import NoMemory
    from lightning_gradcomp.ddp.hook import GradCompHook, gradcomp_comm_hook

    x, y = _logistic_data(rank)
    w_star, smoothness = _optimum()
    quantizer = BlockQuantizer(p="inf", block_size=None)
    omega = quantizer.omega(FEATURES)
    step_size = 1.0 / ((1 + 2 * omega / world_size) * smoothness)  # the paper's gamma for DIANA
    curves = {}
    for label, memory in (("diana", Diana(variance_bound=quantizer.omega)), ("no memory", NoMemory())):
        model = nn.Linear(FEATURES, 1, bias=False).double()
        nn.init.zeros_(model.weight)
        ddp = DistributedDataParallel(model)
        hook = GradCompHook(quantizer, memory, "allgather", [("w", model.weight)], warmup_steps=0,
                            min_compress_numel=0, seed=3)  # fmt: skip
        ddp.register_comm_hook(hook, gradcomp_comm_hook)
        optimizer = torch.optim.SGD(model.parameters(), lr=step_size)
        distances = []
        for _ in range(steps):
            optimizer.zero_grad()
            margin = -y * ddp(x).squeeze(1)
            loss = nn.functional.softplus(margin).mean() + 0.5 * L2 * model.weight.pow(2).sum()
            loss.backward()
            optimizer.step()
            distances.append(float((model.weight.detach().squeeze(0) - w_star).norm() / w_star.norm()))
        curves[label] = distances
    return curves


def test_diana_converges_linearly_where_the_memoryless_quantizer_stalls() -> None:
    steps = 450
    results = run_ranks(_batch_descent, RANKS, steps)
    diana, plain = results[0]["diana"], results[0]["no memory"]
    print(f"\nrelative distance to the optimum after {steps} steps: DIANA {diana[-1]:.3e}, "
          f"no memory {plain[-1]:.3e} (min over the run {min(plain):.3e})")  # fmt: skip
    assert all(r["diana"] == diana for r in results)  # every rank holds the same model
    below = next(t for t, d in enumerate(diana) if d < 1e-6)
    print(f"DIANA below 1e-6 relative at step {below}; no-memory floor {min(plain[-150:]):.3e}")
    # DIANA keeps falling past 1e-6, by orders of magnitude (to float64's resolution): no noise floor
    assert diana[-1] < 1e-10
    # the memoryless quantizer stalls: no progress over the last quarter, orders of magnitude higher
    assert min(plain[-150:]) > 0.3 * min(plain)
    assert min(plain[-150:]) > 1e4 * 1e-6


def test_the_hooks_two_halves_with_encoded_codes_match_reconstruct_then_update() -> None:
    # The hook's path: Diana.settle_ adds this rank's codes into h_i without decoding them whole, the mean is
    # decoded over the bucket that held the compensated tensor, and Diana.conclude_ turns it into h + mean in
    # place while moving h; the numbers must be those of the plain reconstruct / dense update.
    quantizer = BlockQuantizer(block_size=16)
    gen = torch.Generator().manual_seed(0)
    fast, plain = Diana(alpha=0.3), Diana(alpha=0.3)
    for step in range(3):
        g = torch.randn(40, generator=gen)
        x = fast.compensate("w", g)
        assert torch.equal(x, plain.compensate("w", g))
        payload = quantizer.compress(x, torch.Generator().manual_seed(step))
        mean = torch.randn(40, generator=gen)
        expected = plain.reconstruct("w", mean).clone()
        plain.update("w", x, quantizer.decompress(payload), mean)
        bucket = x.clone()  # the hook's bucket holds the compensated tensor, then the mean over it
        fast.settle_("w", bucket, payload.entries(), unit_numel=40)
        fast.conclude_("w", bucket.copy_(mean), out=bucket, unit_numel=40, update=True)
        assert torch.equal(bucket, expected)
        assert all(torch.equal(a, b) for a, b in zip(fast.shifts("w"), plain.shifts("w"), strict=True))
    payload.scales[0] = float("inf")  # a non-finite local step moves h but leaves h_i alone
    before = fast.shifts("w")[0].clone()
    fast.settle_("w", x.clone(), payload.entries(), unit_numel=40)
    assert torch.equal(fast.shifts("w")[0], before)
