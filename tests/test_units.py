"""Units and random streams: constants follow the unit as compressed; draws depend on (seed, rank, step, unit)."""

from __future__ import annotations

import pytest
import torch
from ranks import EveryRank, run_cases
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from lightning_gradcomp.core.compressors import BlockQuantizer, TernGradCompressor
from lightning_gradcomp.core.memory import Diana, NoMemory
from lightning_gradcomp.core.randomness import UnitStreams, stream_seed
from lightning_gradcomp.ddp.hook import GradCompHook, gradcomp_comm_hook

STEPS = 3


def _model() -> nn.Module:
    torch.manual_seed(0)
    # a 300-element parameter next to a 100k one, as in the issue that found alpha off the bound
    return nn.Sequential(nn.Linear(32, 3125), nn.ReLU(), nn.Linear(3125, 1, bias=False), nn.Linear(1, 300))


def _train(rank: int, world_size: int, hook_for: object) -> tuple[nn.Module, GradCompHook]:
    model = _model()
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.1)
    hook = hook_for(model)
    ddp.register_comm_hook(hook, gradcomp_comm_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(rank)
    for _ in range(STEPS):
        optimizer.zero_grad()
        ddp(torch.randn(8, 32, generator=gen)).square().mean().backward()
        optimizer.step()
    return model, hook


def _diana_alphas(rank: int, world_size: int, granularity: str, block_size: int | None) -> dict:
    quantizer = BlockQuantizer(p="inf", block_size=block_size)
    memory = Diana(variance_bound=quantizer.omega)

    def hook_for(model: nn.Module) -> GradCompHook:
        return GradCompHook(quantizer, memory, "allgather", list(model.named_parameters()),
                            granularity=granularity, warmup_steps=0, min_compress_numel=100,
                            unit_cap_mb=0.05)  # fmt: skip

    _, hook = _train(rank, world_size, hook_for)
    units = {name: unit.numel for unit in hook.units if unit.compressed for name in unit.names}
    return {"alphas": dict(memory.alphas), "units": units}


def _terngrad_weights(rank: int, world_size: int, seed: int) -> dict:
    def hook_for(model: nn.Module) -> GradCompHook:
        return GradCompHook(TernGradCompressor(), NoMemory(), "allgather", list(model.named_parameters()),
                            warmup_steps=0, min_compress_numel=100, seed=seed)  # fmt: skip

    model, _ = _train(rank, world_size, hook_for)
    return {k: v.clone() for k, v in model.state_dict().items()}


def every_case(rank: int, world_size: int) -> dict:
    cases = {
        ("alphas", granularity, block): lambda r, w, g=granularity, b=block: _diana_alphas(r, w, g, b)
        for granularity in ("layer", "model", "group")
        for block in (None, 1024)
    }
    cases["terngrad"] = lambda r, w: [_terngrad_weights(r, w, seed) for seed in (0, 0, 1)]
    return run_cases(rank, world_size, cases)


@pytest.mark.parametrize("granularity", ["layer", "model", "group"])
@pytest.mark.parametrize("block_size", [None, 1024])
def test_diana_alpha_is_one_over_omega_plus_one_of_the_unit_as_compressed(
    granularity: str, block_size: int | None, every_rank: EveryRank
) -> None:
    quantizer = BlockQuantizer(p="inf", block_size=block_size)
    for case in every_rank(2, ("alphas", granularity, block_size)):
        assert set(case["alphas"]) == {"0.weight", "0.bias", "2.weight", "3.weight", "3.bias"}
        for name, alpha in case["alphas"].items():
            bound = 1.0 / (quantizer.omega(case["units"][name]) + 1.0)
            assert alpha == pytest.approx(bound, rel=1e-12), name  # the paper's choice, at the bound
        if granularity == "layer":
            assert case["units"]["3.weight"] == 300
        if granularity == "model":
            assert len(set(case["units"].values())) == 1 and case["units"]["3.weight"] == 100000 + 2 * 3125 + 2 * 300
        if block_size is None and granularity != "layer":
            # the 300-element parameter shares its unit's single block: its alpha is the unit's, far smaller
            assert case["alphas"]["3.weight"] < 1.0 / (quantizer.omega(300) + 1.0) / 2


def test_same_seed_same_weights_other_seed_other_terngrad_draws(every_rank: EveryRank) -> None:
    for first, again, other in every_rank(2, "terngrad"):
        for name in first:
            assert torch.equal(first[name], again[name]), name
        assert not torch.equal(first["0.weight"], other["0.weight"])


def test_streams_are_a_pure_function_of_seed_rank_step_and_unit() -> None:
    streams, fresh = UnitStreams(seed=7, rank=1), UnitStreams(seed=7, rank=1)
    cpu = torch.device("cpu")
    a = streams.generator(cpu, 5, 123).uniform(1000)
    streams.generator(cpu, 5, 999).uniform(1000)  # another unit in between changes nothing
    assert torch.equal(streams.generator(cpu, 5, 123).uniform(1000), a)
    assert torch.equal(fresh.generator(cpu, 5, 123).uniform(1000), a)  # nor a restart
    base = stream_seed(7, 1, 5, 123)
    others = {
        stream_seed(8, 1, 5, 123),
        stream_seed(7, 0, 5, 123),
        stream_seed(7, 1, 6, 123),
        stream_seed(7, 1, 5, 124),
    }
    assert base not in others and len(others) == 4
    assert all(0 <= s < 2**63 for s in others | {base})
