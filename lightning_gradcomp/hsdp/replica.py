"""Compressed HSDP on FSDP2: each FSDP unit's gradient shard averaged between replicas through the library's pipeline.

With ``fully_shard(module, mesh=mesh["shard"])`` over the shard dimension of a (replicate, shard) device mesh, FSDP2
reduce-scatters each unit's gradients inside the shard group and hands the hook set by
``FSDPModule.set_all_reduce_hook`` the unit's flat, padded shard, averaged over the shard group; the hook must average
it across the replicas in place (PyTorch's "custom HSDP"; torch 2.13, ``_fsdp_collectives.foreach_reduce``). Here
that average goes through a compressor, a memory and an aggregator
(:class:`~lightning_gradcomp.core.flat_average.CompressedAverage`): the exchange between replicas, usually the slow link
between nodes, is the traffic compressed; inside a node FSDP's own reduce-scatter stays dense. A shard's memory (an
error-feedback residual) lives with the rank that owns the shard, keyed by the unit's name and the shard's index, and
its random streams by (seed, replica, step, unit and shard).

Every replica starts from the first replica's shards (broadcast when the exchange is installed, as DDP starts from
rank 0's weights; buffers stay each rank's own, as under FSDP2). Each backward pass that exchanges leaves one
:class:`~lightning_gradcomp.core.stats.StepStats` in ``history``: every unit's exchange summed, each compressed unit's
share in ``layers``. With one replica nothing is exchanged (the shards stay as FSDP2 averaged them).

What FSDP2 hands the hook sets three rules: gradient accumulation skips the reduce-scatter with
``set_requires_gradient_sync(False)`` on the micro-batches (``set_requires_all_reduce(False)`` does not stop a hook:
every micro-batch would be exchanged); the shard comes in the reduce dtype, so keep ``reduce_dtype=torch.float32`` in
a mixed-precision policy for the memory's residual to hold small values; and a parameter without a gradient at some
step shortens its unit's shard, which the memory refuses, so a model with parameters that sit out needs
``set_reduce_scatter_unused_params(True)``.
"""

from __future__ import annotations

import warnings
from collections import deque
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from lightning_gradcomp.core.comm import Aggregator, Collectives, CommCounter
from lightning_gradcomp.core.compressors import Compressor
from lightning_gradcomp.core.flat_average import CompressedAverage, check_flat_compressor
from lightning_gradcomp.core.pipeline_arguments import aggregator_name, build_pipeline
from lightning_gradcomp.core.stats import LayerStats, StepStats
from lightning_gradcomp.core.validation import check_int

__all__ = ["ReplicaExchange"]

#: The name a unit that is the root module itself goes by.
ROOT = "<root>"


def _check_shard_groups(units: list[tuple[str, FSDPModule]], mesh: DeviceMesh, shard_dim: str) -> None:
    """``ValueError`` naming the units not sharded over ``mesh[shard_dim]``: over the 2-D mesh (FSDP2's own HSDP would
    average them before the hook) or over another group (the replicas would average different slices)."""
    wanted = dist.get_process_group_ranks(mesh.get_group(shard_dim))
    native, elsewhere = [], []
    for fqn, unit in units:
        for group in unit._get_fsdp_state()._fsdp_param_groups:
            if group._is_hsdp:
                native.append(fqn)
            elif dist.get_process_group_ranks(group.mesh_info.shard_process_group) != wanted:
                elsewhere.append(fqn)
    if native:
        raise ValueError(
            f"FSDP units {native} were sharded over the 2-D mesh (FSDP2's own HSDP, which averages between "
            f"replicas before the hook): shard them with fully_shard(..., mesh=mesh[{shard_dim!r}])"
        )
    if elsewhere:
        raise ValueError(
            f"FSDP units {elsewhere} were sharded over other ranks than mesh[{shard_dim!r}] ({wanted}; fully_shard "
            f"without a mesh shards over every rank): shard them with fully_shard(..., mesh=mesh[{shard_dim!r}])"
        )


