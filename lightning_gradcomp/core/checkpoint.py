"""Per-rank compression state beside a checkpoint: one shard per rank, written by that rank.

Error-feedback residuals and DIANA shifts differ on every rank and are each as large as the
model. Gathering them to rank 0 would cost rank 0 ``P`` model sizes at every save; instead each
rank writes its own shard next to the checkpoint file, as DeepSpeed writes per-rank optimizer
shards, and the checkpoint itself carries only a small manifest::

    epoch=0-step=100.ckpt                      # the checkpoint (manifest under "gradcomp")
    epoch=0-step=100.ckpt.gradcomp/
        rank00000-of-00004.pt                  # rank 0's memory and hook state
        ...

To move or copy a checkpoint, copy the ``.gradcomp`` folder beside it. A shard records the world
size, its rank, the memory and compressor that made it and the tag of the save it belongs to;
on resume each rank reads its own shard (``weights_only=True``: a shard never executes code) and
checks it against the manifest, so a missing, corrupted or foreign shard is an error naming the
file. Shards are written to a temporary name and renamed, so a crash mid-save never leaves a
half-written shard under the real name. Paths may be local or any ``fsspec`` URL.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from fsspec.implementations.local import LocalFileSystem
from lightning.fabric.utilities.cloud_io import get_filesystem

#: The manifest's key in the checkpoint.
CHECKPOINT_KEY = "gradcomp"
#: Manifest format: 1 held every rank's state inline (gathered to rank 0); 2 points to shards.
FORMAT = 2

T = TypeVar("T")


class ShardError(ValueError):
    """A compression-state shard is missing, unreadable, or belongs to another checkpoint."""


def shard_dir(checkpoint_path: str | os.PathLike) -> str:
    """The folder holding the shards of ``checkpoint_path``."""
    return f"{os.fspath(checkpoint_path)}.gradcomp"


def shard_path(checkpoint_path: str | os.PathLike, rank: int, world_size: int) -> str:
    """Where ``rank`` of ``world_size`` writes its shard of ``checkpoint_path``."""
    return f"{shard_dir(checkpoint_path)}/rank{rank:05d}-of-{world_size:05d}.pt"


def manifest(world_size: int, tag: str, memory: str, compressor: str) -> dict[str, Any]:
    """What the checkpoint itself records about its shards."""
    return {"format": FORMAT, "world_size": world_size, "tag": tag, "memory": memory, "compressor": compressor}


def write_shard(checkpoint_path: str | os.PathLike, rank: int, world_size: int, shard: dict[str, Any]) -> str:
    """Write this rank's ``shard`` beside ``checkpoint_path`` (atomically: temporary name, then rename)."""
    path = shard_path(checkpoint_path, rank, world_size)
    fs = get_filesystem(path)
    fs.makedirs(shard_dir(checkpoint_path), exist_ok=True)
    temporary = f"{path}.tmp"
    content = {**shard, "rank": rank, "world_size": world_size}
    if isinstance(fs, LocalFileSystem):
        torch.save(content, temporary)  # written from where the tensors lie: no serialized copy in memory
    else:
        with fs.open(temporary, "wb") as f:
            torch.save(content, f)
    fs.mv(temporary, path)
    return path


def read_shard(checkpoint_path: str | os.PathLike, rank: int, expected: dict[str, Any]) -> dict[str, Any]:
    """This rank's shard of ``checkpoint_path``, checked against the checkpoint's manifest ``expected``.

    Raises :class:`ShardError` naming the file when it is missing, unreadable, or was written by
    another save (another tag, world size or rank).
    """
    fs = get_filesystem(os.fspath(checkpoint_path))
    if not fs.exists(shard_dir(checkpoint_path)) and os.path.islink(checkpoint_path):
        checkpoint_path = os.path.realpath(checkpoint_path)  # e.g. ModelCheckpoint(save_last="link")'s last.ckpt
    path = shard_path(checkpoint_path, rank, expected["world_size"])
    if not fs.exists(path):
        raise ShardError(
            f"the compression state of rank {rank} is missing: {path} does not exist (copy the "
            f"{shard_dir(checkpoint_path)} folder together with the checkpoint)"
        )
    try:
        with fs.open(path, "rb") as f:
            shard = torch.load(f, map_location="cpu", weights_only=True)
    except Exception as err:
        raise ShardError(f"the compression-state shard {path} cannot be read: {type(err).__name__}: {err}") from None
    if not isinstance(shard, dict):
        raise ShardError(f"the compression-state shard {path} holds a {type(shard).__name__}, not a shard")
    found = {key: shard.get(key) for key in ("tag", "world_size", "rank")}
    wanted = {"tag": expected["tag"], "world_size": expected["world_size"], "rank": rank}
    if found != wanted:
        raise ShardError(
            f"the compression-state shard {path} belongs to another checkpoint: it records {found}, "
            f"the checkpoint expects {wanted}"
        )
    return shard


