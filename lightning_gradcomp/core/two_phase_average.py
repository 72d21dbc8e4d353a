"""A flat tensor averaged over the ranks in two phases, compressed in both, with error feedback in both.

1-bit Adam's compressed allreduce (Tang et al., 2021, arXiv 2102.02888, Algorithm 1 and Sec. 4.1) for any of the
library's compressors. The flat tensor (every parameter's momentum, end to end) is cut into ``P`` consecutive chunks,
chunk ``j`` owned by rank ``j``, and each chunk into *pieces*, the parts of the parameters it holds, each compressed on
its own (a scale per parameter, as the paper's per-tensor scale; a parameter cut by a chunk boundary gets one per part):

1. **worker**: ``y = x + e_w``; every piece of ``y`` compressed; ``e_w = y - sent``; chunk ``j``'s pieces to rank
   ``j`` (one all-to-all);
2. **server** (rank ``j``): the mean of the ``P`` decoded copies of its chunk, ``z = mean + e_s``; every piece of
   ``z`` compressed again; ``e_s = z - sent``;
3. every rank gathers every owner's pieces (one all-gather) and decodes them: the average, the same on every rank.

A rank sends ``(P - 1) / P`` of one compressed tensor and one chunk, and receives as much: about twice a compressed
tensor whatever ``P``. ``e_w`` holds a whole tensor, ``e_s`` a chunk: both are this rank's own state, for its
checkpoint shard. Random compressors draw from the unit streams of (seed, rank, step, piece), the server's apart from
the worker's.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_gradcomp.core.comm import Collectives
from lightning_gradcomp.core.compressors import Compressor
from lightning_gradcomp.core.randomness import UnitStreams
from lightning_gradcomp.core.stats import StepStats
from lightning_gradcomp.core.validation import check_int

__all__ = ["TwoPhaseAverage", "check_two_phase_compressor"]

#: The key offset of the server's random streams (the worker's pieces are keyed 0, 1, ...).
SERVER_KEYS = 1 << 40


def check_two_phase_compressor(compressor: Compressor) -> None:
    """``ValueError`` unless ``compressor`` compresses a flat piece on its own into a payload of a size its shape fixes
    (what the all-to-all needs): no tensor shapes, warm starts or shared scales (PowerSGD, ATOMO, TernGrad's shared
    scale), no sizes that depend on the data (Gaussian_k's)."""
    if compressor.needs_layer_shape or compressor.takes_shapes or compressor.warm_started or compressor.shares_scale:
        raise ValueError(
            f"compressor {compressor!r} needs a tensor's own shape, a warm start or a scale shared over the ranks; "
            "the two-phase average compresses flat pieces of a tensor: use sign, topk, qsgd, int8 or fp8"
        )
    if compressor.payload_nbytes(torch.Size([1024]), torch.float32) is None or not compressor.gatherable:
        raise ValueError(
            f"compressor {compressor!r} sends payloads whose size depends on the data; the two-phase average sends "
            "fixed-size pieces: use sign, topk, qsgd, int8 or fp8"
        )


@dataclass(frozen=True)
class _Piece:
    """Elements ``[start, end)`` of the flat tensor: part of one parameter inside one chunk."""

    start: int
    end: int
    key: int

    @property
    def shape(self) -> torch.Size:
        return torch.Size([self.end - self.start])


class TwoPhaseAverage:
    """Averages a flat tensor of ``sum(sizes)`` elements (parameters of ``sizes``, end to end) over the ranks of
    ``collectives`` through ``compressor`` in two phases, with this rank's error feedback on both (see the module's
    docstring).

    Args:
        compressor: compresses every piece (:func:`check_two_phase_compressor`).
        sizes: the sizes of the parameters laid end to end (a piece never spans two).
        collectives: the ranks' counted collectives.
        dtype, device: the tensor's.
        seed: base seed of the random streams.
    """

    def __init__(
        self,
        compressor: Compressor,
        sizes: Sequence[int],
        collectives: Collectives,
        dtype: torch.dtype,
        device: torch.device,
        seed: int = 0,
    ) -> None:
        check_two_phase_compressor(compressor)
        check_int("seed", seed, 0)
        self.compressor, self.collectives, self.dtype = compressor, collectives, dtype
        world, rank = collectives.world_size, collectives.rank
        self.numel = sum(sizes)
        share, extra = divmod(self.numel, world)
        edges = [i * share + min(i, extra) for i in range(world + 1)]
        self.chunks = list(itertools.pairwise(edges))
        bounds = [0]
        for size in sizes:
            bounds.append(bounds[-1] + size)
        self.pieces: list[list[_Piece]] = []
        key = 0
        for start, end in self.chunks:
            cuts = sorted({start, end, *(b for b in bounds if start < b < end)})
            pieces = [_Piece(lo, hi, key + i) for i, (lo, hi) in enumerate(itertools.pairwise(cuts))]
            key += len(pieces)
            self.pieces.append([p for p in pieces if p.end > p.start])
        self._sizes = [sum(compressor.payload_nbytes(p.shape, dtype) for p in pieces) for pieces in self.pieces]
        own_start, own_end = self.chunks[rank]
        #: this rank's worker residual (the whole tensor) and server residual (its own chunk)
        self.worker_error = torch.zeros(self.numel, dtype=dtype, device=device)
        self.server_error = torch.zeros(own_end - own_start, dtype=dtype, device=device)
        self.streams = UnitStreams(seed, rank)

    @property
    def chunk_payload_bytes(self) -> list[int]:
        """The bytes of each chunk's compressed pieces (what one rank sends each owner, and each owner gathers)."""
        return list(self._sizes)

    def _compress(self, piece: Tensor, key: int, step: int) -> tuple[Tensor, Tensor]:
        """The piece's payload bytes and what they decode to."""
        payload = self.compressor.compress(piece, self.streams.generator(piece.device, step, key))
        return payload.to_bytes(), self.compressor.decompress(payload)

    def _decode(self, raw: Tensor, piece: _Piece) -> Tensor:
        return self.compressor.decompress(self.compressor.unpack(raw, piece.shape, self.dtype))

    @torch.no_grad()
    def average_(self, x: Tensor, step: int, stats: StepStats | None = None) -> Tensor:
        """Overwrite the flat ``x`` with the two-phase compressed average over the ranks (every rank the same), moving
        both residuals on; ``step`` keys the random streams; ``stats`` counts the bytes and times."""
        stats = stats if stats is not None else StepStats(step=step)
        rank, world = self.collectives.rank, self.collectives.world_size
        started = time.perf_counter()
        before = self.collectives.counter.copy()
        y = self.worker_error.add_(x)  # y = x + e_w, kept where e_w lives: e_w = y - sent below
        outgoing = []
        for pieces in self.pieces:
            parts = []
            for piece in pieces:
                raw, sent = self._compress(y[piece.start : piece.end], piece.key, step)
                y[piece.start : piece.end].sub_(sent)
                parts.append(raw)
            outgoing.append(torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8, device=x.device))
        stats.seconds_compress += time.perf_counter() - started
        started = time.perf_counter()
        received = self.collectives.all_to_all_bytes(outgoing, [self._sizes[rank]] * world)
        own_start, _ = self.chunks[rank]
        server_parts = []
        offset = 0
        for piece in self.pieces[rank]:
            size = self.compressor.payload_nbytes(piece.shape, self.dtype)
            mean = sum(self._decode(source[offset : offset + size], piece).float() for source in received) / world
            z = self.server_error[piece.start - own_start : piece.end - own_start].add_(mean.to(self.dtype))
            raw, sent = self._compress(z, SERVER_KEYS + piece.key, step)
            z.sub_(sent)
            server_parts.append(raw)
            offset += size
        mine = torch.cat(server_parts) if server_parts else torch.empty(0, dtype=torch.uint8, device=x.device)
        gathered = self.collectives.all_gather_bytes(mine, self._sizes)
        for r, pieces in enumerate(self.pieces):
            offset = 0
            for piece in pieces:
                size = self.compressor.payload_nbytes(piece.shape, self.dtype)
                x[piece.start : piece.end] = self._decode(gathered[r][offset : offset + size], piece)
                offset += size
        stats.seconds_communicate += time.perf_counter() - started
        stats.take_counts(self.collectives.counter.since(before))
        stats.numel += self.numel
        stats.numel_compressed += self.numel
        stats.payload_bytes += sum(self._sizes) + self._sizes[rank]  # the worker's pieces, then the server's
        return x

    def state_dict(self) -> dict[str, Tensor]:
        """This rank's residuals (its own; on the CPU)."""
        return {
            "worker_error": self.worker_error.detach().cpu().clone(),
            "server_error": self.server_error.cpu().clone(),
        }

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        """Restore :meth:`state_dict`'s output; residuals of another size are refused by name."""
        for name in ("worker_error", "server_error"):
            mine = getattr(self, name)
            saved = state[name]
            if saved.shape != mine.shape:
                raise ValueError(
                    f"the saved {name} holds {tuple(saved.shape)} elements, this run's {tuple(mine.shape)}: another "
                    "model or another number of ranks"
                )
            mine.copy_(saved)
