"""EF-SignSGD's scaled sign: bit packing, the exact compressed value and contraction, the wire size,
arguments; on real ranks the error-feedback invariant and identical ranks (resume: test_resume.py)."""

from __future__ import annotations

import math

import pytest
import torch
from ranks import run_ranks
from test_hook import _make_hook, _train

from lightning_gradcomp import NAMED_STRATEGIES, GradCompStrategy
from lightning_gradcomp.core.compressors import ScaledSignCompressor, SignPayload
from lightning_gradcomp.core.compressors import sign as sign_module
from lightning_gradcomp.core.compressors.kernels import SIGN_ROW, SIGN_STRIPE
from lightning_gradcomp.core.compressors.sign import pack_signs, signs_at
from lightning_gradcomp.core.compressors.sparse import dense_of
from lightning_gradcomp.core.memory import ErrorFeedback


def planar_reference(bits: torch.Tensor) -> torch.Tensor:
    """The wire's sign bytes from the layout's definition, element by element: sign ``j`` of a whole row ``r`` at word
    ``r * 512 + j % 512``, bit ``(j % 16384) // 512``; in the last, partial row of ``m`` signs, stripes of
    ``ceil(m / 32)`` words; each word little-endian."""
    numel = bits.numel()
    whole = numel // SIGN_ROW * SIGN_ROW
    j = torch.arange(numel)
    in_tail = j >= whole
    stripe = torch.where(in_tail, -(-(numel - whole) // 32), SIGN_STRIPE)
    offset = torch.where(in_tail, j - whole, j % SIGN_ROW)
    word = torch.where(in_tail, whole // 32, j // SIGN_ROW * SIGN_STRIPE) + offset % stripe
    words = torch.zeros(-(-numel // 32), dtype=torch.long).index_add_(0, word, bits.long() << (offset // stripe))
    return ((words[:, None] >> (8 * torch.arange(4))) & 255).to(torch.uint8).reshape(-1)


@pytest.mark.parametrize("numel", [1, 7, 8, 9, 31, 32, 33, 1001, SIGN_ROW, SIGN_ROW + 1, 3 * SIGN_ROW + 999])
def test_signs_pack_thirty_two_per_word_in_planar_rows_and_come_back(numel: int) -> None:
    x = torch.randn(numel, generator=torch.Generator().manual_seed(numel))
    packed = pack_signs(x)
    assert packed.dtype == torch.uint8 and packed.numel() == 4 * math.ceil(numel / 32)
    assert torch.equal(packed, planar_reference(x >= 0))
    signs = torch.where(x >= 0, 1.0, -1.0)
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        assert torch.equal(signs_at(packed, numel, 0, numel, dtype), signs.to(dtype))
    for first in {0, 1, numel // 3, max(0, numel - SIGN_ROW - 5)}:  # ranges across rows and into the last one
        count = (numel - first) // 2 + 1 if first < numel else 0
        assert torch.equal(signs_at(packed, numel, first, count, torch.float32), signs[first : first + count])


def test_sends_the_mean_magnitude_times_the_sign() -> None:
    x = torch.randn(37, 11, generator=torch.Generator().manual_seed(0))
    x.view(-1)[5] = 0.0  # sign(0) goes out as +
    compressor = ScaledSignCompressor()
    decoded = compressor.decompress(compressor.compress(x))
    scale = x.abs().sum() / x.numel()
    assert torch.equal(decoded, torch.where(x.reshape(-1) >= 0, scale, -scale))
    assert decoded.dtype == x.dtype
    half = x.to(torch.bfloat16)
    assert compressor.decompress(compressor.compress(half)).dtype == torch.bfloat16


def test_is_the_contraction_of_karimireddy_et_al() -> None:
    x = torch.randn(500, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    compressor = ScaledSignCompressor()
    error = (compressor.decompress(compressor.compress(x)) - x).pow(2).sum()
    # ||C(x) - x||^2 = ||x||^2 - ||x||_1^2 / d (scale in float32: agreement to its precision)
    expected = x.pow(2).sum() - x.abs().sum() ** 2 / x.numel()
    assert float(error) == pytest.approx(float(expected), rel=1e-6)
    assert float(error) < (1 - 1 / x.numel()) * float(x.pow(2).sum())
    assert not compressor.unbiased and "error feedback" in compressor.bias_reason


def test_wire_is_a_scale_and_one_bit_per_element() -> None:
    x = torch.randn(1001, generator=torch.Generator().manual_seed(2))
    compressor = ScaledSignCompressor()
    payload = compressor.compress(x)
    wire = payload.to_bytes()
    assert wire.numel() == payload.nbytes == compressor.payload_nbytes(x.shape, x.dtype) == 4 + 128  # 32 words
    back = compressor.unpack(wire, x.shape, x.dtype)
    assert isinstance(back, SignPayload)
    assert torch.equal(compressor.decompress(back), compressor.decompress(payload))
    with pytest.raises(ValueError, match="sign payload of 131 bytes, expected 132"):
        compressor.unpack(wire[:-1], x.shape, x.dtype)


def test_the_preset_and_diana_refusing_it() -> None:
    description, params = NAMED_STRATEGIES["ddp_efsign"]
    assert params["compressor"] == "sign" and params["memory"] == "ef" and "1 bit" in description
    with pytest.raises(ValueError, match="a scaled sign keeps only the mean magnitude"):
        GradCompStrategy(compressor="sign", memory="diana")


class _Recording(ErrorFeedback):
    """Error feedback that keeps what it took in and gave back (sent decoded dense), per unit and step."""

    def __init__(self) -> None:
        super().__init__()
        self.log: list[dict] = []

    def compensate_(self, name: str, x: torch.Tensor) -> torch.Tensor:
        old = self.residual(name)
        entry = {"name": name, "grad": x.clone(), "old": None if old is None else old.clone()}
        acc = super().compensate_(name, x)
        self.log.append({**entry, "acc": acc.clone()})
        return acc

    def settle_(self, name, compensated, sent, unit_numel, finite=True) -> None:
        super().settle_(name, compensated, sent, unit_numel, finite)
        entry = next(e for e in reversed(self.log) if e["name"] == name)
        entry.update(sent=dense_of(sent).clone(), new=self.residual(name).clone())


def _efsign(rank: int, world_size: int) -> dict:
    memory = _Recording()
    model, hook = _train(rank, world_size, _make_hook(ScaledSignCompressor(), memory, "layer", warmup=1))
    return {"log": memory.log, "weights": model.state_dict(), "history": list(hook.history)}


@pytest.mark.parametrize("world_size", [2, 3])
def test_on_real_ranks_error_feedback_is_exact_and_ranks_agree(world_size: int) -> None:
    results = run_ranks(_efsign, world_size)
    for r in results:
        assert {e["name"] for e in r["log"]} == {"0.weight", "2.weight"}
        for e in r["log"]:
            old = torch.zeros_like(e["grad"]) if e["old"] is None else e["old"]
            assert torch.equal(e["acc"], e["grad"] + old)
            assert torch.equal(e["new"], e["acc"] - e["sent"])  # residual = what was not sent, exactly
            assert e["sent"].abs().unique().numel() == 1  # one magnitude: the scale
        for s in r["history"][1:]:
            # compressed payloads: 4 + 2048/8 and 4 + 256/8 bytes (whole words) for the weights (fp32: 9,216 bytes)
            assert s.payload_bytes == (4 + 256) + (4 + 32)
    for r in results[1:]:
        for name, value in r["weights"].items():
            assert torch.equal(value, results[0]["weights"][name]), name


@pytest.mark.parametrize("numel", [0, 1, 7, 8, 9, sign_module.STREAM_CHUNK - 3, sign_module.STREAM_CHUNK * 2 + 13])
def test_signs_packed_and_decoded_in_chunks_are_the_one_pass_forms_bit_for_bit(numel: int) -> None:
    x = torch.randn(numel, generator=torch.Generator().manual_seed(numel))
    x[::5] = 0.0
    x[1::7] = -0.0  # -0.0 >= 0: sent as +, as every zero
    assert torch.equal(sign_module.pack_signs(x), planar_reference(x >= 0))
    payload = ScaledSignCompressor().compress(x)
    l1 = sign_module.l1_norm(x)
    assert torch.equal(payload.scale, l1 / max(1, numel)) and l1.dtype == torch.float32
    if numel <= sign_module.STREAM_CHUNK:
        assert torch.equal(l1, x.abs().sum())  # one chunk: the one-pass sum itself
    else:  # float32 pairwise sums of chunks of 2**20 added in float64: within 20 roundings of the exact sum
        assert float(l1) == pytest.approx(float(x.double().abs().sum()), rel=20 * 2**-24)
    base = torch.randn(numel, generator=torch.Generator().manual_seed(1))
    signs = torch.where(x >= 0, 1.0, -1.0)
    assert torch.equal(payload.add_to_(base.clone()), base.addcmul(signs, payload.scale))


def test_error_feedback_takes_the_signs_encoded_slice_by_slice_with_the_dense_residual_bit_for_bit() -> None:
    numel = sign_module.STREAM_CHUNK + 1001
    p = torch.randn(numel, generator=torch.Generator().manual_seed(2))
    payload = ScaledSignCompressor().compress(p)
    sent = payload.entries()
    dense = ScaledSignCompressor().decompress(payload)
    assert torch.equal(sent.to_dense(), dense) and sent.all_finite()
    half = ScaledSignCompressor().compress(p.to(torch.bfloat16)).entries()
    assert half.to_dense().dtype == torch.bfloat16 and half.split([5, numel - 5])[1].to_dense().dtype == torch.bfloat16
    assert torch.equal(sent.add_to_(p.clone(), alpha=-1), p - dense)  # the residual p - C(p), one rounding each
    sizes = [3, 13, sign_module.STREAM_CHUNK - 5, numel - 11 - sign_module.STREAM_CHUNK]  # slices off byte edges
    slices = sent.split(sizes)
    assert torch.equal(torch.cat([s.to_dense() for s in slices]), dense)
    parts = p.split(sizes)
    assert torch.equal(
        torch.cat([s.add_to_(q.clone(), alpha=-1) for s, q in zip(slices, parts, strict=True)]), p - dense
    )


def test_error_feedback_takes_the_finiteness_of_a_scaled_sign_from_its_scale_without_reading_the_tensor(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import lightning_gradcomp.core.memory as memory_module

    reads = []
    monkeypatch.setattr(memory_module, "all_finite", lambda x: reads.append(x.numel()) or bool(x.isfinite().all()))
    compressor, memory = ScaledSignCompressor(), ErrorFeedback()
    x = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    parts = compressor.compress(x).entries().split([400, 600])
    memory.update("a", x[:400].clone(), parts[0], None)
    assert torch.equal(memory.residual("a"), x[:400] - compressor.decompress(compressor.compress(x))[:400])
    poisoned = x.clone()
    poisoned[700] = float("nan")  # in the other parameter of the unit: the shared scale is NaN
    before = memory.residual("a").clone()
    bad = compressor.compress(poisoned).entries().split([400, 600])
    assert not bad[0].all_finite()
    memory.update("a", poisoned[:400].clone(), bad[0], None)
    assert torch.equal(memory.residual("a"), before) and reads == []  # kept, and never re-read
