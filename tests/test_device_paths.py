"""The paths the codecs and memories take on a device, run on the CPU (``cpu_as_a_device``): they must train exactly as
the CPU's own paths do, and keep a non-finite step out of the state without reading its finiteness back.

Two ranks over gloo train a 3-layer MLP for six steps, one of them with an infinity in one layer's gradient (the
optimizer skips that step, as ``GradScaler`` would); each preset runs once on the CPU's paths and once on the
device's. On the device's, whether a unit's mean is finite stays a tensor flag and the memory's update is kept by
it (``torch.where``), where the CPU reads a bool and skips the update.
"""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
from ranks import EveryRank, run_cases
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from lightning_gradcomp import NAMED_STRATEGIES, gradcomp_comm_hook, make_hook
from lightning_gradcomp.core.compressors.finiteness import all_of, finiteness, keep_where_, nonfinite_count
from lightning_gradcomp.core.host_waits import cpu_as_a_device, reads_wait

#: presets whose device path selects what the CPU's does (Gaussian_k's ladder of levels picks its own count, and
#: is checked for its invariants instead)
EXACT = ("ddp_topk", "ddp_gtopk", "ddp_efsign", "ddp_diana", "ddp_terngrad", "ddp_powersgd", "ddp_int8")
STEPS, BAD_STEP = 6, 3


def train(rank: int, preset: str, device_paths: bool) -> dict:
    """Six steps of ``preset`` on this rank (data drawn per rank); the last layer's gradient holds an infinity at
    ``BAD_STEP``, and that step is not applied."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 16))
    ddp = DistributedDataParallel(net, bucket_cap_mb=0.02)
    overrides = {"warmup_steps": 1, "min_compress_numel": 100, "keep_last_layer_dense": False}
    if NAMED_STRATEGIES[preset][1].get("adaptive"):
        overrides["adaptive"] = "none"
    hook = make_hook(ddp, preset, **overrides)
    ddp.register_comm_hook(hook, gradcomp_comm_hook)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.05)
    data = torch.Generator().manual_seed(100 + rank)
    poison = {"on": False}
    net[2].weight.register_hook(lambda g: g.index_fill(0, torch.tensor([3]), math.inf) if poison["on"] else g)
    nonfinite = 0
    with cpu_as_a_device() if device_paths else contextlib.nullcontext():
        for step in range(STEPS):
            x, y = torch.randn(16, 32, generator=data), torch.randn(16, 16, generator=data)
            poison["on"] = step == BAD_STEP
            optimizer.zero_grad()
            nn.functional.mse_loss(ddp(x), y).backward()
            if step != BAD_STEP:
                optimizer.step()
            counted = hook.history[-1].nonfinite_units
            nonfinite += int(counted)
            if step == BAD_STEP:
                kind = type(counted)
    return {
        "params": [p.detach().clone() for p in net.parameters()],
        "memory": {k: v.clone() for k, v in hook.memory.state_dict().items()},
        "nonfinite": nonfinite,
        "kind": kind.__name__,
    }


def every_case(rank: int, world_size: int) -> dict:
    cases = {
        (preset, device): (lambda r, w, preset=preset, device=device: train(r, preset, device))
        for preset in (*EXACT, "ddp_gaussiank")
        for device in (False, True)
    }
    return run_cases(rank, world_size, cases)


@pytest.mark.parametrize("preset", EXACT)
def test_the_device_paths_train_as_the_cpu_paths_and_keep_a_nonfinite_step_out(
    preset: str, every_rank: EveryRank
) -> None:
    """Catches: a memory update kept by the flag where it was false (the residual or shift would hold the infinity),
    one dropped where it was true, a count of non-finite units lost, and a device selection that differs."""
    cpu, device = every_rank(2, (preset, False)), every_rank(2, (preset, True))
    keeps_state = NAMED_STRATEGIES[preset][1]["memory"] != "none"
    for rank, (a, b) in enumerate(zip(cpu, device, strict=True)):
        assert all(torch.equal(p, q) for p, q in zip(a["params"], b["params"], strict=True)), (preset, rank)
        assert a["memory"].keys() == b["memory"].keys(), (preset, rank)
        for name, state in a["memory"].items():
            assert torch.equal(state, b["memory"][name]), (preset, rank, name)
            assert bool(state.isfinite().all()), (preset, rank, name)  # the infinity never entered the state
        assert a["nonfinite"] == b["nonfinite"] == (1 if keeps_state else 0), (preset, rank)
        assert a["kind"] == "int" and b["kind"] == ("Tensor" if keeps_state else "int"), (preset, rank)
    assert all(torch.equal(p, q) for p, q in zip(cpu[0]["params"], cpu[1]["params"], strict=True))  # ranks agree


def test_gaussian_k_on_the_device_path_keeps_its_state_finite_and_the_ranks_agreeing(every_rank: EveryRank) -> None:
    """Its ladder of levels picks its own count, so only the invariants hold: the ranks' parameters agree, the
    non-finite unit is counted once, and the residuals hold no infinity."""
    device = every_rank(2, ("ddp_gaussiank", True))
    assert all(torch.equal(p, q) for p, q in zip(device[0]["params"], device[1]["params"], strict=True))
    for result in device:
        assert result["nonfinite"] == 1 and result["kind"] == "Tensor"
        assert result["memory"] and all(bool(s.isfinite().all()) for s in result["memory"].values())


def test_flags_combine_as_bools_do_and_keep_selects_without_the_dropped_nan() -> None:
    t, f = torch.tensor(True), torch.tensor(False)
    assert all_of([True, True]) is True and all_of([True, t, False]) is False
    assert bool(all_of([t, True, t])) and not bool(all_of([t, f]))
    assert nonfinite_count(True) == 0 and nonfinite_count(False) == 1 and int(nonfinite_count(f)) == 1
    assert finiteness(torch.tensor([1.0, math.inf])) is False and finiteness(torch.empty(0)) is True
    with cpu_as_a_device():
        assert reads_wait(torch.device("cpu"))
        flag = finiteness(torch.tensor([1.0, math.nan], dtype=torch.float16))
        assert isinstance(flag, torch.Tensor) and flag.shape == () and not bool(flag)
        assert bool(finiteness(torch.full((4,), 60000.0, dtype=torch.float16)))  # summed in float32: no overflow
    assert not reads_wait(torch.device("cpu"))
    out = torch.tensor([1.0, 2.0])
    assert torch.equal(keep_where_(f, torch.tensor([math.nan, 5.0]), out), torch.tensor([1.0, 2.0]))
    assert torch.equal(keep_where_(t, torch.tensor([4.0, 5.0]), out), torch.tensor([4.0, 5.0]))
