"""Kept buffers: the allreduce path writes its summands and averages into buffers that live from step to step,
with the very numbers of the allocating path."""

from __future__ import annotations

import pytest
import torch
from ranks import run_ranks
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from lightning_gradcomp import NAMED_STRATEGIES, GradCompStrategy
from lightning_gradcomp.core.compressors import (
    IdentityCompressor,
    PowerSGDCompressor,
    TernGradCompressor,
    WirePrecision,
)
from lightning_gradcomp.core.workspace import OWN_PAYLOAD, Workspace
from lightning_gradcomp.ddp.hook import gradcomp_comm_hook


def test_a_buffer_is_kept_by_owner_and_role_and_replaced_only_when_its_form_changes() -> None:
    """Catches: a buffer handed back at its old size (or dtype) after the unit's size changed."""
    space = Workspace()
    first = space.buffer(0, "mean", 10, torch.float32, torch.device("cpu"))
    assert space.buffer(0, "mean", 10, torch.float32, torch.device("cpu")) is first
    assert space.buffer(1, "mean", 10, torch.float32, torch.device("cpu")) is not first
    assert space.buffer(0, "wire", 10, torch.float16, torch.device("cpu")) is not first
    assert space.nbytes == 10 * 4 + 10 * 4 + 10 * 2
    halved = space.buffer(0, "mean", 10, torch.float16, torch.device("cpu"))
    assert halved.dtype == torch.float16 and space.nbytes == 10 * 2 + 10 * 4 + 10 * 2
    assert space.scratch(0)("wire", 10, torch.float16, torch.device("cpu")) is space.buffer(
        0, "wire", 10, torch.float16, torch.device("cpu")
    )
    # a new size (a density that changed, a unit planned again) replaces the buffer; the kept one is that one after
    grown = space.buffer(0, "mean", 25, torch.float16, torch.device("cpu"))
    assert grown is not halved and grown.numel() == 25 and space.nbytes == 25 * 2 + 10 * 4 + 10 * 2
    assert space.buffer(0, "mean", 25, torch.float16, torch.device("cpu")) is grown
    shrunk = space.buffer(0, "mean", 4, torch.float16, torch.device("cpu"))
    assert shrunk is not grown and shrunk.numel() == 4 and space.nbytes == 4 * 2 + 10 * 4 + 10 * 2


def test_payloads_laid_out_together_lie_end_to_end_in_one_buffer_counted_once() -> None:
    """Catches: laid-out buffers that are not adjacent (they would travel apart, through a copy), a layout remade
    every step (an allocation per step), and a kept buffer counted twice."""
    cpu = torch.device("cpu")
    space = Workspace()
    space.lay_out([2, 5, 7], OWN_PAYLOAD, [8, 12, 5], cpu)
    views = [space.buffer(owner, OWN_PAYLOAD, n, torch.uint8, cpu) for owner, n in ((2, 8), (5, 12), (7, 5))]
    assert [v.data_ptr() - views[0].data_ptr() for v in views] == [0, 8, 20]
    assert len({v.untyped_storage().data_ptr() for v in views}) == 1 and space.nbytes == 25
    space.lay_out([2, 5, 7], OWN_PAYLOAD, [8, 12, 5], cpu)  # the same layout again: the same buffers
    assert all(space.buffer(o, OWN_PAYLOAD, n, torch.uint8, cpu) is v
               for (o, n), v in zip(((2, 8), (5, 12), (7, 5)), views, strict=True))  # fmt: skip
    # a user asking for another size gets a buffer of its own, which the same layout does not take back
    own = space.buffer(5, OWN_PAYLOAD, 13, torch.uint8, cpu)
    space.lay_out([2, 5, 7], OWN_PAYLOAD, [8, 12, 5], cpu)
    assert space.buffer(5, OWN_PAYLOAD, 13, torch.uint8, cpu) is own and space.nbytes == 25 + 13
    # nothing laid out: one owner, an unknown size, an offset that a float32 header could not be viewed at
    for owners, numels in (([1], [8]), ([3, 4], [8, None]), ([3, 4], [6, 8])):
        space.lay_out(owners, OWN_PAYLOAD, numels, cpu)
        assert not any((owner, OWN_PAYLOAD) in space._buffers for owner in owners)


