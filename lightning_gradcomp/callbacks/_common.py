"""What the diagnostics callbacks share: argument checks, the hook lookup, captures, logging.

The callbacks only *read* what :class:`~lightning_gradcomp.ddp.hook.GradCompHook` records
(``StepStats`` in ``hook.history``, one-shot ``captures``); they never change how compression is
done. Everything here runs on every rank unless stated otherwise, so collectives stay aligned.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import lightning.pytorch as pl
import torch
import torch.distributed as dist

from lightning_gradcomp.compressed_adam import CompressedAdam, GradCompAdamStrategy
from lightning_gradcomp.core.stats import StepStats
from lightning_gradcomp.core.units import is_compressed
from lightning_gradcomp.ddp.hook import GradCompHook
from lightning_gradcomp.ddp.strategy import GradCompStrategy
from lightning_gradcomp.diloco import GradCompDiLoCoStrategy, OuterSync
from lightning_gradcomp.hsdp import GradCompHSDPStrategy, ReplicaExchange


def check_layer_list(name: str, layers: Sequence[str] | None) -> tuple[str, ...] | None:
    """``layers`` as a tuple of parameter names (``None`` kept), or ``ValueError`` if it is not a list of names."""
    if layers is None:
        return None
    if isinstance(layers, (str, bytes)) or not all(isinstance(layer, str) for layer in layers) or not layers:
        raise ValueError(f"{name} must be a non-empty list of parameter names (or None), got {layers!r}")
    return tuple(dict.fromkeys(layers))


def require_strategy(trainer: pl.Trainer, owner: str) -> GradCompStrategy:
    """The trainer's :class:`GradCompStrategy`, or ``TypeError`` saying which strategy to use instead."""
    strategy = trainer.strategy
    if not isinstance(strategy, GradCompStrategy):
        raise TypeError(
            f"{owner} reads the statistics of lightning_gradcomp's compression hook and needs "
            f"strategy=GradCompStrategy(...) (or a named one such as 'ddp_topk'); the trainer uses "
            f"{type(strategy).__name__}"
        )
    return strategy


def compressed_parameters(strategy: GradCompStrategy, pl_module: pl.LightningModule) -> dict[str, int]:
    """``name -> numel`` of the parameters the hook compresses (the others are averaged densely).

    The hook's own rule (:func:`~lightning_gradcomp.core.units.is_compressed`); parameters without
    gradients never reach the hook.
    """
    named = list(pl_module.named_parameters())
    hook, sizes = strategy.gradcomp_hook, dict(named)
    if hook is not None and all(name in sizes for unit in hook.units for name in unit.names):
        # the units as planned (again, once the output layer is found from the first forward pass); a hook of an
        # earlier fit's other model is passed by
        return {name: sizes[name].numel() for unit in hook.units if unit.compressed for name in unit.names}
    dense = strategy.dense_parameter_names(named, pl_module)
    return {
        name: p.numel()
        for name, p in named
        if p.requires_grad and is_compressed(name, p, strategy.min_compress_numel, dense)
    }


def resolve_layers(
    owner: str, layers: tuple[str, ...] | None, strategy: GradCompStrategy, pl_module: pl.LightningModule
) -> tuple[str, ...] | None:
    """Check chosen ``layers`` against the model at setup: every name must be a compressed parameter.

    Raises ``ValueError`` listing the model's parameter names for an unknown name, and the
    compressed ones for a parameter the hook averages densely (it is never captured).
    """
    if layers is None:
        return None
    names = [name for name, _ in pl_module.named_parameters()]
    unknown = [layer for layer in layers if layer not in names]
    if unknown:
        raise ValueError(f"{owner}: unknown layers {unknown}; the model's parameters are {names}")
    compressed = compressed_parameters(strategy, pl_module)
    dense = [layer for layer in layers if layer not in compressed]
    if dense:
        raise ValueError(
            f"{owner}: layers {dense} are averaged densely by the strategy (fewer than min_compress_numel="
            f"{strategy.min_compress_numel} elements, in dense_parameters, or not trainable) and are never "
            f"compressed; compressed parameters are {sorted(compressed)}"
        )
    return layers