def _start_alike(module: nn.Module, group: ProcessGroup) -> None:
    """Give every replica the first replica's shards, as DDP starts every rank from rank 0's weights: the exchange
    averages gradients only, so replicas that started apart would stay apart."""
    source = dist.get_process_group_ranks(group)[0]
    with torch.no_grad():
        for parameter in module.parameters():
            local = parameter.to_local() if isinstance(parameter, DTensor) else None
            if local is not None and local.numel():  # the same shard shape on every replica: all skip alike
                dist.broadcast(local, src=source, group=group)


class ReplicaExchange:
    """Install the compressed replica exchange on every FSDP unit of ``module`` (``fully_shard`` already applied over
    ``mesh[shard_dim]``): the plain-torch entry point, as :func:`~lightning_gradcomp.make_hook` is for DDP.

    Args:
        module: the model, its units already ``fully_shard``-ed over the shard dimension of ``mesh``.
        mesh: a 2-D device mesh, ``(replicate, shard)``; every unit must be sharded over ``mesh[shard_dim]``.
        compressor, compressor_kwargs, density, wire_precision, memory, memory_kwargs, aggregator: the compression
            pipeline, as :class:`~lightning_gradcomp.GradCompStrategy` takes it (compressors that need a tensor's own
            shape, a warm start or a shared scale are refused: a shard is a flat slice of several parameters).
        min_compress_numel: shards with fewer elements are averaged densely.
        seed: base seed of the compressors' random streams.
        replicate_dim, shard_dim: the mesh's dimension names.
        history: how many records (one per step, every unit's exchange of it summed, each unit's share in
            ``layers``) to keep.
    """

    def __init__(
        self,
        module: nn.Module,
        mesh: DeviceMesh,
        compressor: str | Compressor = "topk",
        compressor_kwargs: dict[str, Any] | None = None,
        density: float | None = None,
        wire_precision: str | None = None,
        memory: str = "ef",
        memory_kwargs: dict[str, Any] | None = None,
        aggregator: str | Aggregator = "auto",
        min_compress_numel: int = 0,
        seed: int = 0,
        replicate_dim: str = "replicate",
        shard_dim: str = "shard",
        history: int = 1000,
    ) -> None:
        check_int("min_compress_numel", min_compress_numel, 0)
        check_int("seed", seed, 0)
        check_int("history", history, 1)
        names = tuple(mesh.mesh_dim_names or ())
        if mesh.ndim != 2 or replicate_dim not in names or shard_dim not in names:
            raise ValueError(
                f"mesh must be a 2-D device mesh with dimensions {replicate_dim!r} and {shard_dim!r} (replicate_dim, "
                f"shard_dim), got {mesh.ndim} dimensions named {names}"
            )
        name = aggregator_name(aggregator)
        codec, state = build_pipeline(
            compressor, compressor_kwargs, density, wire_precision, memory, memory_kwargs, name
        )
        check_flat_compressor(codec, "HSDP's replica exchange", name)
        units = [(fqn or ROOT, unit) for fqn, unit in module.named_modules() if isinstance(unit, FSDPModule)]
        if not units:
            raise ValueError("module holds no FSDP unit: apply fully_shard(..., mesh=mesh[shard_dim]) first")
        _check_shard_groups(units, mesh, shard_dim)
        #: counts the bytes handed to collectives between replicas
        self.counter = CommCounter()
        group = mesh.get_group(replicate_dim)
        #: the number of replicas; with one, the shards stay as FSDP2 averaged them (nothing to exchange)
        self.replicas = mesh[replicate_dim].size()
        self.average = CompressedAverage(codec, state, aggregator, Collectives(group, self.counter), seed,
                                         min_compress_numel)  # fmt: skip
        self.memory = state
        self.shard_index = mesh[shard_dim].get_local_rank()
        self._names = {f"{fqn}#shard{self.shard_index}" for fqn, _ in units}
        self._restored: dict[str, Tensor] | None = None  # loaded memory, put on the shards' device at the first hook
        #: one record per backward pass that exchanged (an optimizer step), the latest last
        self.history: deque[StepStats] = deque(maxlen=history)
        self._open: StepStats | None = None
        self._open_task = -1
        self._steps_recorded = 0
        self._steps: dict[str, int] = {}
        if self.replicas == 1:
            warnings.warn(
                "ReplicaExchange: the mesh has one replica, so nothing crosses between replicas and each unit's "
                "shard stays as FSDP2 averaged it (no compression); HSDP compression needs several nodes",
                stacklevel=2,
            )
        _start_alike(module, group)
        for fqn, unit in units:
            unit.set_all_reduce_hook(partial(self._exchange, f"{fqn}#shard{self.shard_index}"))

    @property
    def units(self) -> list[str]:
        """The names this rank's units go by (``<module name>#shard<index>``; the root module is ``<root>``)."""
        return sorted(self._names)

    @property
    def last_step(self) -> StepStats | None:
        """The latest step's record (``None`` before the first exchange)."""
        return self.history[-1] if self.history else None

    def _exchange(self, name: str, shard: Tensor) -> None:
        """FSDP's hook for one unit: average its flat shard between the replicas, in place, and add what it cost to
        the step's record."""
        if shard.is_cuda:  # the hook runs on FSDP's side stream; the buffer was allocated on the reduce-scatter one
            shard.record_stream(torch.cuda.current_stream(shard.device))
        if self._restored is not None:
            self.memory.load_state_dict({key: t.to(shard.device) for key, t in self._restored.items()})
            self._restored = None
        step = self._steps[name] = self._steps.get(name, -1) + 1
        unit = StepStats(step=step, numel=shard.numel(), dense_bytes=shard.numel() * shard.element_size())
        compressed = self.replicas > 1 and self.average.compressed(shard.numel())
        if self.replicas > 1:
            before = self.counter.copy()
            self.average.average_([(name, shard.view(-1))], step, unit)
            unit.take_counts(self.counter.since(before))
        self._record(name, unit, compressed)

    def _record(self, name: str, unit: StepStats, compressed: bool) -> None:
        """Add one unit's exchange to the record of the backward pass running it, opened by its first exchange (a unit
        exchanged more than once in a backward pass adds to the same record; units that sit a step out leave no gap;
        under reentrant activation checkpointing a unit's exchange runs in a nested backward pass, with a record of its
        own)."""
        task = torch._C._current_graph_task_id()  # the backward pass running the hook (FSDP's final callbacks too)
        stats = self._open
        if stats is None or task != self._open_task:
            stats = self._open = StepStats(step=self._steps_recorded)
            self._open_task = task
            self._steps_recorded += 1
            self.history.append(stats)
        stats.compressed |= compressed
        stats.buckets += 1
        stats.add(unit)
        if compressed:  # as the DDP hook records its compressed units
            sparse = self.average.compressor.sparse
            seen = stats.layers.get(name, LayerStats(0, 0, 0 if sparse else None))
            selected = seen.selected + unit.selected if seen.selected is not None else None
            stats.layers[name] = LayerStats(seen.numel + unit.numel, seen.payload_bytes + unit.payload_bytes, selected)

    def state_dict(self) -> dict[str, Any]:
        """This rank's state: each unit's step count (its random streams follow it), the steps recorded, and the memory
        of its shards."""
        memory = self._restored if self._restored is not None else self.memory.state_dict()
        return {
            "steps": dict(self._steps),
            "steps_recorded": self._steps_recorded,
            "memory": {name: t.detach().to("cpu", copy=True) for name, t in memory.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output (this rank's own); the memory goes to the shards' device at the first
        exchange. A unit this model does not have is refused by name (a model wrapped otherwise would lose it)."""
        unknown = sorted(set(state["steps"]) - self._names)
        if unknown:
            raise ValueError(
                f"the saved replica exchange has units {unknown}, which this model lacks: {sorted(self._names)}"
            )
        self._steps = {str(name): int(step) for name, step in state["steps"].items()}
        self._steps_recorded = int(state.get("steps_recorded", max(self._steps.values(), default=-1) + 1))
        self._restored = dict(state["memory"])