@pytest.mark.parametrize("precision", [None, "fp16", "bf16"])
def test_dense_summands_and_means_in_kept_buffers_equal_the_allocating_path_bit_for_bit(precision: str | None) -> None:
    codec = IdentityCompressor() if precision is None else WirePrecision(IdentityCompressor(), precision)
    space = Workspace()
    scratch = space.scratch(3)
    pointers = set()
    for seed in range(2):
        xs = [torch.randn(4097, generator=torch.Generator().manual_seed(10 * seed + r)) for r in range(3)]
        payloads = [codec.compress(x) for x in xs]
        plain = sum(codec.summable(p, 3) for p in payloads)
        summand = codec.summable(payloads[0], 3, scratch)
        for p in payloads[1:]:
            summand += codec.summable(p, 3)  # stands for the allreduce, in place
        assert torch.equal(summand, plain)
        out = scratch("mean", 4097, torch.float32, torch.device("cpu"))
        mean = codec.from_sum(summand, payloads[0], 3, out=out)
        assert mean.data_ptr() == out.data_ptr() and torch.equal(mean, codec.from_sum(plain.clone(), payloads[0], 3))
        pointers.add((summand.data_ptr(), mean.data_ptr()))
    assert len(pointers) == 1  # the second step wrote into the first step's buffers


def test_terngrad_codes_and_average_in_kept_buffers_equal_the_allocating_path_bit_for_bit() -> None:
    codec = TernGradCompressor(share_scale=True)
    xs = [torch.randn(3000, generator=torch.Generator().manual_seed(r)) for r in range(4)]
    scale = max(codec.local_scale(x) for x in xs)
    payloads = [
        codec.compress(x, torch.Generator().manual_seed(r), scale=scale, local_scale=codec.local_scale(x))
        for r, x in enumerate(xs)
    ]
    space = Workspace()
    summands = [codec.summable(p, 4, space.scratch(r)) for r, p in enumerate(payloads)]
    wires = [p.to_bytes().clone() for p in payloads]
    for summand, payload in zip(summands, payloads, strict=True):  # unpacked: the allreduce sums in place
        assert torch.equal(summand, payload.codes)
        summand.add_(1)  # as the allreduce would: the payload's packed bytes are not the summand's storage
    assert all(torch.equal(p.to_bytes(), w) for p, w in zip(payloads, wires, strict=True))
    summands = [codec.summable(p, 4, space.scratch(r)) for r, p in enumerate(payloads)]
    total = sum(s.to(torch.int32) for s in summands).to(torch.int8)
    out = torch.empty(3000)
    assert torch.equal(codec.from_sum(total, payloads[0], 4, out=out), codec.from_sum(total, payloads[0], 4))
    assert torch.equal(out, codec.from_sum(total, payloads[0], 4))


def test_powersgd_second_round_is_m_transposed_p() -> None:
    codec = PowerSGDCompressor(rank=2)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(64, 48, generator=generator, dtype=torch.float64)
    q = codec.initial_state((x.shape,), x.dtype, x.device, torch.Generator().manual_seed(1))
    payload = codec.compress(x, warm_start=q)
    total = codec.summable(payload, 1).clone()
    second = codec.next_summable(payload, total, 1)
    p_hat = payload.p_hats[0]
    torch.testing.assert_close(second.view(48, 2), x.T @ p_hat, rtol=1e-12, atol=1e-12)