def require_recording_strategy(trainer: pl.Trainer, owner: str) -> None:
    """``TypeError`` unless the trainer's strategy records :class:`StepStats`: a :class:`GradCompStrategy` (every step's
    exchange), a :class:`~lightning_gradcomp.diloco.GradCompDiLoCoStrategy` (every inner step, bytes at the
    synchronisations) or a :class:`~lightning_gradcomp.hsdp.GradCompHSDPStrategy` (every step's exchange between
    replicas)."""
    if not isinstance(trainer.strategy, (GradCompDiLoCoStrategy, GradCompHSDPStrategy, GradCompAdamStrategy)):
        require_strategy(trainer, owner)


def recorder_of(trainer: pl.Trainer) -> GradCompHook | OuterSync | ReplicaExchange | CompressedAdam:
    """What records the strategy's :class:`StepStats` (``history``, ``last_step``, ``memory``): the hook, DiLoCo's
    outer loop, HSDP's replica exchange or compressed Adam (they exist from ``on_fit_start`` on)."""
    strategy = trainer.strategy
    if isinstance(strategy, GradCompDiLoCoStrategy):
        if strategy.outer_sync is None:
            raise RuntimeError("the GradCompDiLoCoStrategy has no outer loop yet; is the strategy set up?")
        return strategy.outer_sync
    if isinstance(strategy, GradCompHSDPStrategy):
        if strategy.replica_exchange is None:
            raise RuntimeError("the GradCompHSDPStrategy has no replica exchange yet; is the strategy set up?")
        return strategy.replica_exchange
    if isinstance(strategy, GradCompAdamStrategy):
        if strategy.compressed_adam is None:
            raise RuntimeError("the GradCompAdamStrategy has no compressed Adam yet; is the strategy set up?")
        return strategy.compressed_adam
    return hook_of(trainer)


def hook_of(trainer: pl.Trainer) -> GradCompHook:
    """The strategy's hook (it exists once the strategy has wrapped the model, from ``on_fit_start`` on)."""
    hook = getattr(trainer.strategy, "gradcomp_hook", None)
    if hook is None:
        raise RuntimeError("the GradCompStrategy has no compression hook yet; is the model wrapped in DDP?")
    return hook


def new_steps(hook: GradCompHook | OuterSync | ReplicaExchange, after: int) -> list[StepStats]:
    """The recorded steps with index above ``after``, oldest first (walks the history from its end)."""
    steps: list[StepStats] = []
    for stats in reversed(hook.history):
        if stats.step <= after:
            break
        steps.append(stats)
    steps.reverse()
    return steps


def gather_vectors(trainer: pl.Trainer, pl_module: pl.LightningModule, local: list[float]) -> list[list[float]]:
    """Every rank's list ``local`` (same length on all), in rank order: one small ``all_gather``.

    Every rank must call it at the same point. float64 keeps byte counts exact up to 2**53.
    """
    tensor = torch.tensor(local, dtype=torch.float64, device=pl_module.device)
    world_size = trainer.world_size
    if world_size == 1 or not (dist.is_available() and dist.is_initialized()):
        return [tensor.cpu().tolist()]
    out = [torch.empty_like(tensor) for _ in range(world_size)]
    dist.all_gather(out, tensor)
    return [row.cpu().tolist() for row in out]


def log_to_loggers(trainer: pl.Trainer, metrics: Mapping[str, float], step: int) -> None:
    """Write ``metrics`` at ``step`` to every logger of the trainer, from rank 0 only.

    Straight to the loggers rather than through ``LightningModule.log``: the values are logged at
    the callback's own frequency, whatever the trainer's ``log_every_n_steps``.
    """
    if trainer.is_global_zero and metrics:
        for logger in trainer.loggers:
            logger.log_metrics(dict(metrics), step=step)
