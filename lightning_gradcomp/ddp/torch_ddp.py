"""``make_hook``: the compression hook for a hand-made ``DistributedDataParallel``, without Lightning's loops.

::

    ddp = DistributedDataParallel(model)
    hook = make_hook(ddp, "ddp_topk")                    # or make_hook(ddp, compressor="topk", density=0.01, ...)
    ddp.register_comm_hook(hook, gradcomp_comm_hook)
    ...
    torch.save({"model": ddp.module.state_dict(), "hook": hook.state_dict()}, f"rank{rank}.pt")  # every rank
    hook.load_state_dict(torch.load(f"rank{rank}.pt", weights_only=True)["hook"])                 # on resume
    del ddp
    destroy_process_group()                              # at the end: the group goes after the wrappers

The arguments and their checks are the strategies' (:class:`~lightning_gradcomp.ddp.settings.CompressionSettings`);
``hook.state_dict()`` holds everything that makes a resumed run the run that never stopped (the step
counter, the compressor's warm starts, the error-feedback residuals or DIANA shifts). It differs on
every rank: each rank saves and loads its own.
"""

from __future__ import annotations

import gc
from datetime import timedelta
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from lightning_gradcomp.ddp.arguments import SETTINGS, refuse_density_schedule
from lightning_gradcomp.ddp.hook import GradCompHook
from lightning_gradcomp.ddp.presets import preset_arguments
from lightning_gradcomp.ddp.settings import CompressionSettings


def make_hook(
    model: torch.nn.Module,
    preset: str | None = None,
    *,
    group: torch.distributed.ProcessGroup | None = None,
    node_id: object = None,
    timeout: timedelta | None = None,
    **settings: Any,
) -> GradCompHook:
    """The hook (the ``state`` for ``ddp.register_comm_hook(state, gradcomp_comm_hook)``) for ``model``'s parameters.

    Args:
        model: the ``DistributedDataParallel`` (its module and process group are used) or the module it wraps.
        preset: a named strategy (``"ddp_topk"``, ...; see :data:`~lightning_gradcomp.NAMED_STRATEGIES`) whose
            arguments are the defaults of ``settings`` (a ``*_kwargs`` dict updates the preset's key by key:
            :func:`~lightning_gradcomp.ddp.presets.preset_arguments`).
        group: the process group of the exchange when ``model`` is not a ``DistributedDataParallel`` (default:
            the world).
        node_id: this rank's node under ``hierarchy="node"`` (default: torchrun's ``GROUP_RANK``, else the host).
        timeout: bound on the node groups' collectives under ``hierarchy="node"``.
        **settings: the arguments of :class:`~lightning_gradcomp.GradCompStrategy` (``compressor``, ``memory``,
            ``density``, ...), except ``density_schedule`` and ``on_world_size_change``.

    Every rank must call it: it checks, in one gather, that all ranks were given the same settings.
    """
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"model must be a torch.nn.Module or a DistributedDataParallel, got {type(model).__name__}")
    refuse_density_schedule(settings.pop("density_schedule", None), "a plain torch loop")
    if "on_world_size_change" in settings:
        raise ValueError(
            "on_world_size_change decides what the strategies do with a checkpoint of another world size; with "
            "make_hook each rank loads its own hook.state_dict(), so the script decides"
        )
    unknown = sorted(set(settings) - set(SETTINGS))
    if unknown:
        raise ValueError(f"make_hook got unknown arguments {unknown}; the settings are {sorted(SETTINGS)}")
    arguments = preset_arguments(preset, settings) if preset is not None else settings
    config = CompressionSettings(**arguments)
    if isinstance(model, DistributedDataParallel):
        if group is not None and group != model.process_group:
            raise ValueError("group differs from the DistributedDataParallel's own process group; pass one of them")
        model, group = model.module, model.process_group
    named = list(model.named_parameters())
    config.check_settings_agree(named, group, model)
    return config.build_hook(model, group, node_id, timeout)


def destroy_process_group() -> None:
    """Destroy the default process group once the script has deleted its ``DistributedDataParallel`` wrappers.

    The order matters with gloo: a wrapper freed after its group drops the group's last reference from C++
    while holding the GIL and joins gloo's threads, one of which may need the GIL to release a collective's
    tensors (a hang, or an abort at exit; pytorch/pytorch#56297). Collected here first, the wrappers go while
    the group lives, and the group's last reference is dropped from Python, which releases the GIL.
    """
    gc.collect()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
