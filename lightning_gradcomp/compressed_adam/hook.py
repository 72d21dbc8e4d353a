"""The DDP communication hook of compressed Adam: dense steps averaged in one flat allreduce, compressed steps local.

On a dense step (the warm-up, a refresh of the variance) every gradient is copied into one flat buffer in the
parameters' order as its bucket arrives, and once the last bucket is in, the buffer is summed over the ranks in one
allreduce, divided by their number (as DDP's reducer does) and written back into the buckets, whose futures complete
then. The sum is a function of the parameters' order alone, not of DDP's bucket layout (which changes after the first
step and after a restart), so a run resumed on 3 or more ranks adds in the same order as the run that never stopped.
On a compressed step the hook returns each bucket as it is: each rank keeps its own gradient, and the optimizer step
exchanges the compressed momentum instead (:class:`~lightning_gradcomp.compressed_adam.CompressedAdam`). (No
``from __future__ import annotations`` here: DDP checks the hook's annotations.)
"""

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_gradcomp.core.comm import Collectives

__all__ = ["GradientRouting", "compressed_adam_comm_hook"]


class GradientRouting:
    """The hook's state: which steps are dense (``dense()``, asked before each backward pass's first bucket), the
    parameters' order and the flat buffer of a dense step (allocated once)."""

    def __init__(self, parameters: Sequence[nn.Parameter], collectives: Collectives, dense: Callable[[], bool]) -> None:
        self.collectives, self.dense = collectives, dense
        self._offsets: dict[int, tuple[int, int]] = {}
        offset = 0
        for p in parameters:
            self._offsets[id(p)] = (offset, p.numel())
            offset += p.numel()
        self.numel = offset
        self._flat: Tensor | None = None
        self._arrived = 0
        self._waiting: list[tuple[dist.GradBucket, torch.futures.Future[Tensor]]] = []

    def route(self, bucket: dist.GradBucket) -> torch.futures.Future[Tensor]:
        """One bucket: held until every gradient of a dense step is in, or handed back as it is."""
        future: torch.futures.Future[Tensor] = torch.futures.Future()
        if not self._waiting and not self._arrived and not self.dense():
            future.set_result(bucket.buffer())
            return future
        if self._flat is None:
            self._flat = torch.empty(self.numel, dtype=bucket.buffer().dtype, device=bucket.buffer().device)
        for p, grad in zip(bucket.parameters(), bucket.gradients(), strict=True):
            start, numel = self._offsets[id(p)]
            self._flat[start : start + numel].copy_(grad.reshape(-1))
            self._arrived += numel
        self._waiting.append((bucket, future))
        if self._arrived == self.numel:
            self._average()
        return future

    def _average(self) -> None:
        assert self._flat is not None
        self.collectives.all_reduce_(self._flat).div_(self.collectives.world_size)
        waiting, self._waiting, self._arrived = self._waiting, [], 0
        for bucket, future in waiting:
            for p, grad in zip(bucket.parameters(), bucket.gradients(), strict=True):
                start, numel = self._offsets[id(p)]
                grad.copy_(self._flat[start : start + numel].view_as(grad))
            future.set_result(bucket.buffer())


def compressed_adam_comm_hook(state: GradientRouting, bucket: dist.GradBucket) -> torch.futures.Future[Tensor]:
    """``DistributedDataParallel.register_comm_hook(routing, compressed_adam_comm_hook)``."""
    return state.route(bucket)