def remove_shards(checkpoint_path: str | os.PathLike, rank: int, world_size: int) -> None:
    """Delete the shards of ``checkpoint_path``: rank 0 the whole folder, every other rank its own shard.

    (Each rank removing its own covers shard folders on storage that rank 0 cannot reach.)
    """
    folder = shard_dir(checkpoint_path)
    fs = get_filesystem(folder)
    target, recursive = (folder, True) if rank == 0 else (shard_path(checkpoint_path, rank, world_size), False)
    for _ in range(3):  # another rank may remove its own shard while rank 0 walks the folder: walk again
        try:
            if fs.exists(target):
                fs.rm(target, recursive=recursive)
            return
        except FileNotFoundError:
            continue


class ShardTags:
    """The tags that mark one run's shards: a run tag every rank takes from rank 0, and a count of saves (a shard
    written by another save or run is told apart by its tag)."""

    def __init__(self) -> None:
        #: this run's tag (each rank draws its own; :meth:`share` gives every rank rank 0's)
        self.run = uuid.uuid4().hex
        self.saves = 0

    def share(self) -> None:
        """Take rank 0's run tag (one small broadcast; nothing when not distributed)."""
        if _distributed():
            shared: list[Any] = [self.run]
            torch.distributed.broadcast_object_list(shared, src=0)
            self.run = shared[0]

    def next(self) -> str:
        """The tag of the next save."""
        self.saves += 1
        return f"{self.run}-{self.saves}"


def _distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def on_every_rank(restore: Callable[[], T]) -> T:
    """``restore()`` (this rank's part of a restore: its shard read, checked and applied); a refusal (a
    ``ValueError``, a :class:`ShardError` among them) on any rank is raised on every rank, each distinct reason once
    with the ranks that gave it, so that no rank goes on to a collective the others never reach (one object gather).
    It is a :class:`ShardError` when every failing rank's was one (those name the rank's file themselves)."""
    result, error = None, None
    try:
        result = restore()
    except ValueError as err:
        error = (isinstance(err, ShardError), str(err))
    errors = [error]
    if _distributed() and torch.distributed.get_world_size() > 1:
        errors = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(errors, error)
    failed = [(rank, e) for rank, e in enumerate(errors) if e is not None]
    if not failed:
        return result  # type: ignore[return-value]
    ranks_by_reason: dict[tuple[bool, str], list[int]] = {}
    for rank, reason in failed:
        ranks_by_reason.setdefault(reason, []).append(rank)
    parts = [
        text if shard or len(errors) == 1 else f"{text} (on {_ranks(ranks, len(errors))})"
        for (shard, text), ranks in ranks_by_reason.items()
    ]
    message = "; ".join(parts)
    raise ShardError(message) if all(shard for shard, _ in ranks_by_reason) else ValueError(message)


def _ranks(ranks: list[int], world_size: int) -> str:
    if len(ranks) == world_size:
        return "every rank"
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


def refuse_other_run(
    path: Any, what: str, saved: dict[str, Any], world_size: int, memory: str, compressor: str, **layout: Any
) -> None:
    """``ValueError`` naming what differs between the checkpoint's manifest ``saved`` and this run: the world size,
    each ``layout`` entry (``key=(label, value)``, e.g. ``mesh=("a (replicate, shard) mesh", (2, 2))``), the memory
    or the compressor (per-rank state would not mean what this run's does); ``what`` names the state."""
    if saved["world_size"] != world_size:
        raise ValueError(
            f"the checkpoint {path} holds the {what} of {saved['world_size']} ranks, but this run has {world_size}"
        )
    for key, (label, mine) in layout.items():
        theirs = tuple(saved[key]) if isinstance(saved[key], list) else saved[key]
        if theirs != mine:
            raise ValueError(f"the checkpoint {path} holds the {what} of {label} {theirs}, but this run's is {mine}")
    if (saved["memory"], saved["compressor"]) != (memory, compressor):
        raise ValueError(
            f"the checkpoint {path} holds the {what} of memory {saved['memory']!r} and compressor "
            f"{saved['compressor']!r}, but this run has memory {memory!r} and compressor {compressor!r}"
        )
