"""2-bit values for sparse payloads (``wire_precision="2bit"``) and error feedback with decay (SparseLoCo's buffer)."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_gradcomp import GradCompStrategy
from lightning_gradcomp.core.compressors import GaussianKCompressor, RandomKCompressor, TopKCompressor, TwoBitValues
from lightning_gradcomp.core.compressors.indices import encoded_nbytes
from lightning_gradcomp.core.memory import ErrorFeedback


def _payload(numel: int = 20_000, density: float = 0.02, seed: int = 0):
    x = torch.randn(numel, generator=torch.Generator().manual_seed(seed))
    codec = TwoBitValues(TopKCompressor(density))
    return x, codec, codec.compress(x)


def test_the_wire_form_is_exactly_the_declared_size_and_parses_back_to_the_same_payload() -> None:
    x, codec, payload = _payload()
    k = 400
    assert payload.k == k
    blocks = math.ceil(k / 256)
    assert (
        payload.nbytes
        == encoded_nbytes(x.numel(), k) + 4 * math.ceil(k / 16) + 8 * blocks
        == payload.to_bytes().numel()
    )
    assert codec.payload_nbytes(x.shape, x.dtype) == payload.nbytes
    back = codec.unpack(payload.to_bytes(), x.shape, x.dtype)
    assert torch.equal(back.indices, payload.indices) and torch.equal(back.values(), payload.values())
    with pytest.raises(ValueError, match="expected"):
        codec.unpack(payload.to_bytes()[:-1], x.shape, x.dtype)


def test_each_value_keeps_its_sign_and_takes_the_mean_magnitude_of_its_side_of_the_block_mean() -> None:
    x, _, payload = _payload()
    chosen = x[payload.indices]
    assert torch.equal(torch.sort(chosen.abs()).values, torch.sort(x.abs()).values[-payload.k :])  # the Top-k
    values = payload.values()
    assert torch.equal(values.sign(), chosen.sign())
    for start in range(0, payload.k, 256):
        block = chosen[start : start + 256].abs().double()
        high = block >= block.mean()
        got = values[start : start + 256].abs().double()
        assert torch.allclose(got[high], block[high].mean().expand(int(high.sum())), rtol=1e-6)
        assert torch.allclose(got[~high], block[~high].mean().expand(int((~high).sum())), rtol=1e-6)


def test_rounding_the_kept_entries_to_two_levels_loses_less_than_dropping_them() -> None:
    """Each side's mean minimises the squared error of its entries: the residual is below the input (a contraction,
    what error feedback needs), and below Top-k's own bound plus the rounding."""
    for seed in range(5):
        x, codec, payload = _payload(seed=seed)
        sent = codec.decompress(payload)
        assert float((x - sent).norm() ** 2) < float(x.norm() ** 2) * (1 - 0.5 * payload.k / x.numel())


def test_it_wraps_fixed_count_sparsifiers_only() -> None:
    TwoBitValues(RandomKCompressor(0.1, scaled=False))
    with pytest.raises(ValueError, match=r"wire_precision='2bit' quantises the values of a sparsifier of fixed count"):
        TwoBitValues(GaussianKCompressor(0.01))
    with pytest.raises(ValueError, match="block_size"):
        TwoBitValues(TopKCompressor(0.01), block_size=0)
    with pytest.raises(ValueError, match=r"use aggregator='allgather' or 'auto', not 'gtopk'"):
        GradCompStrategy(compressor="topk", wire_precision="2bit", aggregator="gtopk")
    assert isinstance(GradCompStrategy(compressor="topk", wire_precision="2bit").compressor, TwoBitValues)


def test_error_feedback_decays_the_residual_before_adding_it() -> None:
    memory = ErrorFeedback(decay=0.5)
    grad = torch.tensor([1.0, -2.0, 3.0, 0.25])
    acc = memory.compensate("w", grad)
    sent = torch.tensor([0.0, 0.0, 3.0, 0.0])
    memory.update("w", acc, sent, sent)
    assert torch.equal(memory.residual("w"), torch.tensor([1.0, -2.0, 0.0, 0.25]))
    acc = memory.compensate("w", torch.ones(4))
    assert torch.equal(acc, torch.tensor([1.5, 0.0, 1.0, 1.125]))  # grad + 0.5 * residual
    flushed = torch.zeros(4)
    memory.update("w", acc, torch.zeros(4), torch.zeros(4))
    memory.flush_("w", flushed)
    assert torch.equal(flushed, 0.5 * acc) and not memory.residual("w").any()
    with pytest.raises(ValueError, match=r"memory 'ef': decay must be"):
        ErrorFeedback(decay=1.5)
    with pytest.raises(ValueError, match="use one or the other"):
        ErrorFeedback(momentum=0.9, decay=0.9)
