"""The compiled decodes (a mean of the ranks' payloads, a payload added into a state, DIANA's shift step) against the
eager chunks they replace: equal on the CPU where the operations are the same, within one rounding where eager torch
fuses a multiply-add that the compiled kernel rounds twice; on CUDA within a few roundings."""

from __future__ import annotations

from functools import partial

import pytest
import torch
import torch.distributed as dist
from backward_thread import Net
from ranks import run_ranks
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import lightning_gradcomp.core.fused as fused_module
from lightning_gradcomp import gradcomp_comm_hook, make_hook
from lightning_gradcomp.core.compressors import QSGDCompressor, ScaledSignCompressor, SignPayload, TernGradCompressor
from lightning_gradcomp.core.compressors.kernels import (
    SIGN_ROW,
    add_fields_,
    mean_of_fields_,
    mean_of_signs_,
    mean_of_summed_fields_,
    shift_and_estimate_,
    subtract_signs_,
)
from lightning_gradcomp.core.compressors.quantizer import BlockQuantizer
from lightning_gradcomp.core.fused import set_codec_mode
from lightning_gradcomp.core.host_waits import host_waits
from lightning_gradcomp.core.memory import Diana
from lightning_gradcomp.core.randomness import CounterStream

#: 37 whole blocks of 512 and a partial one: the compiled kernel takes the whole planar rows, the eager chunks the rest.
NUMEL = 37 * 512 + 101
U = torch.finfo(torch.float32).eps / 2  # fp32's unit roundoff


@pytest.fixture
def mode() -> object:
    yield set_codec_mode
    fused_module._mode = None


def _payloads(compressor: object, ranks: int, numel: int = NUMEL) -> list[object]:
    """What an allgather holds: this rank's payload as compressed, the others' parsed from their wire bytes."""
    payloads = []
    for rank in range(ranks):
        x = torch.randn(numel, generator=torch.Generator().manual_seed(rank)) * (rank + 1)
        payload = compressor.compress(x, CounterStream(100 + rank))
        payloads.append(payload if rank == 0 else compressor.unpack(payload.to_bytes().clone(), x.shape, x.dtype))
    return payloads


def _both(mode: object, run: object) -> tuple[torch.Tensor, torch.Tensor]:
    mode("compiled")
    compiled = run()
    mode("eager")
    return compiled, run()


@pytest.mark.parametrize("ranks", [2, 3])
def test_the_compiled_mean_of_qsgd_levels_is_the_eager_zero_add_divide_bit_for_bit(mode: object, ranks: int) -> None:
    compressor = QSGDCompressor(levels=7)
    payloads = _payloads(compressor, ranks)
    calls = mean_of_fields_.compiled_calls
    compiled, eager = _both(mode, lambda: compressor.average_all(payloads, torch.full((NUMEL,), 9.0), ranks))
    assert mean_of_fields_.compiled_calls == calls + 1
    reference = torch.zeros(NUMEL)
    for payload in payloads:
        reference += payload.dense()
    assert torch.equal(compiled, eager) and torch.equal(eager, reference / ranks)


def test_the_compiled_mean_of_scaled_signs_is_the_eager_one_bit_for_bit(mode: object) -> None:
    compressor = ScaledSignCompressor()
    numel = 2 * SIGN_ROW + 32 * 99 + 5  # two whole planar rows, compiled; a partial last row and word, eagerly
    mode("eager")
    payloads = _payloads(compressor, 3, numel)
    calls = mean_of_signs_.compiled_calls
    compiled, eager = _both(mode, lambda: compressor.average_all(payloads, torch.full((numel,), 9.0), 3))
    assert mean_of_signs_.compiled_calls == calls + 1
    reference = sum(compressor.decompress(p) for p in payloads) / 3
    assert torch.equal(compiled, eager) and torch.equal(eager, reference)


