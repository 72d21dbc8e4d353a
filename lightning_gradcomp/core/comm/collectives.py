"""The collectives the aggregators use, each counted in a :class:`CommCounter`.

Every collective can be launched without waiting (``*_start``, an :class:`InFlight`), which is how
the hook lets a compressed bucket's exchange run while the backward pass goes on; the plain calls
launch and wait at once. Bytes are counted at launch, time while this rank is blocked waiting.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from functools import partial
from itertools import pairwise
from typing import Generic, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_gradcomp.core.comm.counter import CommCounter

# torch 2.13 renamed all_gather_into_tensor (now deprecated) to all_gather_single.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

#: A row of at least this many bytes is gathered on gloo by a broadcast per rank (:meth:`Collectives._broadcast_rows`);
#: below it, gloo's allgather's temporaries are small and one collective has less latency than ``P`` (two ranks on
#: loopback: 16 KiB rows took 0.53 ms by broadcasts against 0.35, 64 KiB 0.47 against 0.55; ``benchmarks/gather.py``).
BROADCAST_GATHER_BYTES = 64 * 1024

T = TypeVar("T")
U = TypeVar("U")


class _Together:
    """Several launched works waited for as one (a gather made of a broadcast per rank)."""

    def __init__(self, works: list[dist.Work]) -> None:
        self._works = works

    def wait(self) -> None:
        for work in self._works:
            work.wait()


class InFlight(Generic[T]):
    """A launched collective: :meth:`wait` blocks until it has completed and returns its result.

    The time spent blocked is added to the counter's seconds (the bytes were counted at launch).
    ``then`` turns the raw output into the result (trimming padding, for instance).
    """

    def __init__(
        self, work: dist.Work | _Together, output: Tensor, counter: CommCounter, then: Callable[[Tensor], T]
    ) -> None:
        self._work: dist.Work | _Together | None = work
        self._output = output
        self._counter = counter
        self._then = then

    def wait(self) -> T:
        if self._work is not None:
            start = time.perf_counter()
            self._work.wait()
            self._counter.seconds += time.perf_counter() - start
            self._work = None
        return self._then(self._output)

    def then(self, fn: Callable[[T], U]) -> InFlight[U]:
        """The same collective, its result passed through ``fn`` (use it instead of this one)."""
        first = self._then
        return InFlight(self._work, self._output, self._counter, lambda output: fn(first(output)))


class Collectives:
    """Counted collectives over one process group."""

    def __init__(self, group: dist.ProcessGroup | None = None, counter: CommCounter | None = None) -> None:
        self.group = group if group is not None else dist.group.WORLD
        self.counter = counter if counter is not None else CommCounter()
        self.world_size = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        self._ranks = dist.get_process_group_ranks(self.group)  # the global ranks broadcasts name as sources
        self._gloo = "gloo" in str(dist.get_backend(self.group))

    def all_reduce_(self, tensor: Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> Tensor:
        """Reduce ``tensor`` in place across ranks and return it."""
        return self.all_reduce_start(tensor, op).wait()

    def all_reduce_start(self, tensor: Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> InFlight[Tensor]:
        """Launch the in-place reduction of ``tensor``; ``wait()`` returns the reduced tensor."""
        work = dist.all_reduce(tensor, op=op, group=self.group, async_op=True)
        nbytes = tensor.numel() * tensor.element_size()
        self.counter.record(nbytes, nbytes, 0.0, dtype_name(tensor))
        return InFlight(work, tensor, self.counter, _same)

    def all_reduce_async(self, tensor: Tensor) -> torch.futures.Future[Tensor]:
        """Sum ``tensor`` in place across ranks without waiting: a future of the reduced tensor.

        The bytes are counted at launch; the time overlaps the backward pass (as DDP's own
        allreduce does) and is not attributed.
        """
        nbytes = tensor.numel() * tensor.element_size()
        work = dist.all_reduce(tensor, group=self.group, async_op=True)
        self.counter.record(nbytes, nbytes, 0.0, dtype_name(tensor))
        return work.get_future().then(lambda done: done.value()[0])

    def all_gather(self, tensor: Tensor) -> Tensor:
        """Gather equal-size 1-D tensors: row ``r`` of the result is rank ``r``'s tensor.

        Never call it with an empty tensor (gloo hangs): :meth:`all_gather_bytes` pads for that.
        """
        return self.all_gather_start(tensor).wait()

    def all_gather_start(self, tensor: Tensor, rows: Tensor | None = None) -> InFlight[Tensor]:
        """Launch :meth:`all_gather`; ``wait()`` returns the ``(world_size, numel)`` rows.

        ``rows``, when given, is the flat output, and ``tensor`` may be this rank's row of it (gathered in place).
        """
        numel = tensor.numel()
        out = torch.empty(self.world_size * numel, dtype=tensor.dtype, device=tensor.device) if rows is None else rows
        nbytes = numel * tensor.element_size()
        if self._gathers_by_broadcast(nbytes, tensor.device):
            gathered = out.view(self.world_size, numel)
            if gathered[self.rank].data_ptr() != tensor.data_ptr():
                gathered[self.rank].copy_(tensor)
            work: dist.Work | _Together = self._broadcast_rows(list(gathered))
        else:
            work = _all_gather_single(out, tensor.contiguous(), group=self.group, async_op=True)
        self.counter.record(nbytes, out.numel() * out.element_size(), 0.0, dtype_name(tensor))
        return InFlight(work, out, self.counter, lambda gathered: gathered.view(self.world_size, numel))

    def _gathers_by_broadcast(self, row_bytes: int, device: torch.device) -> bool:
        """Whether a gather of rows of ``row_bytes`` goes by :meth:`_broadcast_rows`: on gloo, for CPU rows of at
        least :data:`BROADCAST_GATHER_BYTES`."""
        return self._gloo and device.type == "cpu" and row_bytes >= BROADCAST_GATHER_BYTES

    def _broadcast_rows(self, rows: list[Tensor]) -> _Together:
        """Gather by one broadcast from each rank ``r`` into ``rows[r]``, in place (this rank's row holds what it
        sends): gloo's allgather instead writes a flat temporary of the whole output and copies it out (two to three
        times the output allocated per call, and slower on the CPU from rows of 64 KiB: ``benchmarks/gather.py``)."""
        sources = zip(rows, self._ranks, strict=True)
        return _Together([dist.broadcast(row, src=src, group=self.group, async_op=True) for row, src in sources])

    def all_gather_bytes(
        self,
        buffer: Tensor | Sequence[Tensor],
        sizes: list[int] | None = None,
        rows: Callable[[int], Tensor] | None = None,
    ) -> list[Tensor]:
        """Gather a uint8 buffer of any length (zero included) from every rank.

        ``buffer`` may be given in parts (1-D uint8), which are written end to end straight into this rank's row
        of the output (no joined copy of them). ``sizes``, when every rank already knows every rank's length,
        saves the size exchange; otherwise the lengths are gathered first. Buffers are padded to the longest
        (and to at least one byte, since gloo hangs on empty tensors) and trimmed on return. ``rows``: see
        :meth:`all_gather_bytes_start`.
        """
        return self.all_gather_bytes_start(buffer, sizes, rows).wait()

    def all_gather_bytes_start(
        self,
        buffer: Tensor | Sequence[Tensor],
        sizes: list[int] | None = None,
        rows: Callable[[int], Tensor] | None = None,
    ) -> InFlight[list[Tensor]]:
        """Launch :meth:`all_gather_bytes` (a size exchange, when needed, is waited for first).

        ``rows(numel)``, when given, returns the flat uint8 tensor the bytes are gathered into (a kept buffer: no
        allocation per call); the rows returned are views of it, except, where gloo gathers one part that needs no
        padding by broadcasts, this rank's row: the part itself (``rows`` then holds only the other ranks').
        """
        parts = [buffer] if isinstance(buffer, Tensor) else list(buffer)
        if not parts:
            raise ValueError("buffer must be a tensor or a non-empty sequence of tensors, got no parts")
        if any(p.dtype != torch.uint8 or p.dim() != 1 for p in parts):
            shapes = [(p.dtype, tuple(p.shape)) for p in parts]
            raise ValueError(f"buffer must be 1-D uint8 tensors, got (dtype, shape) {shapes}")
        numel = sum(p.numel() for p in parts)
        device = parts[0].device
        if sizes is None:
            local = torch.full((1,), numel, dtype=torch.int64, device=device)
            sizes = self.all_gather(local).reshape(-1).tolist()
        elif len(sizes) != self.world_size or sizes[self.rank] != numel:
            raise ValueError(f"sizes {sizes} do not match world size {self.world_size} and this rank's buffer")
        longest = max(1, max(sizes))
        known = list(sizes)
        trim = partial(_trimmed, known)
        span = (parts[0] if len(parts) == 1 else _one_span(parts)) if numel == longest else None
        if span is not None and self._gathers_by_broadcast(longest, device):
            return self._broadcast_others(span, rows).then(trim)  # sent as it lies, no row kept for it
        total = self.world_size * longest
        out = torch.empty(total, dtype=torch.uint8, device=device) if rows is None else rows(total)
        if span is not None:  # sent as it lies
            return self.all_gather_start(span, out).then(trim)
        own = out[self.rank * longest : (self.rank + 1) * longest]
        torch.cat(parts, out=own[:numel])
        own[numel:].zero_()
        return self.all_gather_start(own, out).then(trim)

    def _broadcast_others(self, own: Tensor, rows: Callable[[int], Tensor] | None) -> InFlight[list[Tensor]]:
        """Gather ``own`` (1-D uint8) by broadcasts, the other ranks' rows received into ``world_size - 1`` rows of
        ``rows(numel)`` (or a fresh tensor): this rank's row is ``own`` itself. ``wait()`` gives every rank's row."""
        numel = own.numel()
        total = (self.world_size - 1) * numel
        others = torch.empty(total, dtype=torch.uint8, device=own.device) if rows is None else rows(total)
        received = list(others.view(self.world_size - 1, numel))
        every = [*received[: self.rank], own, *received[self.rank :]]
        work = self._broadcast_rows(every)
        self.counter.record(numel, self.world_size * numel, 0.0, dtype_name(own))
        return InFlight(work, every, self.counter, _same)

    def all_to_all_bytes(self, outgoing: Sequence[Tensor], incoming: Sequence[int]) -> list[Tensor]:
        """Send ``outgoing[r]`` (1-D uint8) to rank ``r`` and receive ``incoming[r]`` bytes from each rank ``r``, in one
        collective: what each rank's part of a two-phase average sends to the rank owning each chunk. Every rank must
        know the sizes it receives (fixed-size payloads). Returns the bytes from each rank, in rank order."""
        if len(outgoing) != self.world_size or len(incoming) != self.world_size:
            raise ValueError(f"all_to_all_bytes needs one part per rank ({self.world_size}), got {len(outgoing)} "
                             f"to send and {len(incoming)} sizes to receive")  # fmt: skip
        # gloo needs a byte to move: an empty part travels as one byte of padding, never read back
        parts = [part.reshape(-1) if part.numel() else part.new_zeros(1) for part in outgoing]
        send_sizes, receive_sizes = [part.numel() for part in parts], [max(1, size) for size in incoming]
        sent = torch.cat(parts)
        received = torch.empty(sum(receive_sizes), dtype=torch.uint8, device=sent.device)
        dist.all_to_all_single(received, sent, receive_sizes, send_sizes, group=self.group)
        self.counter.record(sent.numel(), received.numel(), 0.0, "uint8")
        return [part[:size] for part, size in zip(received.split(receive_sizes), incoming, strict=True)]


def _one_span(parts: Sequence[Tensor]) -> Tensor | None:
    """The 1-D tensor the non-empty ``parts`` make where they lie end to end in one storage (laid out so by
    :meth:`~lightning_gradcomp.core.workspace.Workspace.lay_out`), else ``None``."""
    whole = [p for p in parts if p.numel()]
    if not whole or any(p.stride(0) != 1 for p in whole):
        return None
    storage = whole[0].untyped_storage().data_ptr()
    for before, after in pairwise(whole):
        if after.untyped_storage().data_ptr() != storage or before.data_ptr() + before.numel() != after.data_ptr():
            return None
    return whole[0].as_strided((sum(p.numel() for p in whole),), (1,))


def _trimmed(sizes: list[int], rows: Tensor | Sequence[Tensor]) -> list[Tensor]:
    """Each rank's row cut to its length."""
    return [row[: sizes[r]] for r, row in enumerate(rows)]


def dtype_name(tensor: Tensor) -> str:
    """The element type's name as the counter records it: ``"float16"`` for ``torch.float16``."""
    return str(tensor.dtype).removeprefix("torch.")


def _same(tensor: Tensor) -> Tensor:
    return tensor
