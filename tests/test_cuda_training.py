"""Every compressor, memory and named strategy on a CUDA device, against the CPU (skipped where no GPU is present).

Run with ``pytest -m cuda`` on a machine with a GPU. What is deterministic (the identity, Top-k's selections, the
scaled signs, PowerSGD from the same ``Q``) matches the CPU's result within the precision another summation order
explains; what draws random numbers draws the same counter-hash bits on both devices, and is also checked for what
it promises on the device: an unbiased compressor's mean over many draws is the gradient within a few standard errors
of the draws' own spread. A 1-process NCCL DDP trains with every named strategy and ends within float precision of the
same run on the CPU over gloo where the strategy draws nothing (relative distance of each tensor: another summation
order may tip a selection at its boundary), and with its loss fallen and its memory on the device in every case.
The helpers take the device: one test runs them on the CPU here, so they stay in working order where no GPU is.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from lightning_gradcomp import NAMED_STRATEGIES, gradcomp_comm_hook, make_hook
from lightning_gradcomp.core.compressors import COMPRESSORS
from lightning_gradcomp.core.host_waits import host_waits
from lightning_gradcomp.core.memory import Diana, ErrorFeedback
from lightning_gradcomp.core.randomness import CounterStream


def on_cuda(test: Callable) -> Callable:
    """Mark ``test`` as a CUDA test, skipped where no GPU is present."""
    return pytest.mark.cuda(pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")(test))


#: compressors whose result depends on no random draw (PowerSGD given the same ``Q``)
DETERMINISTIC = ("none", "topk", "sign", "powersgd")
#: compressors that promise ``E[C(x)] = x``
UNBIASED = ("randomk", "terngrad", "quantizer", "qsgd", "atomo")
DRAWS = 400
#: strategies whose steps draw no random number once PowerSGD's Q is given (the same on both devices)
SAME_ON_BOTH = ("ddp_gradcomp_dense", "ddp_fp16", "ddp_bf16", "ddp_topk", "ddp_gtopk", "ddp_efsign")


def compress_once(name: str, x: torch.Tensor, seed: int) -> tuple[torch.Tensor, int]:
    """``decompress(compress(x))`` with compressor ``name``'s defaults on ``x``'s device, and the payload's bytes
    (PowerSGD from a ``Q`` drawn on the CPU from ``seed``, so both devices start from the same one)."""
    compressor = COMPRESSORS[name]()
    generator = CounterStream(seed, x.device)  # the same bits on both devices
    extra: dict = {}
    if compressor.shares_scale:
        scale = compressor.local_scale(x)
        extra.update(scale=scale, local_scale=scale)
    if compressor.warm_started:
        state = compressor.initial_state([x.shape], x.dtype, torch.device("cpu"), torch.Generator().manual_seed(seed))
        extra["warm_start"] = state.to(x.device)
    if compressor.takes_shapes:
        extra["shapes"] = (x.shape,)
    payload = compressor.compress(x.clone(), generator, **extra)
    if compressor.name == "powersgd":  # its rounds, each an allreduce of one rank: the sum is the summand
        total = compressor.summable(payload, 1)
        while (following := compressor.next_summable(payload, total.clone(), 1)) is not None:
            total = following
        out = compressor.from_sum(total.clone(), payload, 1)
    else:
        out = compressor.decompress(payload)
    assert out.device == x.device and out.dtype == x.dtype and out.numel() == x.numel(), name
    return out.view(x.shape), payload.nbytes


def unbiased_z_scores(name: str, x: torch.Tensor) -> torch.Tensor:
    """Per element, (mean of ``DRAWS`` compressions - x) / (the draws' standard deviation / sqrt(DRAWS)), where
    the draws vary."""
    draws = torch.stack([compress_once(name, x, seed)[0] for seed in range(DRAWS)]).double()
    spread = draws.std(dim=0) / DRAWS**0.5
    varies = spread > 0
    return ((draws.mean(dim=0) - x.double()) / spread)[varies]


def memories_after_a_step(device: torch.device) -> dict[str, torch.Tensor]:
    """Error feedback's residual and DIANA's shifts after one compressed step of a gradient on ``device``."""
    g = torch.randn(64, 96, generator=torch.Generator().manual_seed(3)).to(device).view(-1)
    states = {}
    for memory in (ErrorFeedback(momentum=0.9), Diana(alpha=0.5)):
        x = memory.compensate_("w", g.clone())
        sent = torch.where(x.abs() > x.abs().median(), x, torch.zeros_like(x))  # what a compressor kept
        memory.update("w", x, sent, sent)
        states.update({f"{memory.name}:{k}": v for k, v in memory.state_dict().items()})
    return states


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(32, 256)
        self.middle = nn.Linear(256, 256)
        self.head = nn.Linear(256, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.middle(torch.relu(self.body(x)))))


def train_one_process(preset: str, device: torch.device, group: dist.ProcessGroup, steps: int = 6) -> dict:
    """``steps`` steps of a 1-process DDP on ``device`` over ``group`` with ``preset`` (compressing from step 2)."""
    torch.manual_seed(0)
    model = Net().to(device)
    ddp = DistributedDataParallel(
        model, device_ids=[device] if device.type == "cuda" else None, process_group=group, bucket_cap_mb=0.1
    )
    overrides = {"warmup_steps": 1, "min_compress_numel": 100}
    if NAMED_STRATEGIES[preset][1].get("adaptive"):
        overrides["adaptive"] = "none"
    hook = make_hook(ddp, preset, **overrides)
    ddp.register_comm_hook(hook, gradcomp_comm_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(64, 32, generator=gen), torch.randint(0, 4, (64,), generator=gen)
    x, y = x.to(device), y.to(device)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(ddp(x), y)
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    state = [*hook.memory.state_dict().values(), *hook.warm_starts.state_dict().values()]
    return {
        "weights": {k: v.detach().cpu() for k, v in model.state_dict().items()},
        "losses": losses,
        "devices": {t.device.type for t in hook.memory.state_dict().values()},
        "memory_entries": len(hook.memory.state_dict()),
        "compressed": sum(s.compressed for s in hook.history),
        "state": len(state),
    }


@pytest.fixture(scope="module")
def groups() -> dict[str, dist.ProcessGroup]:
    """A 1-process world over NCCL, and a gloo group over the same world for the CPU runs."""
    with tempfile.TemporaryDirectory() as directory:
        store = dist.FileStore(os.path.join(directory, "store"), 1)
        dist.init_process_group("nccl", store=store, rank=0, world_size=1, timeout=timedelta(seconds=120))
        try:
            yield {"cuda": dist.group.WORLD, "cpu": dist.new_group(backend="gloo")}
        finally:
            dist.destroy_process_group()


@on_cuda
@pytest.mark.parametrize("name", sorted(COMPRESSORS))
def test_each_compressor_on_the_device_gives_the_cpus_result_or_keeps_its_promise(name: str) -> None:
    x = torch.randn(64, 96, generator=torch.Generator().manual_seed(2))
    on_device, device_bytes = compress_once(name, x.cuda(), seed=0)
    on_cpu, cpu_bytes = compress_once(name, x, seed=0)
    assert device_bytes == cpu_bytes, name
    if name in DETERMINISTIC:
        torch.testing.assert_close(on_device.cpu(), on_cpu, rtol=1e-4, atol=1e-5)
    if name in UNBIASED:
        z = unbiased_z_scores(name, x.cuda())
        # on the CPU: max |z| 3.0-5.3 and mean z^2 1.03-1.30 (a rare nonzero draw makes the tails heavy); a code,
        # scale or draw gone wrong on the device moves the mean by many standard errors
        assert z.numel() > 0 and float(z.abs().max()) < 8.0 and float(z.square().mean()) < 2.0, name


@on_cuda
def test_memories_keep_their_state_on_the_device_as_on_the_cpu() -> None:
    on_device, on_cpu = memories_after_a_step(torch.device("cuda")), memories_after_a_step(torch.device("cpu"))
    assert on_device.keys() == on_cpu.keys() and on_device
    for key, value in on_device.items():
        assert value.device.type == "cuda", key
        torch.testing.assert_close(value.cpu(), on_cpu[key], msg=key)


@on_cuda
@pytest.mark.parametrize("preset", sorted(NAMED_STRATEGIES))
def test_every_named_strategy_trains_a_one_process_nccl_ddp_as_on_the_cpu(
    preset: str, groups: dict[str, dist.ProcessGroup]
) -> None:
    on_device = train_one_process(preset, torch.device("cuda"), groups["cuda"])
    assert on_device["devices"] == ({"cuda"} if on_device["memory_entries"] else set()), preset
    assert on_device["losses"][-1] < on_device["losses"][0], preset
    if preset != "ddp_gradcomp_dense":
        assert on_device["compressed"] == 5, preset
    if preset in SAME_ON_BOTH:
        on_cpu = train_one_process(preset, torch.device("cpu"), groups["cpu"])
        for key, value in on_device["weights"].items():
            # relative distance, not elementwise: another summation order may tip a selection at its boundary
            expected = on_cpu["weights"][key]
            assert float((value - expected).norm() / expected.norm()) < 1e-4, f"{preset}: {key}"


def waits_in_a_step(preset: str | None, group: dist.ProcessGroup) -> int:
    """Host waits in one compressed step of a 1-process NCCL DDP of :class:`Net` under ``preset`` (``None``: plain
    DDP), after three steps (the first dense)."""
    torch.manual_seed(0)
    model = Net().cuda()
    ddp = DistributedDataParallel(model, device_ids=[torch.device("cuda")], process_group=group, bucket_cap_mb=0.1)
    if preset is not None:
        overrides = {"warmup_steps": 1, "min_compress_numel": 100}
        if NAMED_STRATEGIES[preset][1].get("adaptive"):
            overrides["adaptive"] = "none"
        ddp.register_comm_hook(make_hook(ddp, preset, **overrides), gradcomp_comm_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = torch.randn(64, 32, device="cuda"), torch.randint(0, 4, (64,), device="cuda")

    def step() -> None:
        optimizer.zero_grad()
        nn.functional.cross_entropy(ddp(x), y).backward()
        optimizer.step()

    for _ in range(3):
        step()
    waits = host_waits(step, "cuda")
    assert waits is not None
    return waits


@on_cuda
@pytest.mark.parametrize(
    "preset", ["ddp_fp16", "ddp_bf16", "ddp_int8", "ddp_terngrad", "ddp_efsign", "ddp_diana", "ddp_powersgd"]
)
def test_a_compressed_step_waits_for_the_device_no_more_than_plain_ddp(
    preset: str, groups: dict[str, dist.ProcessGroup]
) -> None:
    """What tests/test_read_backs.py counts on the CPU on the paths a device takes (none for these), counted on the
    device: the finiteness of each mean stays there as a flag, and nothing else is read back."""
    assert waits_in_a_step(preset, groups["cuda"]) == waits_in_a_step(None, groups["cuda"]), preset


def _helpers_on_one_cpu_rank(rank: int, world_size: int) -> dict:
    cpu = torch.device("cpu")
    x = torch.randn(64, 96, generator=torch.Generator().manual_seed(2))
    return {
        "bytes": {name: compress_once(name, x, seed=0)[1] for name in sorted(COMPRESSORS)},
        "z": {name: unbiased_z_scores(name, x) for name in ("terngrad", "qsgd")},
        "memories": sorted(memories_after_a_step(cpu)),
        "runs": {preset: train_one_process(preset, cpu, dist.group.WORLD) for preset in ("ddp_topk", "ddp_diana")},
    }


def test_the_device_checks_run_on_the_cpu() -> None:
    from ranks import run_ranks

    (result,) = run_ranks(_helpers_on_one_cpu_rank, 1)
    assert result["bytes"]["none"] == 64 * 96 * 4 and result["bytes"]["topk"] < result["bytes"]["terngrad"]
    for name, z in result["z"].items():
        assert float(z.abs().max()) < 8.0 and float(z.square().mean()) < 2.0, name
    assert result["memories"] == ["diana:h/w", "diana:h_local/w", "ef:velocity:w", "ef:w"]
    for preset, run in result["runs"].items():
        assert run["compressed"] == 5 and run["losses"][-1] < run["losses"][0] and run["devices"] == {"cpu"}, preset