@pytest.mark.parametrize(
    "compressor",
    [ScaledSignCompressor(), QSGDCompressor(levels=7), QSGDCompressor(levels=20)],
    ids=["signs", "4bit", "8bit"],
)
def test_payloads_received_at_odd_offsets_decode_compiled_as_aligned_ones(mode: object, compressor: object) -> None:
    # a gather may hand a payload over at any byte: its codes are copied onto a word before the compiled pass reads
    # them as words (a word view of the bytes where they lie would raise)
    numel = 2 * SIGN_ROW + 32 * 99 + 5
    mode("eager")
    payloads = _payloads(compressor, 2, numel)
    wire = payloads[1].to_bytes()
    shifted = torch.cat([torch.zeros(1, dtype=torch.uint8), wire])[1:]
    odd = compressor.unpack(shifted, payloads[1].shape, torch.float32)
    codes = odd.bits if isinstance(odd, SignPayload) else odd.packed
    assert codes.storage_offset() % 4 == 1  # off a word: the copy is what runs
    compiled, eager = _both(mode, lambda: compressor.average_all([payloads[0], odd], torch.zeros(numel), 2))
    mode("compiled")
    aligned = compressor.average_all(payloads, torch.zeros(numel), 2)
    assert torch.equal(compiled, aligned) and torch.equal(compiled, eager)


@pytest.mark.parametrize(
    "compressor", [QSGDCompressor(levels=7), BlockQuantizer(p=2, block_size=512)], ids=["qsgd-4bit", "ternary"]
)
def test_a_compiled_payload_added_into_a_state_is_the_eager_chunks_within_one_rounding(
    mode: object, compressor: object
) -> None:
    (payload,) = _payloads(compressor, 1)
    base = torch.randn(NUMEL, generator=torch.Generator().manual_seed(7))
    dense = compressor.decompress(payload)
    calls = add_fields_.compiled_calls
    compiled, eager = _both(mode, lambda: payload.entries().add_to_(base.clone()))
    assert torch.equal(compiled, eager)  # alpha = 1: x + code * scale, one rounding either way
    compiled, eager = _both(mode, lambda: payload.entries().add_to_(base.clone(), alpha=0.3))
    # eager torch adds alpha * v with one fused multiply-add, the kernel rounds alpha * v first: one rounding apart
    bound = 2 * U * ((0.3 * dense).abs() + eager.abs())
    assert bool(((compiled - eager).abs() <= bound).all()) and not torch.equal(compiled, base)
    assert add_fields_.compiled_calls == calls + 2
    # a parameter's slice runs compiled over the whole planar rows inside it (of 8192 ternary codes, 4096 levels),
    # eagerly at its ends: the same sums; a slice holding no whole row, eagerly throughout
    mode("compiled")
    for first, count, compiled_calls in [(512, 16384, 3), (7, 16384, 4), (7, 1000, 4), (8192, 1000, 4)]:
        part = payload.entries().split([first, count, NUMEL - first - count])[1]
        expected = base[first : first + count] + dense[first : first + count]
        assert torch.equal(part.add_to_(base[first : first + count].clone()), expected), (first, count)
        assert add_fields_.compiled_calls == calls + compiled_calls, (first, count)


def test_dianas_compiled_shift_step_writes_the_estimate_exactly_and_the_shift_within_one_rounding(
    mode: object,
) -> None:
    mean = torch.randn(NUMEL, generator=torch.Generator().manual_seed(1))
    shift = torch.randn(NUMEL, generator=torch.Generator().manual_seed(2))
    results = {}
    for codecs in ("compiled", "eager"):
        mode(codecs)
        memory = Diana(alpha=0.3)
        memory.load_state_dict({"h/w": shift})
        out = mean.clone()
        memory.conclude_("w", out, out, NUMEL, update=True)
        results[codecs] = (out, memory.shifts("w")[1])
    (estimate, moved), (eager_estimate, eager_moved) = results["compiled"], results["eager"]
    assert torch.equal(estimate, eager_estimate) and torch.equal(estimate, shift + mean)
    assert bool(((moved - eager_moved).abs() <= 2 * U * ((0.3 * mean).abs() + eager_moved.abs())).all())
    assert shift_and_estimate_.compiled_calls >= 1


