"""Codec kernels compiled by torch's compiler are their eager oracle's: the same codes and packed bytes exactly, floats
within the rounding of another summation order; no recompiles after the first call of a size; compiled from a DDP
comm hook on a training thread; and where no compiler runs, one warning and the eager result.

The suite runs kernels eagerly (``conftest.py``); these tests switch the mode. Sizes are few and fixed, so each
kernel compiles once per session (seconds each, cached on disk for later runs).
"""

from __future__ import annotations

import math
import re
import warnings
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
from backward_thread import train_on_a_backward_thread
from ranks import run_ranks
from torch._dynamo.utils import counters

import lightning_gradcomp.core.fused as fused_module
from lightning_gradcomp.core.compressors import QSGDCompressor, ScaledSignCompressor, TernGradCompressor
from lightning_gradcomp.core.compressors.kernels import clipped_scale, draw_codes, draw_packed_codes, encode_signs
from lightning_gradcomp.core.compressors.ternary import ENCODE_CHUNK
from lightning_gradcomp.core.fused import FusedKernel, codec_mode, set_codec_mode
from lightning_gradcomp.core.randomness import CounterStream

#: Two eager chunks, the second partial: the eager path draws piecewise, the compiled one in one kernel.
NUMEL = ENCODE_CHUNK + 4_321
EPS32 = torch.finfo(torch.float32).eps / 2  # fp32's unit roundoff


@pytest.fixture
def mode() -> object:
    """Restores the suite's codec mode after a test that switches it."""
    yield set_codec_mode
    fused_module._mode = None


def _gradient(seed: int) -> torch.Tensor:
    return torch.randn(NUMEL, generator=torch.Generator().manual_seed(seed)) * 1e-3


def _compress_both(
    compressor: object, x: torch.Tensor, key: int, mode: object, **extra: object
) -> tuple[object, object]:
    mode("compiled")
    compiled = compressor.compress(x, CounterStream(key), **extra)
    mode("eager")
    return compiled, compressor.compress(x, CounterStream(key), **extra)


@pytest.mark.parametrize(
    "compressor",
    [TernGradCompressor(), QSGDCompressor(levels=7), QSGDCompressor(levels=7, block_size=7)],
    ids=["terngrad", "qsgd-4bit", "qsgd-blocks-of-7"],  # blocks of 7: no eager chunk of 2^18 holds whole blocks
)
def test_compiled_stochastic_codes_are_the_eager_chunked_draws_byte_for_byte(compressor: object, mode: object) -> None:
    # blocks that do not line up with the planar rows are drawn in eager chunks: no kernel runs compiled
    unaligned = getattr(compressor, "block_size", None) == 7
    calls = [draw_codes.compiled_calls, draw_packed_codes.compiled_calls]
    for key in (1, 2):
        x = _gradient(key)
        # TernGrad's scaler is a float from reductions (compared in the next test): both draw under the eager one
        extra = {"local_scale": compressor.local_scale(x)} if isinstance(compressor, TernGradCompressor) else {}
        compiled, eager = _compress_both(compressor, x, key, mode, **extra)
        assert torch.equal(compiled.to_bytes(), eager.to_bytes())
    assert [draw_codes.compiled_calls, draw_packed_codes.compiled_calls] == [calls[0], calls[1] + 2 * (not unaligned)]


def test_the_compiled_scaler_is_the_eager_one_within_the_rounding_of_a_reordered_variance(mode: object) -> None:
    calls = clipped_scale.compiled_calls
    for key, clip in [(4, 2.5), (5, 2.5), (4, 0.0)]:
        g = _gradient(key)
        g[11] = 0.05  # one outlier: 2.5 sigma binds, below max|g|
        mode("compiled")
        compiled = float(clipped_scale(g, clip))
        mode("eager")
        eager = float(clipped_scale(g, clip))
        if clip == 0:  # max|g| is exact in any order
            assert compiled == eager == float(torch.tensor(0.05))
        else:
            # the variance is a sum of d squared deviations: in another order within about 2 (d - 1) u of the eager
            # one, relatively; the square root halves that, and the mean, the division and c * sigma add a few u
            assert eager < 0.05 and abs(compiled - eager) <= ((NUMEL - 1) * EPS32 + 8 * EPS32) * eager
    assert clipped_scale.compiled_calls == calls + 3


def test_compiled_signs_are_the_eager_bits_and_the_magnitude_within_summation_rounding(mode: object) -> None:
    for magnitude in ("mean", "rms"):
        x = _gradient(3)
        compiled, eager = _compress_both(ScaledSignCompressor(magnitude), x, 0, mode)
        assert torch.equal(compiled.bits, eager.bits)
        # a sum of d terms of one sign, in any order, is within (d - 1) u of the exact sum S, so the two sums are
        # within 2 (d - 1) u S; the magnitude S / d (or sqrt(S / d), half the relative error) adds a few roundings
        scale = float(eager.scale)
        relative = 2 * (NUMEL - 1) * EPS32 * (1.0 if magnitude == "mean" else 0.5)
        assert abs(float(compiled.scale) - scale) <= (relative + 4 * EPS32) * scale