def _workspace_is_allocated_once(rank: int, world: int, method: str) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(300, 200), nn.ReLU(), nn.Linear(200, 100), nn.ReLU(), nn.Linear(100, 10))
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.1)
    hook = GradCompStrategy(**{**NAMED_STRATEGIES[method][1], "warmup_steps": 1, "adaptive": "none"}).build_hook(model)
    ddp.register_comm_hook(hook, gradcomp_comm_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(16, 300, generator=torch.Generator().manual_seed(rank))
    y = torch.randint(0, 10, (16,), generator=torch.Generator().manual_seed(rank))
    seen = []
    for _ in range(4):
        optimizer.zero_grad()
        nn.functional.cross_entropy(ddp(x), y).backward()
        optimizer.step()
        seen.append(sorted((key, t.data_ptr(), t.numel()) for key, t in hook.workspace._buffers.items()))
    compressed = {unit.index for unit in hook.units if unit.compressed}
    return {
        "seen": seen,
        "roles": {role for (_, role) in hook.workspace._buffers},
        "compressed_roles": {role for (index, role) in hook.workspace._buffers if index in compressed},
    }


@pytest.mark.parametrize(
    ("method", "roles"),
    [
        # one unit inside one bucket: compressed as a view of it, summed in the kept float16 buffer (scaled and
        # cast in one go), the average cast back straight into the bucket
        ("ddp_fp16", {"wire"}),
        # PowerSGD's weights are not adjacent (the biases lie between them): copied; P and Q need the mean
        ("ddp_powersgd", {"mean", "unit"}),
        # the codes drawn straight into their packed bytes behind the scales, in the unit's kept buffer, sent as they
        # lie there and gathered into a kept buffer too (the other ranks' codes stay packed in it)
        ("ddp_terngrad", {"own payload", "gathered"}),
        ("ddp_diana", {"own payload", "gathered"}),
        ("ddp_efsign", {"own payload", "gathered"}),
    ],
)
def test_compressed_steps_work_in_the_same_kept_buffers_every_step(method: str, roles: set) -> None:
    for result in run_ranks(_workspace_is_allocated_once, 2, method):
        seen = result["seen"]
        assert seen[1] and seen[1] == seen[2] == seen[3]  # steps 2-4 compressed, in the same buffers
        assert result["compressed_roles"] == roles


def _kept_roles(rank: int, world: int, method: str) -> set:
    return _workspace_is_allocated_once(rank, world, method)["compressed_roles"]


@pytest.mark.parametrize(
    "method", ["ddp_topk", "ddp_gtopk", "ddp_gaussiank", "ddp_efsign", "ddp_terngrad", "ddp_diana"]
)
def test_the_average_is_written_over_the_compressed_tensor_without_a_buffer_of_its_own(method: str) -> None:
    # payloads that are their own entries let the memory settle before the mean is decoded, straight into
    # DDP's bucket; the Top-k family's one unit of the whole model is read where the buckets hold it (the
    # parameters kept dense, here the biases and the logits layer, still go through kept buffers)
    for roles in run_ranks(_kept_roles, 2, method):
        assert not roles & {"mean", "unit"}, roles


def _train(ddp: nn.Module, optimizer: torch.optim.Optimizer, steps: int, rank: int, features: int) -> None:
    """``steps`` steps on batches of 16 inputs of ``features`` that differ by step and rank."""
    for step in range(steps):
        x = torch.randn(16, features, generator=torch.Generator().manual_seed(10 * step + rank))
        y = torch.randint(0, 10, (16,), generator=torch.Generator().manual_seed(10 * step + rank))
        optimizer.zero_grad()
        nn.functional.cross_entropy(ddp(x), y).backward()
        optimizer.step()


def _segments_against_a_flat_copy(rank: int, world: int, segments: bool) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(300, 200), nn.ReLU(), nn.Linear(200, 100), nn.ReLU(), nn.Linear(100, 10))
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.1)  # the model's unit spans buckets that change at step 2
    strategy = GradCompStrategy(**{**NAMED_STRATEGIES["ddp_topk"][1], "warmup_steps": 1, "adaptive": "none"})
    hook = strategy.build_hook(model)
    hook.compressor.inner.takes_segments = segments
    ddp.register_comm_hook(hook, gradcomp_comm_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    _train(ddp, optimizer, 5, rank, 300)
    return {
        "weights": [p.detach().clone() for p in model.parameters()],
        "memory": {k: v.clone() for k, v in hook.memory.state_dict().items()},
        "roles": {role for (index, role) in hook.workspace._buffers if hook.units[index].compressed},
        "compressed": sum(s.compressed for s in hook.history),
    }


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_unit_read_in_the_buckets_trains_bit_for_bit_as_its_flat_copy(world_size: int) -> None:
    pieces = run_ranks(_segments_against_a_flat_copy, world_size, True)
    copied = run_ranks(_segments_against_a_flat_copy, world_size, False)
    for a, b in zip(pieces, copied, strict=True):
        assert a["compressed"] == b["compressed"] == 4
        assert all(torch.equal(p, q) for p, q in zip(a["weights"], b["weights"], strict=True))
        assert a["memory"].keys() == b["memory"].keys() and all(
            torch.equal(v, b["memory"][k]) for k, v in a["memory"].items()
        )
        assert "unit" in b["roles"] and not a["roles"] & {"unit", "mean"}
    assert all(torch.equal(p, q) for p, q in zip(pieces[0]["weights"], pieces[-1]["weights"], strict=True))


def _gathered_by_broadcasts(rank: int, world: int, method: str, broadcasts: bool) -> dict:
    """Three compressed steps of a layer whose payload row is past BROADCAST_GATHER_BYTES (its weight and bias, two
    units of one bucket: the output layer, averaged densely, fills DDP's first bucket), gathered by broadcasts or
    (the threshold out of reach) by gloo's allgather."""
    from lightning_gradcomp.core.comm import collectives

    if not broadcasts:
        collectives.BROADCAST_GATHER_BYTES = 2**62
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(600, 1024), nn.ReLU(), nn.Linear(1024, 600))
    ddp = DistributedDataParallel(model)
    hook = GradCompStrategy(**{**NAMED_STRATEGIES[method][1], "warmup_steps": 1, "adaptive": "none"}).build_hook(model)
    ddp.register_comm_hook(hook, gradcomp_comm_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    _train(ddp, optimizer, 4, rank, 600)
    buffers = hook.workspace._buffers
    own = {index: t for (index, role), t in buffers.items() if role == OWN_PAYLOAD and t.numel()}
    first = min(own)
    return {
        "weights": [p.detach().clone() for p in model.parameters()],
        "own_sizes": [own[i].numel() for i in sorted(own)],
        "own_offsets": [own[i].data_ptr() - own[first].data_ptr() for i in sorted(own)],
        "gathered": sum(t.numel() for (_, role), t in buffers.items() if role == "gathered"),
        "compressed": sum(s.compressed for s in hook.history),
    }


@pytest.mark.parametrize("method", ["ddp_terngrad", "ddp_efsign", "ddp_diana"])
def test_payloads_sent_as_one_span_by_broadcasts_train_bit_for_bit_as_gloos_allgather(method: str) -> None:
    """Catches: a broadcast gather that mixes up the ranks' rows, or a rank's own laid-out payload overwritten
    before it reaches the mean; and a gather that still keeps a row for this rank's own payload."""
    spans = run_ranks(_gathered_by_broadcasts, 2, method, True)
    gathered = run_ranks(_gathered_by_broadcasts, 2, method, False)
    for a, b in zip(spans, gathered, strict=True):
        assert a["compressed"] == b["compressed"] == 3
        assert all(torch.equal(p, q) for p, q in zip(a["weights"], b["weights"], strict=True))
        # the bias's payload, then the weight's, end to end; gathered: the other rank's row only, against both rows
        sizes = a["own_sizes"]
        assert len(sizes) == 2 and a["own_offsets"] == [0, sizes[0]]
        assert a["gathered"] == sum(sizes) and b["gathered"] == 2 * sum(sizes)
    assert all(torch.equal(p, q) for p, q in zip(spans[0]["weights"], spans[1]["weights"], strict=True))