def _train(group: dist.ProcessGroup, preset: str, codecs: str) -> dict:
    set_codec_mode(codecs)
    kernels = (mean_of_fields_, add_fields_, shift_and_estimate_, mean_of_signs_, subtract_signs_)
    before = [k.compiled_calls for k in kernels]
    torch.manual_seed(0)
    model = Net()
    ddp = DistributedDataParallel(model, process_group=group)
    hook = make_hook(ddp, preset, warmup_steps=0, min_compress_numel=100)
    ddp.register_comm_hook(hook, gradcomp_comm_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    rank = dist.get_rank(group)
    x, y = torch.randn(32, 64, generator=torch.Generator().manual_seed(rank)), torch.randint(0, 4, (32,))
    for _ in range(4):
        optimizer.zero_grad()
        nn.functional.cross_entropy(ddp(x), y).backward()
        optimizer.step()
    return {
        "weights": [p.detach().clone() for p in model.parameters()],
        "calls": [k.compiled_calls - b for k, b in zip(kernels, before, strict=True)],
    }


def _compiled_and_eager(rank: int, world_size: int) -> dict:
    group = dist.new_group(backend="gloo")
    return {
        preset: {codecs: _train(group, preset, codecs) for codecs in ("compiled", "eager")}
        for preset in ("ddp_diana", "ddp_efsign")
    }


def test_two_ranks_train_diana_and_ef_sign_through_the_compiled_decodes_as_eagerly() -> None:
    results = run_ranks(_compiled_and_eager, 2, timeout=900)
    for rank, result in enumerate(results):
        diana, sign = result["ddp_diana"], result["ddp_efsign"]
        # every compressed step of the hidden layer: the mean, this rank's h_i step and DIANA's h step, compiled
        assert all(n >= 4 for n in diana["compiled"]["calls"][:3]) and not any(diana["eager"]["calls"]), rank
        assert all(n >= 4 for n in sign["compiled"]["calls"][3:]) and not any(sign["eager"]["calls"]), rank
        # EF-sign's compiled magnitude sums in another order, DIANA's shift steps round alpha * v apart: a few
        # roundings per step, far below the step itself
        for preset in (diana, sign):
            for a, b in zip(preset["compiled"]["weights"], preset["eager"]["weights"], strict=True):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    for preset in ("ddp_diana", "ddp_efsign"):
        first, second = (r[preset]["compiled"]["weights"] for r in results)
        for a, b in zip(first, second, strict=True):
            assert torch.equal(a, b), preset  # the ranks agree


def test_the_compiled_mean_of_terngrad_codes_under_a_shared_scaler_is_the_eager_integer_sum_bit_for_bit(
    mode: object,
) -> None:
    compressor = TernGradCompressor()
    shared = torch.tensor(4.0)  # the MAX over ranks the hook would pass
    payloads = []
    for rank in range(3):
        x = torch.randn(NUMEL, generator=torch.Generator().manual_seed(rank))
        payload = compressor.compress(x, CounterStream(rank), scale=shared, local_scale=compressor.local_scale(x))
        payloads.append(payload if rank == 0 else compressor.unpack(payload.to_bytes().clone(), x.shape, x.dtype))
    calls = mean_of_summed_fields_.compiled_calls
    compiled, eager = _both(mode, lambda: compressor.average_all(payloads, torch.full((NUMEL,), 9.0), 3))
    assert mean_of_summed_fields_.compiled_calls == calls + 1
    codes = sum(p.codes.to(torch.int32) for p in payloads)
    assert torch.equal(compiled, eager) and torch.equal(eager, codes.float() * 4.0 / 3)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_rank_whose_scaler_is_not_finite_makes_the_shared_scaler_mean_not_finite_without_a_comparison(
    mode: object, bad: float
) -> None:
    """Catches: the shared scaler taken from the own payload's flag (no comparison of the ranks' scalers, which waits
    for a GPU) hiding a rank whose scaler is NaN or infinite (its gradient was not finite), which must reach the
    optimizer as a non-finite mean, as decoding each payload with its own scaler gives."""
    compressor = TernGradCompressor()
    shared = torch.tensor(4.0)
    x = torch.randn(NUMEL, generator=torch.Generator().manual_seed(5))
    own = compressor.compress(x, CounterStream(5), scale=shared, local_scale=compressor.local_scale(x))
    received = [compressor.unpack(own.to_bytes().clone(), x.shape, x.dtype) for _ in range(2)]
    assert own.shared and not received[0].shared
    received[1].scales.fill_(bad)  # the scaler that rank sent
    for run in ("compiled", "eager"):
        mode(run)
        for combine in (
            lambda: compressor.average_all([received[0], own, received[1]], torch.zeros(NUMEL), 3),
            lambda: compressor.accumulate_all([received[0], own, received[1]], torch.zeros(NUMEL)),
        ):
            assert not bool(combine().isfinite().any()), (run, bad)
    healthy = compressor.average_all([received[0], own], torch.zeros(NUMEL), 2)
    mode("eager")
    assert torch.equal(healthy, compressor.accumulate_all([received[0], received[0]], torch.zeros(NUMEL)) / 2)


@pytest.mark.parametrize("first", [0, SIGN_ROW, 32, 3])  # a parameter starting on a row edge, or inside a row (eager)
def test_ef_signs_compiled_residual_is_the_eager_copy_then_add_bit_for_bit(mode: object, first: int) -> None:
    compressor = ScaledSignCompressor()
    numel = 2 * SIGN_ROW + 32 * 99 + 5
    compensated = torch.randn(numel, generator=torch.Generator().manual_seed(3))
    mode("eager")
    payload = compressor.compress(torch.randn(numel + first, generator=torch.Generator().manual_seed(4)))
    _, entries = payload.entries().split([first, numel]) if first else (None, payload.entries())
    calls = subtract_signs_.compiled_calls
    compiled, eager = _both(mode, lambda: entries.subtract_from(compensated, torch.full((numel,), 9.0)))
    assert subtract_signs_.compiled_calls == calls + (first % SIGN_ROW == 0)
    assert torch.equal(compiled, eager)
    assert torch.equal(eager, compensated - compressor.decompress(payload)[first:])


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_compiled_means_on_cuda_are_the_cpus_within_roundings_and_never_wait_for_the_host(mode: object) -> None:
    cuda = torch.device("cuda")
    mode("eager")
    for compressor in (QSGDCompressor(levels=7), ScaledSignCompressor()):
        payloads = _payloads(compressor, 3)
        expected = compressor.average_all(payloads, torch.empty(NUMEL), 3)
        mode("compiled")
        on_device = [compressor.unpack(p.to_bytes().to(cuda), p.shape, p.dtype) for p in payloads]
        out = torch.empty(NUMEL, device=cuda)
        compressor.average_all(on_device, out, 3)  # compile first: compiling may wait
        assert host_waits(partial(compressor.average_all, on_device, out, 3), cuda) == 0
        # on CUDA, inductor divides by the constant 3 as a multiplication by its reciprocal and Triton may fuse a
        # multiply-add: a few roundings, each at most u of the terms' magnitudes
        magnitude = sum(compressor.decompress(p).abs() for p in payloads) / 3
        assert bool(((out.cpu() - expected).abs() <= 4 * U * magnitude).all())
        mode("eager")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_terngrad_mean_under_the_shared_scaler_on_cuda_is_the_cpus_and_never_waits_for_the_host(
    mode: object,
) -> None:
    """Catches: the ranks' scalers compared on the device (a read back per unit and step) where the own payload says
    it was drawn under the hook's shared scaler."""
    cuda, compressor, shared = torch.device("cuda"), TernGradCompressor(), torch.tensor(4.0)
    mode("compiled")
    on_cpu, on_device = [], []
    for rank in range(3):
        x = torch.randn(NUMEL, generator=torch.Generator().manual_seed(rank))
        own = compressor.compress(x.to(cuda), CounterStream(rank, cuda), scale=shared.to(cuda))
        wire = own.to_bytes()
        on_device.append(own if rank == 0 else compressor.unpack(wire.clone(), x.shape, x.dtype))
        on_cpu.append(compressor.unpack(wire.cpu(), x.shape, x.dtype))
    out = torch.empty(NUMEL, device=cuda)
    compressor.average_all(on_device, out, 3)  # compile first: compiling may wait
    assert host_waits(partial(compressor.average_all, on_device, out, 3), cuda) == 0
    mode("eager")
    expected = compressor.accumulate_all(on_cpu, torch.zeros(NUMEL)) / 3  # the integer sum, scaled once, divided
    assert bool(((out.cpu() - expected).abs() <= 4 * U * expected.abs()).all())