# the encoders under functions of their own: dynamo compiles these afresh (the codecs' compiled frames would be reused,
# and no code generated to read)
def _packed(*arguments: object) -> torch.Tensor:
    return draw_packed_codes.function(*arguments)


def _signs(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return encode_signs.function(x, False)


def _buffers(function: Callable[..., object], *arguments: object) -> list[int]:
    """Bytes of each buffer that inductor's wrapper of ``function`` allocates per call, read from its generated code
    (its own allocations bypass the profiler's count)."""
    from unittest import mock

    from torch._inductor.graph import GraphLowering

    codes: list[str] = []
    with (
        mock.patch.object(GraphLowering, "save_output_code", codes.append),
        torch._inductor.config.patch(fx_graph_cache=False),
    ):
        torch.compile(function, dynamic=False, fullgraph=True)(*arguments)
    pattern = r"empty_strided_cpu\(\(([\d, ]*)\), \([\d, ]*\), torch\.(\w+)\)"
    return [
        math.prod(int(d) for d in shape.split(",") if d.strip()) * getattr(torch, dtype).itemsize
        for shape, dtype in re.findall(pattern, "".join(codes))
    ]


def test_the_compiled_encoders_allocate_their_words_and_nothing_larger() -> None:
    """A compiled encoder allocates its wire words and a few small pieces: no int32 plane of each field before them
    (16 of them for the ternary codes, 32 for the signs). The sign encoder also keeps one float32 partial sum of the
    magnitude per word (the sum over a word's planes, read in the same loop as its bits)."""
    numel = 2 * 16384  # whole rows of both layouts
    x = _gradient(6)[:numel]
    arguments = (torch.tensor([900.0]), CounterStream(3).block(numel), None, 0, numel, False, 1, 4, 1)
    nbytes, sign_bytes = 4 * -(-numel // 16), 4 * -(-numel // 32)
    codes = _buffers(_packed, x, *arguments)
    signs = _buffers(_signs, x)
    assert nbytes <= sum(codes) <= nbytes + 2048 and max(codes) <= nbytes
    assert 2 * sign_bytes <= sum(signs) <= 2 * sign_bytes + 2048 and max(signs) <= sign_bytes


def test_new_keys_and_new_values_reuse_the_compiled_kernels(mode: object) -> None:
    mode("compiled")
    compressor = TernGradCompressor()
    compressor.compress(_gradient(0), CounterStream(5))
    graphs, calls = counters["stats"]["unique_graphs"], draw_packed_codes.compiled_calls
    for step in range(6):
        compressor.compress(_gradient(10 + step), CounterStream(1000 + step))
    assert counters["stats"]["unique_graphs"] == graphs  # a stream's key travels as a tensor: no specialisation
    assert draw_packed_codes.compiled_calls == calls + 6


def test_without_a_compiler_kernels_warn_once_and_run_eagerly(mode: object, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fused_module, "_broken", {})
    monkeypatch.setattr(fused_module, "AHEAD_DEVICES", ())  # torch.compile's path under "auto" (CUDA's; test_ahead.py)
    # inductor's own patching restores its settings (monkeypatching its config module deleted a hidden one)
    settings = (torch._inductor.config.fx_graph_cache, torch._inductor.config.cpp.cxx)
    with torch._inductor.config.patch({"cpp.cxx": ("/nonexistent/c++",), "fx_graph_cache": False}):
        mode("auto")
        kernel = FusedKernel(lambda x: (x * 3).sum(0))  # a fresh function: nothing of it is cached
        x = torch.arange(12.0).reshape(4, 3)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            first, second = kernel(x), kernel(x)
        ours = [w for w in caught if "cannot build codec kernels" in str(w.message)]
        assert len(ours) == 1 and issubclass(ours[0].category, RuntimeWarning)
        assert "InvalidCxxCompiler" in str(ours[0].message)
        assert torch.equal(first, x.sum(0) * 3) and torch.equal(second, first)
        assert kernel.compiled_calls == 0
        mode("compiled")  # the setting that wants to know: the failure is raised
        monkeypatch.setattr(fused_module, "_broken", {})
        with pytest.raises(Exception, match="InvalidCxxCompiler"):
            FusedKernel(lambda x: (x * 5).sum(0))(x)
    assert (torch._inductor.config.fx_graph_cache, torch._inductor.config.cpp.cxx) == settings


def test_the_mode_is_validated_where_it_enters(monkeypatch: pytest.MonkeyPatch, mode: object) -> None:
    with pytest.raises(ValueError, match=r"mode must be one of .*'auto'.*got 'fast'"):
        set_codec_mode("fast")  # type: ignore[arg-type]
    monkeypatch.setenv("GRADCOMP_CODECS", "jit")
    with pytest.raises(ValueError, match=r"GRADCOMP_CODECS must be one of .*got 'jit'"):
        codec_mode()


def _compiled_and_eager(rank: int, world_size: int) -> dict:
    group = dist.new_group(backend="gloo")
    train = train_on_a_backward_thread
    return {"compiled": train(group, "compiled", "compiled", 4), "eager": train(group, "eager", "compiled", 4)}


def test_a_comm_hook_on_a_backward_thread_runs_the_compiled_kernels_and_trains_as_eager() -> None:
    (result,) = run_ranks(_compiled_and_eager, 1, timeout=600)
    compiled, eager = result["compiled"], result["eager"]
    assert compiled["calls"] >= 4 and eager["calls"] == 0  # every step's unit, compiled
    assert compiled["callers"] == [f"backward-{step}" for step in range(4)]
    for a, b in zip(compiled["weights"], eager["weights"], strict=True):
        assert torch.equal(a, b)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_kernels_on_cuda_are_the_cpus_and_never_wait_for_the_host(mode: object) -> None:
    mode("compiled")
    x = _gradient(4)
    multipliers, cuda = torch.tensor([900.0]), torch.device("cuda")
    stream_cpu, stream_gpu = CounterStream(9), CounterStream(9, cuda)
    arguments = (None, 0, NUMEL, False, 1, 4, 1)
    expected = draw_packed_codes.eager(x, multipliers, stream_cpu.block(NUMEL), *arguments)
    gx, gm = x.to(cuda), multipliers.to(cuda)
    draw_packed_codes(gx, gm, stream_gpu.block(NUMEL), *arguments)  # compile first: compiling may synchronise
    encode_signs(gx, False)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        packed = draw_packed_codes(gx, gm, CounterStream(9, cuda).block(NUMEL), *arguments)
        _, bits = encode_signs(gx, False)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(packed.cpu(), expected)
    assert torch.equal(bits.cpu(), encode_signs.eager(x, False)[1])


def test_sizes_past_the_recompile_limit_run_eagerly_with_one_warning(
    mode: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(fused_module, "RECOMPILE_LIMIT", 2)
    monkeypatch.setattr(fused_module, "AHEAD_DEVICES", ())  # torch.compile's path under "auto" (CUDA's; test_ahead.py)
    with torch._dynamo.config.patch(recompile_limit=2):
        mode("auto")
        kernel = FusedKernel(lambda x: x * 7 + 1)  # a fresh function: its own specialisations
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            results = [kernel(torch.arange(float(n))) for n in (3, 4, 5, 6)]
        ours = [w for w in caught if "more than 2 tensor sizes" in str(w.message)]
        assert len(ours) == 1 and kernel.compiled_calls == 2  # two sizes compiled, the next two eager
        for n, result in zip((3, 4, 5, 6), results, strict=True):
            assert torch.equal(result, torch.arange(float(n)) * 7 + 1)
        assert torch.equal(kernel(torch.arange(3.0)), torch.arange(3.0) * 7 + 1) and kernel.compiled_calls == 3
        mode("compiled")  # the setting that wants to know: the limit is raised
        with pytest.raises(torch._dynamo.exc.FailOnRecompileLimitHit):
            kernel(torch.arange(7.0))


@pytest.mark.parametrize(
    ("multipliers", "block_size", "per_byte", "bias", "fractional"),
    [
        (torch.tensor([1e5]), 1, 4, 1, False),
        (torch.full((33,), 7000.0), 512, 2, 7, True),
        (torch.full((33,), 7000.0), 512, 1, 20, True),
    ],
    ids=["ternary-one-scale", "qsgd-4bit-blocks", "qsgd-8bit-blocks"],
)
def test_codes_drawn_into_their_words_are_the_codes_drawn_then_packed(
    multipliers: torch.Tensor, block_size: int, per_byte: int, bias: int, fractional: bool
) -> None:
    from lightning_gradcomp.core.compressors.kernels import stochastic_codes
    from lightning_gradcomp.core.compressors.planar import pack_fields

    x = _gradient(6)[: 2 * 8192 + 3]  # whole planar rows of every width, then a partial last block and row
    block = CounterStream(11).block(x.numel())
    arguments = (x, multipliers, block, None, 0, block_size, fractional)
    codes = stochastic_codes(*arguments)[: x.numel()]
    expected = pack_fields(codes.to(torch.int32) + bias, per_byte, bias)
    drawn = draw_packed_codes.eager(*arguments, bias, per_byte, bias)
    assert torch.equal(drawn, expected) and int((codes != 0).sum()) > x.numel() // 10


def test_a_big_endian_machine_runs_the_codec_kernels_eagerly(
    mode: Callable[[str], None], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The kernels read the planar codes as words in the machine's byte order, the eager codecs as little-endian
    bytes: only a little-endian machine compiles them, whatever the mode."""
    mode("compiled")
    assert fused_module.compiles_on(torch.device("cpu"))
    monkeypatch.setattr(fused_module.sys, "byteorder", "big")
    assert not fused_module.compiles_on(torch.device("cpu"))
