"""Half-precision wire: bytes as sent, division before the sum, rounding kept by error feedback, PyTorch's fp16 hook."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed.algorithms.ddp_comm_hooks.default_hooks as default_hooks
from ranks import run_ranks
from test_powersgd import _batches, _model, _train
from test_sign import _Recording
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from lightning_gradcomp import NAMED_STRATEGIES, GradCompStrategy
from lightning_gradcomp.core.compressors import (
    IdentityCompressor,
    PowerSGDCompressor,
    RandomKCompressor,
    TopKCompressor,
    TwoBitValues,
    WirePrecision,
)
from lightning_gradcomp.core.memory import NoMemory
from lightning_gradcomp.ddp.hook import GradCompHook, gradcomp_comm_hook

HALF = {"fp16": torch.float16, "bf16": torch.bfloat16}


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_dense_values_are_divided_then_cast_and_come_back_in_the_gradients_dtype(precision: str) -> None:
    codec = WirePrecision(IdentityCompressor(), precision)
    x = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    payload = codec.compress(x)
    assert payload.nbytes == 2000 and codec.payload_nbytes(x.shape, x.dtype) == 2000
    summand = codec.summable(payload, 4)
    assert summand.dtype == HALF[precision]
    assert torch.equal(summand, (x * 0.25).to(HALF[precision]))  # divided first, as fp16_compress_hook does
    mean = codec.from_sum(summand.clone(), payload, 4)
    assert mean.dtype == torch.float32
    wire = payload.to_bytes()
    assert wire.numel() == 2000
    back = codec.unpack(wire, x.shape, x.dtype)
    rounded = x.to(HALF[precision]).float()
    assert torch.equal(codec.decompress(back), rounded) and torch.equal(codec.decompress(payload), rounded)


def test_a_sum_that_would_overflow_float16_does_not() -> None:
    codec = WirePrecision(IdentityCompressor(), "fp16")
    x = torch.full((8,), 60000.0)  # float16's largest finite value is 65504
    payloads = [codec.compress(x) for _ in range(4)]
    assert not torch.isfinite(sum(x.half() for _ in range(4))).all()  # summing first overflows
    total = sum(codec.summable(p, 4) for p in payloads)
    torch.testing.assert_close(codec.from_sum(total, payloads[0], 4), x, rtol=2**-11, atol=0)


def test_sparse_values_travel_in_half_indices_stay_integers_and_the_rounding_is_what_reached() -> None:
    codec = WirePrecision(TopKCompressor(0.01), "bf16")
    x = torch.randn(5000, generator=torch.Generator().manual_seed(1))
    payload = codec.compress(x)
    # the count, 50 Elias-Fano indices below 5000 (l = 6: 38 + 17 bytes), 50 bfloat16 values
    assert payload.selected == 50 and payload.nbytes == 8 + 55 + 50 * 2 == payload.to_bytes().numel()
    sent = payload.entries().to_dense()
    inner = payload.inner
    assert torch.equal(sent[inner.indices], inner.values.to(torch.bfloat16).float())
    assert not torch.equal(sent[inner.indices], inner.values)  # bf16 rounding moved some values
    out = codec.accumulate_all([payload, codec.unpack(payload.to_bytes(), x.shape, x.dtype)], torch.zeros(5000))
    assert torch.equal(out, 2 * sent)


def test_what_it_refuses_by_name() -> None:
    with pytest.raises(ValueError, match=r"wire_precision must be one of \[None, 'fp16', 'bf16', '2bit'\], got 'fp8'"):
        GradCompStrategy(compressor="topk", wire_precision="fp8")
    for compressor in ("terngrad", "atomo", "quantizer", "sign"):
        with pytest.raises(ValueError, match="wire_precision='fp16' sends float values in half precision"):
            GradCompStrategy(compressor=compressor, memory="none", wire_precision="fp16")
    with pytest.raises(ValueError, match="it rounds values to fp16"):
        GradCompStrategy(compressor="randomk", memory="diana", wire_precision="fp16")


def test_presets() -> None:
    for name, precision in (("ddp_fp16", "fp16"), ("ddp_bf16", "bf16")):
        _, params = NAMED_STRATEGIES[name]
        assert params["wire_precision"] == precision and params["compressor"] == "none"
        assert params["min_compress_numel"] == 0 and params["aggregator"] == "allreduce"
        strategy = GradCompStrategy(**params)
        assert isinstance(strategy.compressor, WirePrecision) and strategy.compressor.wire == HALF[precision]


def _hook(model, compressor, memory, granularity: str = "layer") -> GradCompHook:
    named = list(model.named_parameters())
    return GradCompHook(compressor, memory, "allreduce", named, granularity=granularity, warmup_steps=0,
                        min_compress_numel=0)  # fmt: skip


def _fp16_lockstep(rank: int, world_size: int) -> list[dict]:
    """Per step, from the same weights and batch: the averaged gradients of our fp16 wire, of PyTorch's
    ``fp16_compress_hook`` and of plain float32 DDP, this rank's own gradient, and the bytes our collectives
    carried, by dtype."""
    ours_model, torch_model, plain_model, local_model = _model(), _model(), _model(), _model()
    hook = _hook(ours_model, WirePrecision(IdentityCompressor(), "fp16"), NoMemory(), "group")
    ours = DistributedDataParallel(ours_model, bucket_cap_mb=0.01)  # several buckets, rebuilt after step 1
    ours.register_comm_hook(hook, gradcomp_comm_hook)
    theirs = DistributedDataParallel(torch_model, bucket_cap_mb=100)
    theirs.register_comm_hook(None, default_hooks.fp16_compress_hook)
    plain = DistributedDataParallel(plain_model)
    optimizer = torch.optim.SGD(ours_model.parameters(), lr=0.05, momentum=0.9)
    steps = []
    for x, y in _batches(rank, world_size):
        for model in (torch_model, plain_model, local_model):
            model.load_state_dict(ours_model.state_dict())
        grads = {}
        runs = (("ours", ours, ours_model), ("torch", theirs, torch_model), ("fp32", plain, plain_model),
                ("local", local_model, local_model))  # fmt: skip
        for label, ddp, model in runs:
            model.zero_grad()
            nn.functional.cross_entropy(ddp(x), y).backward()
            grads[label] = {name: p.grad.clone() for name, p in model.named_parameters()}
        optimizer.step()
        last = hook.last_step
        steps.append({**grads, "by_dtype": last.bytes_sent_by_dtype, "dense_bytes": last.dense_bytes})
    return steps


def _fp16_ulp(x: torch.Tensor) -> torch.Tensor:
    """The spacing of float16 numbers at ``|x|`` (2**-24 in its subnormal range)."""
    exponent = torch.floor(torch.log2(x.abs().clamp_min(2.0**-14)))
    return torch.exp2(exponent - 10)


@pytest.mark.parametrize("world_size", [2, 3])
def test_on_real_ranks_the_fp16_wire_carries_float16_and_averages_as_pytorchs_hook(world_size: int) -> None:
    """Catches: a wire that stays float32 (plain DDP's averages pass any loose comparison of weights)."""
    results = run_ranks(_fp16_lockstep, world_size)
    total = sum(p.numel() for p in _model().parameters())
    for rank, steps in enumerate(results):
        for step, r in enumerate(steps):
            # what the collectives carried, counted by the comm layer: float16, two bytes an element, nothing else
            assert r["by_dtype"] == {"float16": 2 * total} and r["dense_bytes"] == 4 * total, (rank, step)
            exact = 0
            for name, ours in r["ours"].items():
                theirs, fp32 = r["torch"][name], r["fp32"][name]
                where = f"rank {rank}, step {step}, {name}"
                # a float16 sum cast back: every average is a float16 number (float32 DDP's are not)
                assert torch.equal(ours, ours.half().float()) and torch.equal(theirs, theirs.half().float()), where
                assert not torch.equal(fp32, fp32.half().float()), f"{where}: the check cannot tell float32 apart"
                # Both round the shares g_r / P and their partial sums to float16; PyTorch casts g_r before dividing
                # (a second rounding unless P is a power of two). With S = sum_r |g_r| / P each is within 2 (ours) and
                # 3 (PyTorch's) float16 spacings of S of the exact mean, so within 5 of each other, plus 2**-25 for
                # each of the 2P + 2 roundings that may fall in float16's subnormal range.
                shares = sum(other[step]["local"][name].abs() for other in results) / world_size
                bound = 5 * _fp16_ulp(shares) + (2 * world_size + 2) * 2.0**-25
                assert bool(((ours - theirs).abs() <= bound).all()), where
                exact += int((ours == theirs).sum())
            if world_size == 2:  # halving is exact in float16 above its subnormal range: nearly all equal
                assert exact >= 0.99 * total, (rank, step, exact, total)


def _half_wires(rank: int, world_size: int) -> dict:
    results = {}
    # Top-k with error feedback over a bf16 wire (allgather, and gTop-k's butterfly), PowerSGD over an fp16 one
    # (allreduce rounds)
    for name, codec, aggregator in (
        ("topk", WirePrecision(TopKCompressor(0.05), "bf16"), "allgather"),
        ("gtopk", WirePrecision(TopKCompressor(0.05), "bf16"), "gtopk"),
        ("powersgd", WirePrecision(PowerSGDCompressor(rank=2), "fp16"), "allreduce"),
        ("randomk", WirePrecision(RandomKCompressor(0.1, scaled=False), "fp16"), "allgather"),
        ("twobit", TwoBitValues(TopKCompressor(0.05)), "allgather"),
    ):
        model, memory = _model(), _Recording()
        hook = GradCompHook(codec, memory, aggregator, list(model.named_parameters()), warmup_steps=1,
                            min_compress_numel=100)  # fmt: skip
        ddp = DistributedDataParallel(model, bucket_cap_mb=0.01)
        ddp.register_comm_hook(hook, gradcomp_comm_hook)
        results[name] = {"weights": _train(ddp, model, rank, world_size)[-1], "log": memory.log,
                         "payload_bytes": [s.payload_bytes for s in hook.history],
                         "by_dtype": [s.bytes_sent_by_dtype for s in hook.history]}  # fmt: skip
    return results


@pytest.mark.parametrize("world_size", [2, 3])
def test_on_real_ranks_half_wires_keep_error_feedback_exact(world_size: int) -> None:
    results = run_ranks(_half_wires, world_size)
    for r in results:
        for name in ("topk", "gtopk", "powersgd", "randomk", "twobit"):
            for e in r[name]["log"]:
                old = torch.zeros_like(e["grad"]) if e["old"] is None else e["old"]
                assert torch.equal(e["acc"], e["grad"] + old)
                assert torch.equal(e["new"], e["acc"] - e["sent"])
        # what reached gTop-k's result is what crossed the wire: bf16 numbers (a rank's entries may all be dropped
        # on the way at a step, not at every step)
        assert any(e["sent"].any() for e in r["gtopk"]["log"])
        assert all(torch.equal(e["sent"], e["sent"].bfloat16().float()) for e in r["gtopk"]["log"])
        # k = 5% of 216 + 9216 + 320 (conv, fc1, fc2 weights): 10 + 460 + 16 entries, each payload a count, the
        # Elias-Fano indices (l = 4: 5 + 3, 230 + 130, 8 + 5 bytes) and bf16 values, gathered as packed bytes
        # (the biases, 50 floats, are all-reduced densely in float32)
        topk = 3 * 8 + (8 + 360 + 13) + (10 + 460 + 16) * 2
        assert r["topk"]["payload_bytes"][1:] == [topk] * 5
        # the same entries with 2-bit values: the indices without a count, the codes sixteen to a 32-bit word (4, 116,
        # 4 bytes) and two float32 levels per block of 256 entries (1, 2, 1 blocks); every sent value is one of its
        # block's levels
        twobit = (5 + 3 + 4 + 8) + (360 + 116 + 16) + (13 + 4 + 8)
        assert r["twobit"]["payload_bytes"][1:] == [twobit] * 5
        assert r["twobit"]["by_dtype"][1:] == [{"uint8": twobit, "float32": 4 * 50}] * 5
        for e in r["twobit"]["log"]:
            magnitudes = e["sent"][e["sent"] != 0].abs()
            assert 1 <= magnitudes.unique().numel() <= 2 * math.ceil(magnitudes.numel() / 256)
        assert r["topk"]["by_dtype"][1:] == [{"uint8": topk, "float32": 4 * 50}] * 5
        # fp16 P and Q: 3.weight (32 x 288) at rank 2; 0.weight (8 x 27) and 5.weight (10 x 32) at rank 2,
        # all-reduced as float16
        powersgd = ((32 + 288) * 2 + (8 + 27) * 2 + (10 + 32) * 2) * 2
        assert r["powersgd"]["payload_bytes"][1:] == [powersgd] * 5
        assert r["powersgd"]["by_dtype"][1:] == [{"float16": powersgd, "float32": 4 * 50}] * 5
    for name in ("topk", "gtopk", "powersgd", "randomk"):
        for other in results[1:]:
            for key, value in other[name]["weights"].items():
                assert torch.equal(value, results[0][name]["weights"][key]), f"{name}: {key}"
