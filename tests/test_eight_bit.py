"""8-bit wires: int8 and fp8 (e4m3) codes with a scale per block, within their stated error bounds, and the average in
two phases (each rank sums the slices it owns in float32, quantizes them again, all gather) on 2 and 3 real ranks,
within the bound of two quantizations, with the bytes counted off the tensors handed to the collectives; the DDP
presets and DiLoCo's outer average on that wire."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from ranks import run_ranks
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from lightning_gradcomp import GradCompStrategy, OuterSync
from lightning_gradcomp.core.comm import Collectives, CommCounter, Contribution, TwoPhaseAggregator
from lightning_gradcomp.core.compressors import FP8Compressor, Int8Compressor
from lightning_gradcomp.core.pipeline_arguments import build_pipeline
from lightning_gradcomp.ddp.hook import gradcomp_comm_hook

#: Float32 rounding of ``code * scale`` and of ``x / scale`` (a few units in the last place of the value).
ROUNDING = 4 * 2**-24


def _inputs(numel: int, seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    spread = torch.randn(numel, generator=generator) * torch.logspace(-3, 2, numel)  # magnitudes across the blocks
    blocky = torch.randn(numel, generator=generator)
    blocky[: min(numel, 300)] = 0.0  # a whole block of zeros, and part of the next
    return [spread, blocky, torch.randn(numel, generator=generator).pow(5)]


def bound(codec: Int8Compressor | FP8Compressor, x: torch.Tensor) -> torch.Tensor:
    """Each element's stated error bound: half a code of its block's scale (int8), or the larger of ``2^-4 |x|`` and
    ``2^-10`` of the scale (e4m3); plus float32 rounding."""
    scales = codec.scales_of(x).repeat_interleave(codec.block_size)[: x.numel()]
    stated = scales / 2 if isinstance(codec, Int8Compressor) else torch.maximum(x.abs() * 2**-4, scales * 2**-10)
    return stated + ROUNDING * x.abs()


@pytest.mark.parametrize("codec", [Int8Compressor(), Int8Compressor(block_size=64), FP8Compressor()])
@pytest.mark.parametrize("numel", [1, 255, 256, 1000, 70_000])
def test_each_element_is_within_the_stated_bound_and_the_wire_is_its_size(codec: Any, numel: int) -> None:
    for x in _inputs(numel, numel):
        payload = codec.compress(x)
        decoded = codec.decompress(payload)
        assert bool(((decoded - x).abs() <= bound(codec, x)).all())
        blocks = math.ceil(numel / codec.block_size)
        assert payload.nbytes == payload.to_bytes().numel() == numel + 4 * blocks
        assert payload.nbytes == codec.payload_nbytes(x.shape, x.dtype)
        assert torch.equal(codec.decompress(codec.unpack(payload.to_bytes(), x.shape, x.dtype)), decoded)
        assert torch.equal(decoded[(x == 0)], x[(x == 0)])  # a block of zeros decodes to zeros
        if isinstance(codec, Int8Compressor) and bool(x.any()):  # the largest magnitude takes the largest code
            assert int(payload.codes.abs().max()) == 127


def test_a_block_aligned_piece_is_the_payload_of_its_slice() -> None:
    codec = Int8Compressor(block_size=64)
    x = torch.randn(1000)
    payload = codec.compress(x)
    for start, end in codec.piece_bounds(1000, 3):
        piece = payload.piece(start, end)
        alone = codec.compress(x[start:end])
        assert torch.equal(piece.codes, alone.codes) and torch.equal(piece.scales, alone.scales)
    assert codec.piece_bounds(1000, 3) == [(0, 384), (384, 704), (704, 1000)]  # 16 blocks: 6, 5, 5
    assert codec.piece_bounds(100, 4) == [(0, 64), (64, 100), (100, 100), (100, 100)]
    with pytest.raises(ValueError, match="starts on a block boundary"):
        payload.piece(10, 20)


def _tensors(rank: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + rank)
    return [torch.randn(1000, generator=generator) * (rank + 1), torch.randn(37, generator=generator),
            torch.randn(300, generator=generator).pow(3)]  # fmt: skip


def _two_phase(rank: int, world_size: int) -> dict[str, Any]:
    out = {}
    for codec in (Int8Compressor(block_size=64), FP8Compressor(block_size=64)):
        collectives = Collectives(None, CommCounter())
        contributions = [Contribution(codec, codec.compress(x)) for x in _tensors(rank)]
        means = [a.mean for a in TwoPhaseAggregator().aggregate(contributions, collectives)]
        out[codec.name] = {"means": means, "sent": collectives.counter.bytes_sent, "calls": collectives.counter.calls}
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_the_two_phase_average_is_within_two_quantizations_of_the_mean(world_size: int) -> None:
    ranks = run_ranks(_two_phase, world_size)
    for codec in (Int8Compressor(block_size=64), FP8Compressor(block_size=64)):
        tensors = [_tensors(r) for r in range(world_size)]
        for i in range(len(tensors[0])):
            xs = [tensors[r][i] for r in range(world_size)]
            mean = sum(xs) / world_size
            first = sum(bound(codec, x) for x in xs) / world_size  # each rank's slices quantized once
            decoded = sum(codec.decompress(codec.compress(x)) for x in xs) / world_size
            second = bound(codec, decoded)  # the owner's mean quantized again (its own blocks: at most these scales)
            for rank in ranks:
                result = rank[codec.name]["means"][i]
                assert torch.equal(result, ranks[0][codec.name]["means"][i])  # every rank the same, bit for bit
                assert bool(((result - mean).abs() <= first + second * 1.01).all()), (codec.name, i)
        sizes = [x.numel() for x in tensors[0]]
        # the bytes of the slices each rank owns, over every tensor: what every rank sends it in the all-to-all (a
        # part of none sent as one byte), and what it hands the all-gather (padded to the longest owner's)
        owned = [sum(codec.payload_nbytes(torch.Size([e - s]), torch.float32)
                     for n in sizes for s, e in [codec.piece_bounds(n, world_size)[r]])
                 for r in range(world_size)]  # fmt: skip
        for rank in ranks:
            assert rank[codec.name]["sent"] == sum(max(1, size) for size in owned) + max(owned)
            assert rank[codec.name]["calls"] == 2  # one all-to-all, one all-gather, whatever the tensors


def test_the_two_phase_average_needs_a_block_aligned_codec() -> None:
    with pytest.raises(ValueError, match="aggregator='two_phase' cuts each payload at block boundaries"):
        build_pipeline("qsgd", None, None, None, "none", None, "two_phase")
    with pytest.raises(ValueError, match="aggregator='allreduce' sums compressed codes"):
        build_pipeline("int8", None, None, None, "none", None, "allreduce")
    assert build_pipeline("fp8", None, None, None, "ef", None, "auto")[0].preferred_aggregator(4) == "two_phase"


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 4))


def _train(rank: int, world_size: int, preset: str | None, memory: str | None = None) -> dict[str, Any]:
    model = _model()
    ddp = DistributedDataParallel(model)
    hook = None
    if preset is not None:
        arguments = {"memory": memory} if memory else {}
        hook = GradCompStrategy.from_preset(preset, warmup_steps=0, **arguments).build_hook(model)
        ddp.register_comm_hook(hook, gradcomp_comm_hook)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(20):
        generator = torch.Generator().manual_seed(10 * rank + step)
        x = torch.randn(32, 16, generator=generator)
        optimizer.zero_grad()
        nn.functional.mse_loss(ddp(x), x[:, :4] * (rank + 1)).backward()
        optimizer.step()
    return {
        "weights": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "per_step": [(s.bytes_sent, s.dense_bytes, s.compressed) for s in hook.history] if hook else None,
        "residual": sum(float(t.abs().sum()) for t in hook.memory.state_dict().values()) if hook else 0.0,
    }


def _presets(rank: int, world_size: int) -> dict[str, Any]:
    return {"dense": _train(rank, world_size, None), "ddp_int8": _train(rank, world_size, "ddp_int8"),
            "ddp_fp8": _train(rank, world_size, "ddp_fp8"),
            "int8_ef": _train(rank, world_size, "ddp_int8", "ef")}  # fmt: skip


def test_the_eight_bit_presets_train_with_every_rank_alike_and_a_quarter_of_the_bytes() -> None:
    ranks = run_ranks(_presets, 3)
    dense = ranks[0]["dense"]["weights"]
    for rank in ranks:
        for preset in ("ddp_int8", "ddp_fp8", "int8_ef"):
            for name, value in rank[preset]["weights"].items():
                assert torch.equal(value, ranks[0][preset]["weights"][name]), (preset, name)
                torch.testing.assert_close(value, dense[name], rtol=0.05, atol=0.02)  # it trains as dense does
            assert all(compressed and sent < dense_bytes * 0.4 for sent, dense_bytes, compressed in
                       rank[preset]["per_step"])  # fmt: skip
        assert rank["int8_ef"]["residual"] > 0 and rank["ddp_int8"]["residual"] == 0  # error feedback kept what fell


def _diloco(rank: int, world_size: int) -> dict[str, Any]:
    out = {}
    for name, arguments in (("dense", {}), ("int8", {"compressor": "int8", "aggregator": "two_phase"})):
        model = _model()
        inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
        sync = OuterSync(model.named_parameters(), sync_every=4, **arguments)
        for step in range(12):
            generator = torch.Generator().manual_seed(10 * rank + step)
            x = torch.randn(32, 16, generator=generator)
            inner.zero_grad()
            nn.functional.mse_loss(model(x), x[:, :4] * (rank + 1)).backward()
            inner.step()
            sync.step()
        out[name] = {"anchor": {k: v.clone() for k, v in sync.anchor.items()},
                     "bytes": [s.bytes_sent for s in sync.history if s.synchronised]}  # fmt: skip
    return out


def test_diloco_averages_its_pseudo_gradient_on_the_int8_wire() -> None:
    ranks = run_ranks(_diloco, 3)
    numel = sum(p.numel() for p in _model().parameters())
    for rank in ranks:
        for name, value in rank["int8"]["anchor"].items():
            assert torch.equal(value, ranks[0]["int8"]["anchor"][name]), name
            torch.testing.assert_close(value, rank["dense"]["anchor"][name], rtol=0.02, atol=0.01)
        assert all(numel < sent < 2 * numel for sent in rank["int8"]["bytes"])  # about 8 bits twice, against 32
