"""Half-precision wire: bytes as sent, division before the sum, rounding kept by error feedback, PyTorch's fp16 hook."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.algorithms.ddp_comm_hooks.default_hooks as default_hooks
from ranks import run_ranks
from test_powersgd import _model, _train
from test_sign import _Recording
from torch.nn.parallel import DistributedDataParallel

from lightning_gradcomp import NAMED_STRATEGIES, GradCompStrategy
from lightning_gradcomp.compressors import (
    IdentityCompressor,
    PowerSGDCompressor,
    RandomKCompressor,
    TopKCompressor,
    WirePrecision,
)
from lightning_gradcomp.hook import GradCompHook, gradcomp_comm_hook
from lightning_gradcomp.memory import NoMemory

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
    assert payload.selected == 50 and payload.nbytes == 50 * (4 + 2) == payload.to_bytes().numel()
    sent = payload.entries().to_dense()
    inner = payload.inner
    assert torch.equal(sent[inner.indices], inner.values.to(torch.bfloat16).float())
    assert not torch.equal(sent[inner.indices], inner.values)  # bf16 rounding moved some values
    out = codec.accumulate_all([payload, codec.unpack(payload.to_bytes(), x.shape, x.dtype)], torch.zeros(5000))
    assert torch.equal(out, 2 * sent)


def test_what_it_refuses_by_name() -> None:
    with pytest.raises(ValueError, match=r"wire_precision must be one of \[None, 'fp16', 'bf16'\], got 'fp8'"):
        GradCompStrategy(compressor="topk", wire_precision="fp8")
    for compressor in ("terngrad", "atomo", "quantizer", "sign"):
        with pytest.raises(ValueError, match="wire_precision='fp16' sends float values in half precision"):
            GradCompStrategy(compressor=compressor, memory="none", wire_precision="fp16")
    with pytest.raises(ValueError, match="aggregator='gtopk': the butterfly sums entries"):
        GradCompStrategy(compressor="topk", aggregator="gtopk", wire_precision="bf16")
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


def _half_wires(rank: int, world_size: int) -> dict:
    results = {}
    # our fp16 preset against PyTorch's fp16_compress_hook
    model = _model()
    hook = _hook(model, WirePrecision(IdentityCompressor(), "fp16"), NoMemory(), "group")
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.01)
    ddp.register_comm_hook(hook, gradcomp_comm_hook)
    results["ours"] = _train(ddp, model, rank, world_size)
    results["dense_bytes"] = [(s.payload_bytes, s.dense_bytes) for s in hook.history]
    model = _model()
    ddp = DistributedDataParallel(model, bucket_cap_mb=100)
    ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    results["torch"] = _train(ddp, model, rank, world_size)
    # Top-k with error feedback over a bf16 wire (allgather), PowerSGD over an fp16 one (allreduce rounds)
    for name, codec, aggregator in (
        ("topk", WirePrecision(TopKCompressor(0.05), "bf16"), "allgather"),
        ("powersgd", WirePrecision(PowerSGDCompressor(rank=2), "fp16"), "allreduce"),
        ("randomk", WirePrecision(RandomKCompressor(0.1, scaled=False), "fp16"), "allgather"),
    ):
        model, memory = _model(), _Recording()
        hook = GradCompHook(codec, memory, aggregator, list(model.named_parameters()), warmup_steps=1,
                            min_compress_numel=100)  # fmt: skip
        ddp = DistributedDataParallel(model, bucket_cap_mb=0.01)
        ddp.register_comm_hook(hook, gradcomp_comm_hook)
        results[name] = {"weights": _train(ddp, model, rank, world_size)[-1], "log": memory.log,
                         "payload_bytes": [s.payload_bytes for s in hook.history]}  # fmt: skip
    return results


@pytest.mark.parametrize("world_size", [2, 3])
def test_on_real_ranks_fp16_is_pytorchs_hook_and_half_wires_keep_error_feedback_exact(world_size: int) -> None:
    results = run_ranks(_half_wires, world_size)
    for r in results:
        for step, (ours, theirs) in enumerate(zip(r["ours"], r["torch"], strict=True)):
            for name in ours:
                # PyTorch casts first and divides in float16 (gradients in float16's subnormal range are
                # rounded twice); over 3 ranks gloo's ring also adds the shares in a layout-dependent order
                torch.testing.assert_close(ours[name], theirs[name], rtol=1e-3, atol=1e-5, msg=f"{name}, {step}")
        total = sum(p.numel() for p in _model().parameters())
        assert all(payload == 2 * total and dense == 4 * total for payload, dense in r["dense_bytes"])
        for name in ("topk", "powersgd", "randomk"):
            for e in r[name]["log"]:
                old = torch.zeros_like(e["grad"]) if e["old"] is None else e["old"]
                assert torch.equal(e["acc"], e["grad"] + old)
                assert torch.equal(e["new"], e["acc"] - e["sent"])
        # bf16 values: 6 bytes an entry; k = 5% of 216 + 9216 + 320 (conv, fc1, fc2 weights): 10 + 460 + 16
        assert r["topk"]["payload_bytes"][1:] == [(10 + 460 + 16) * 6] * 5
        # fp16 P and Q: 3.weight (32 x 288) at rank 2; 0.weight (8 x 27) and 5.weight (10 x 32) at rank 2
        assert r["powersgd"]["payload_bytes"][1:] == [((32 + 288) * 2 + (8 + 27) * 2 + (10 + 32) * 2) * 2] * 5
    for name in ("topk", "powersgd", "randomk"):
        for other in results[1:]:
            for key, value in other[name]["weights"].items():
                assert torch.equal(value, results[0][name]["weights"][key]), f"{name}: {key}"
