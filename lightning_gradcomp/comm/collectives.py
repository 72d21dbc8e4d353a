"""The collectives the aggregators use, each counted in a :class:`CommCounter`.

Calls are synchronous: inside a DDP comm hook on gloo every collective completes before it
returns anyway, and a synchronous chain keeps multi-collective aggregations simple to follow.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_gradcomp.comm.counter import CommCounter

# torch 2.13 renamed all_gather_into_tensor (now deprecated) to all_gather_single.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class Collectives:
    """Counted collectives over one process group."""

    def __init__(self, group: dist.ProcessGroup | None = None, counter: CommCounter | None = None) -> None:
        self.group = group if group is not None else dist.group.WORLD
        self.counter = counter if counter is not None else CommCounter()
        self.world_size = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)

    def all_reduce_(self, tensor: Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> Tensor:
        """Reduce ``tensor`` in place across ranks and return it."""
        start = time.perf_counter()
        dist.all_reduce(tensor, op=op, group=self.group)
        nbytes = tensor.numel() * tensor.element_size()
        self.counter.record(nbytes, nbytes, time.perf_counter() - start)
        return tensor

    def all_reduce_async(self, tensor: Tensor) -> torch.futures.Future[Tensor]:
        """Sum ``tensor`` in place across ranks without waiting: a future of the reduced tensor.

        The bytes are counted at launch; the time overlaps the backward pass (as DDP's own
        allreduce does) and is not attributed.
        """
        nbytes = tensor.numel() * tensor.element_size()
        work = dist.all_reduce(tensor, group=self.group, async_op=True)
        self.counter.record(nbytes, nbytes, 0.0)
        return work.get_future().then(lambda done: done.value()[0])

    def all_gather(self, tensor: Tensor) -> Tensor:
        """Gather equal-size 1-D tensors: row ``r`` of the result is rank ``r``'s tensor.

        Never call it with an empty tensor (gloo hangs): :meth:`all_gather_bytes` pads for that.
        """
        out = torch.empty(self.world_size * tensor.numel(), dtype=tensor.dtype, device=tensor.device)
        start = time.perf_counter()
        _all_gather_single(out, tensor.contiguous(), group=self.group)
        self.counter.record(
            tensor.numel() * tensor.element_size(), out.numel() * out.element_size(), time.perf_counter() - start
        )
        return out.view(self.world_size, tensor.numel())

    def all_gather_bytes(self, buffer: Tensor, sizes: list[int] | None = None) -> list[Tensor]:
        """Gather a uint8 buffer of any length (zero included) from every rank.

        ``sizes``, when every rank already knows every rank's length, saves the size exchange;
        otherwise the lengths are gathered first. Buffers are padded to the longest (and to at
        least one byte, since gloo hangs on empty tensors) and trimmed on return.
        """
        if buffer.dtype != torch.uint8 or buffer.dim() != 1:
            raise ValueError(f"buffer must be a 1-D uint8 tensor, got {buffer.dtype} with shape {tuple(buffer.shape)}")
        if sizes is None:
            local = torch.tensor([buffer.numel()], dtype=torch.int64, device=buffer.device)
            sizes = self.all_gather(local).reshape(-1).tolist()
        elif len(sizes) != self.world_size or sizes[self.rank] != buffer.numel():
            raise ValueError(f"sizes {sizes} do not match world size {self.world_size} and this rank's buffer")
        longest = max(1, max(sizes))
        if buffer.numel() < longest:
            padded = torch.zeros(longest, dtype=torch.uint8, device=buffer.device)
            padded[: buffer.numel()] = buffer
            buffer = padded
        rows = self.all_gather(buffer)
        return [rows[r, : sizes[r]] for r in range(self.world_size)]
