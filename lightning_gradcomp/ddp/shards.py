"""Each rank's DDP compression state beside a checkpoint: its memory, the hook's step counter, warm starts and
schedule, written as the rank's own shard and read back (checked, and agreed on every rank) on resume
(:mod:`lightning_gradcomp.core.checkpoint`)."""

from __future__ import annotations

import copy
from typing import Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_gradcomp.core.checkpoint import FORMAT, ShardError, manifest, on_every_rank, read_shard, write_shard
from lightning_gradcomp.ddp.hook_setup import HookSetup

__all__ = ["CompressionShards"]


class CompressionShards(HookSetup):
    """Writes and reads this rank's compression state (:meth:`save_compression_state`,
    :meth:`load_compression_state`); a state read before the hook exists waits for it."""

    on_world_size_change: str

    def compression_state(self) -> dict[str, Any]:
        """This rank's compression state (memory and step counter), on the CPU."""
        hook_state = dict(self.gradcomp_hook.state_dict()) if self.gradcomp_hook is not None else None
        if hook_state is not None:
            hook_state.pop("memory")  # saved under its own key, as shards of format 2 always had it
        return {
            "memory": self.memory.name,
            "compressor": self.compressor.name,
            "memory_state": {k: v.detach().cpu() for k, v in self.memory.state_dict().items()},
            "hook": hook_state if hook_state is not None else self._pending_hook_state,
        }

    def save_compression_state(self, filepath: Any, rank: int, world_size: int) -> dict[str, Any]:
        """Write this rank's compression state beside ``filepath``; the manifest the checkpoint should hold."""
        tag = self._tags.next()
        write_shard(filepath, rank, world_size, {"tag": tag, **self.compression_state()})
        return manifest(world_size, tag, self.memory.name, self.compressor.name)

    def load_compression_state(
        self, checkpoint_path: Any, saved: dict[str, Any], rank: int, world_size: int, device: torch.device
    ) -> None:
        """Give this rank its own compression state back from the checkpoint whose manifest is ``saved``.

        Every rank reads its own shard; if any rank's shard is missing, unreadable or foreign, every
        rank raises the same :class:`~lightning_gradcomp.core.checkpoint.ShardError` naming the files, and
        if any rank's state is refused (another memory's or schedule's), every rank raises the same
        ``ValueError`` naming the ranks. A checkpoint of another world size raises a ``ValueError`` naming both, or
        (``on_world_size_change="reset"``) leaves the state fresh with a warning.
        """
        if saved["world_size"] != world_size:
            message = (
                f"the checkpoint {checkpoint_path} holds compression state of {saved['world_size']} ranks, "
                f"but this run has {world_size}"
            )
            if self.on_world_size_change == "error":
                raise ValueError(f"{message}; pass on_world_size_change='reset' to start the state afresh")
            rank_zero_warn(f"{message}: compression state (residuals, shifts, step counter) starts afresh")
            return
        on_every_rank(lambda: self._restore_state(self._read_state(checkpoint_path, saved, rank), device))

    def _restore_state(self, state: dict[str, Any], device: torch.device) -> None:
        """Apply this rank's ``state``: a refusal (memory state of another kind, a schedule's of another) is raised
        here, while every rank can still agree on it, also for a hook built later (its state is checked on a copy of
        the schedule it will get)."""
        self.memory.load_state_dict({k: v.to(device) for k, v in state["memory_state"].items()})
        hook_state = state["hook"]
        if hook_state is None:
            return
        if self.gradcomp_hook is not None:
            self.gradcomp_hook.load_state_dict(hook_state)
        else:
            copy.deepcopy(self.schedule).load_state_dict(hook_state.get("schedule", {}))
            self._pending_hook_state = hook_state

    def _read_state(self, checkpoint_path: Any, saved: dict[str, Any], rank: int) -> dict[str, Any]:
        """This rank's state from a checkpoint's ``"gradcomp"`` entry: its shard, or inline (format 1)."""
        version = saved.get("format", 1)
        if version == 1:  # every rank's state gathered into the checkpoint
            state = saved["ranks"][rank]
        elif version == FORMAT:
            state = read_shard(checkpoint_path, rank, saved)
        else:
            raise ShardError(
                f"the checkpoint {checkpoint_path} holds compression state of format {version!r}; this version "
                f"reads formats 1 and {FORMAT}"
            )
        for what, mine in (("memory", self.memory.name), ("compressor", self.compressor.name)):
            theirs = state.get(what, saved.get(what))
            if theirs is not None and theirs != mine:
                raise ShardError(
                    f"the checkpoint {checkpoint_path} holds compression state of {what}={theirs!r}, "
                    f"but this run uses {what}={mine!r}"
                )
        return state
