"""An average in two phases: every rank reduces the slices it owns in float32, quantizes them again, and all gather.

For a block-aligned codec (:class:`~lightning_gradcomp.core.compressors.blockwise.BlockScaledQuantizer`: int8 or fp8
codes with a scale per block), each contribution's payload is cut at block boundaries into one slice per rank:

1. every rank sends slice ``j`` of each payload to rank ``j`` (one all-to-all: ``(P - 1) / P`` of a payload out and
   in per rank);
2. rank ``j`` decodes the ``P`` copies of its slice, sums them in float32, divides by ``P`` and quantizes the mean
   again with the same codec;
3. every rank gathers every owner's quantized slice (one all-gather) and decodes the whole mean.

A rank sends and receives about two payloads, whatever the number of ranks, against ``P`` payloads for an allgather,
and the sum is never taken in 8 bits: what ZeRO++'s quantized gradients (qgZ, Wang et al., 2023) and torchft's
quantized allreduce do. Every rank decodes the same gathered bytes, so every rank holds the same mean, bit for bit.
What of a rank's own payload reached the mean is all of it: error feedback (``memory="ef"``) keeps what the first
quantization dropped; the second quantization's error is not fed back (it is at most half a code of the mean's own
scale).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

import torch
from torch import Tensor

from lightning_gradcomp.core.comm.aggregators import Aggregate, Aggregator, Contribution, Pending, start_dense_apart
from lightning_gradcomp.core.comm.collectives import Collectives
from lightning_gradcomp.core.compressors.blockwise import BlockScaledPayload, BlockScaledQuantizer

__all__ = ["TwoPhaseAggregator"]


class TwoPhaseAggregator(Aggregator):
    """The mean of block-aligned payloads in two phases (see the module's docstring); tensors left dense are
    all-reduced apart."""

    name = "two_phase"

    def start(self, contributions: Sequence[Contribution], collectives: Collectives) -> Pending:
        return start_dense_apart(contributions, collectives, self._two_phase)

    def _two_phase(self, contributions: Sequence[Contribution], collectives: Collectives) -> Pending:
        world, rank = collectives.world_size, collectives.rank
        codecs = [_block_codec(c) for c in contributions]
        bounds = [codec.piece_bounds(c.payload.numel, world) for codec, c in zip(codecs, contributions, strict=True)]
        pieces = [[c.payload.piece(*b) for b in bs] for c, bs in zip(contributions, bounds, strict=True)]  # type: ignore[attr-defined]
        outgoing = [torch.cat([p[j].to_bytes() for p in pieces]) for j in range(world)]
        mine = [_nbytes(codec, c, b[rank]) for codec, c, b in zip(codecs, contributions, bounds, strict=True)]
        received = collectives.all_to_all_bytes(outgoing, [sum(mine)] * world)
        owned = []
        for i, (codec, c) in enumerate(zip(codecs, contributions, strict=True)):
            start, end = bounds[i][rank]
            offset = sum(mine[:i])
            total = torch.zeros(end - start, dtype=torch.float32, device=c.payload.device)
            for source in received:
                piece = codec.unpack(source[offset : offset + mine[i]], torch.Size([end - start]), c.payload.dtype)
                total += codec.decoded(piece)
            owned.append(codec.compress(total.div_(world).to(c.payload.dtype)).to_bytes())
        sizes = [sum(_nbytes(codec, c, b[r]) for codec, c, b in zip(codecs, contributions, bounds, strict=True))
                 for r in range(world)]  # fmt: skip
        gathered = collectives.all_gather_bytes(torch.cat(owned), sizes)
        results = []
        offsets = [0] * world
        for i, (codec, c) in enumerate(zip(codecs, contributions, strict=True)):
            slices = []
            for r, (start, end) in enumerate(bounds[i]):
                size = _nbytes(codec, c, (start, end))
                slices.append((start, end, gathered[r][offsets[r] : offsets[r] + size]))
                offsets[r] += size
            results.append(Aggregate(partial(_decode, codec, c, slices), local=c))
        return Pending.done(results)


def _block_codec(contribution: Contribution) -> BlockScaledQuantizer:
    codec = contribution.codec
    if not isinstance(codec, BlockScaledQuantizer) or not isinstance(contribution.payload, BlockScaledPayload):
        raise TypeError(f"aggregator 'two_phase' cuts block-aligned payloads (int8, fp8); got {codec!r}")
    return codec


def _nbytes(codec: BlockScaledQuantizer, c: Contribution, bounds: tuple[int, int]) -> int:
    return codec.payload_nbytes(torch.Size([bounds[1] - bounds[0]]), c.payload.dtype)


def _decode(
    codec: BlockScaledQuantizer, c: Contribution, slices: list[tuple[int, int, Tensor]], out: Tensor | None
) -> Tensor:
    """Every owner's quantized mean slice, decoded into the contribution's flat target."""
    target = c.decode_target(out)
    for start, end, raw in slices:
        piece = codec.unpack(raw, torch.Size([end - start]), c.payload.dtype)
        target[start:end] = codec.decoded(piece).to(target.dtype)
    return target
