"""One DDP communication hook: bucket -> units -> (node) -> memory -> compressor -> aggregator -> memory -> bucket.

A gradient's trip through :class:`GradCompHook`, top to bottom:

1. DDP hands over a bucket. The bucket is only a delivery: its gradients are filed into the
   *units* planned from the parameters alone (:mod:`lightning_gradcomp.core.units`: one per parameter,
   ``granularity="layer"``; the whole model, ``"model"``; size-capped groups, ``"group"``; parameters smaller than
   ``min_compress_numel`` or kept dense form dense units). A unit of several parameters is read where the buckets hold
   them (:class:`~lightning_gradcomp.core.compressors.segments.Segments`) by a compressor that selects entries (Top-k),
   else copied into a flat buffer kept from step to step. The bucket's future stays open until every unit touching it is
   done, so what is compressed together, and how it is summed, never depends on DDP's bucket layout, which changes after
   the first step and again after every restart.
2. Once all of a unit's gradients have arrived, the topology (:mod:`lightning_gradcomp.core.comm.hierarchy`)
   decides who compresses it: by default every rank its own gradient; with ``hierarchy="node"``
   the node's ranks first sum it densely over their fast links, and one rank per node, the unit's
   owner, compresses the node's sum for the slow links between nodes (steps 3-6 run on owners
   only, and the aggregator's collectives span the owners).
   The memory hands over the tensor to compress
   (``grad + residual`` under error feedback, ``grad - h_i`` under DIANA).
3. Units whose compressor shares a scale agree on it with one MAX allreduce.
4. Each compressed unit is compressed with its own random stream, a pure function of
   (seed, rank, step, unit) (:mod:`lightning_gradcomp.core.randomness`), and with its warm start
   when the compressor carries one from step to step (PowerSGD's ``Q``,
   :mod:`lightning_gradcomp.core.warm_start`); a compressor that compresses a group parameter by
   parameter (PowerSGD's matrices) is told their shapes.
5. All units completed by this bucket are aggregated in one go (one collective, plus a size
   exchange when sizes vary across ranks); a float sum gets a collective of its own, so its
   summation order is fixed by its unit, not by which units happen to travel with it. The
   aggregation is *launched* (:meth:`~lightning_gradcomp.core.comm.Aggregator.start`): its last
   collective runs on while the backward pass computes the next bucket, and it lands at the next
   bucket's call (every launched one at the last bucket's). A summable form of several rounds
   (PowerSGD's ``P`` then ``Q``) launches its later rounds as it lands. Every collective is
   issued from the hook, launches and landings in bucket order, so every rank issues the same
   ones in the same order.
6. When it lands, the memory first settles what follows from this rank's own payload
   (:meth:`~lightning_gradcomp.core.memory.Memory.settle_`: error feedback's new residual, DIANA's
   ``h_i``), if the gathered data say the average is finite; then the average is decoded over the
   tensor that was compressed (DDP's bucket itself: a unit's memory and its average need no
   model-sized buffer of their own), and the memory turns it into the gradient estimate there
   (:meth:`~lightning_gradcomp.core.memory.Memory.conclude_`). Where the payload cannot tell what of it
   reached the average, or whether that is finite, before decoding (PowerSGD's), the average is
   decoded into a kept buffer first.
   Under ``hierarchy="node"`` the owner then shares the estimate with its node (one exact sum
   over the node, the other ranks adding zeros). Every bucket whose units are all done has its
   future completed.

Before the first bucket of each step, the schedule (:mod:`lightning_gradcomp.core.schedule`) plans the
step: dense or compressed, and at which density. The default is ``warmup_steps`` dense steps, then
compressed ones, their density lowered gradually by a density warm-up if one is set, all from the
step counter alone. An adaptive schedule (:class:`~lightning_gradcomp.core.adaptive.Accordion`) is handed
each step's squared norm of this rank's gradient, read off the buckets as they arrive, and decides
once per interval from the ranks' sums (one collective of two numbers), so every rank plans alike.
Dense steps, and every step of the identity compressor without memory (the dense baseline), are
averaged exactly as DDP does: on those steps the hook *is* DDP, bucket layout included; what error
feedback still owes (:meth:`~lightning_gradcomp.core.memory.Memory.flush_`) goes with a dense step's gradient.

Non-finite gradients: the average is returned as is (NaN/Inf reach the optimizer exactly as under
plain DDP, so AMP's GradScaler skips the step), and the memory update of every unit whose average
is not finite is skipped, so residuals and shifts keep their last finite values.
The hook records a :class:`StepStats` per optimizer step for the callbacks; nothing else flows
back. (No ``from __future__ import annotations`` here: DDP checks the hook's annotations.)
"""

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_gradcomp.core.comm import AGGREGATORS, Aggregator, Collectives, CommCounter, Contribution, Pending
from lightning_gradcomp.core.comm.hierarchy import FlatTopology, NodeTopology
from lightning_gradcomp.core.compressors import Compressor, IdentityCompressor
from lightning_gradcomp.core.compressors.finiteness import nonfinite_count
from lightning_gradcomp.core.compressors.segments import Segments, adjoining, pieces
from lightning_gradcomp.core.memory import Memory, NoMemory
from lightning_gradcomp.core.randomness import UnitStreams
from lightning_gradcomp.core.schedule import DensityWarmup, WarmupSchedule
from lightning_gradcomp.core.stats import Capture, LayerStats, StepStats
from lightning_gradcomp.core.units import DEFAULT_UNIT_CAP_MB, GRANULARITIES, Unit, UnitAssembler, plan_units
from lightning_gradcomp.core.validation import check_choice
from lightning_gradcomp.core.warm_start import WarmStarts
from lightning_gradcomp.core.workspace import OWN_PAYLOAD, Workspace
from lightning_gradcomp.ddp.arrivals import GradientArrivals

__all__ = ["GRANULARITIES", "GradCompHook", "gradcomp_comm_hook"]


@dataclass(frozen=True)
class _Exchange:
    """One launched aggregation: the units it completes, those this rank compresses (``mine``: all of them
    unless the topology gives units to owners), the tensors compressed, and what is still in flight."""

    ready: list[tuple[Unit, list[Tensor]]]
    mine: list[tuple[Unit, list[Tensor]]]
    tensors: "list[Tensor | Segments]"
    contributions: list[Contribution]
    raws: dict[int, list[Tensor]]
    pending: Pending | None


class GradCompHook:
    """State and logic of the compression hook; register it with :func:`gradcomp_comm_hook`.

    Args:
        compressor: compresses each unit.
        memory: per-parameter state (none, error feedback, DIANA).
        aggregator: ``"allreduce"``, ``"allgather"``, ``"gtopk"`` (or an :class:`Aggregator`).
        named_parameters: ``(name, parameter)`` of the DDP-wrapped module, as ``named_parameters()``
            gives them; the units are planned from them.
        granularity: ``"layer"``, ``"model"`` or ``"group"`` (see :mod:`lightning_gradcomp.core.units`).
        unit_cap_mb: size cap of a ``"group"`` unit and of a dense unit.
        warmup_steps: steps averaged densely, as DDP would, before compression starts.
        min_compress_numel: parameters with fewer elements are averaged densely.
        dense_names: names of further parameters averaged densely (e.g. the logits layer).
        density_warmup: sets the compressor's density at each compressed step (see
            :mod:`lightning_gradcomp.core.schedule`); ``None`` leaves it alone.
        schedule: plans every step instead of ``warmup_steps`` and ``density_warmup`` (e.g. an
            :class:`~lightning_gradcomp.core.adaptive.Accordion`); part of the hook's state.
        seed: base seed of the units' random streams (see :mod:`lightning_gradcomp.core.randomness`).
        group: the process group (default: the world).
        history: how many :class:`StepStats` to keep.
        topology: who compresses each unit and with whom it is exchanged: a
            :class:`~lightning_gradcomp.core.comm.hierarchy.NodeTopology` for ``hierarchy="node"``; by
            default every rank, across ``group``.
    """

    def __init__(
        self,
        compressor: Compressor,
        memory: Memory,
        aggregator: "str | Aggregator",
        named_parameters: "list[tuple[str, torch.nn.Parameter]]",
        granularity: str = "layer",
        unit_cap_mb: float = DEFAULT_UNIT_CAP_MB,
        warmup_steps: int = 1,
        min_compress_numel: int = 1024,
        dense_names: frozenset[str] = frozenset(),
        density_warmup: "DensityWarmup | None" = None,
        seed: int = 0,
        group: dist.ProcessGroup | None = None,
        history: int = 10_000,
        topology: "NodeTopology | None" = None,
        schedule: "WarmupSchedule | None" = None,
    ) -> None:
        if isinstance(aggregator, str):
            aggregator = AGGREGATORS[check_choice("aggregator", aggregator, sorted(AGGREGATORS))]()
        named_parameters = list(named_parameters)
        self.compressor = compressor
        self.memory = memory
        self.aggregator = aggregator
        self._plan_units = partial(
            plan_units, named_parameters, granularity, min_compress_numel, unit_cap_mb=unit_cap_mb
        )
        self.units = self._plan_units(dense_names=dense_names)
        self.schedule = schedule if schedule is not None else WarmupSchedule(warmup_steps, density_warmup)
        # the inter-node collectives of a node topology count into the hook's counter: they are its bytes_sent
        self.counter = topology.counter if topology is not None else CommCounter()
        self.collectives = Collectives(group, self.counter)
        self.world_size = self.collectives.world_size
        self.rank = self.collectives.rank
        self.topology: FlatTopology | NodeTopology = topology or FlatTopology(self.collectives)
        self.streams = UnitStreams(seed, self.rank)
        self.warm_starts = WarmStarts(compressor, self.streams)
        self.step = 0
        self.calls = 0
        self.history: deque[StepStats] = deque(maxlen=history)
        self._names = {id(p): name for name, p in named_parameters}
        # a parameter that received no gradient on this rank (DDP hands zeros for it) leaves its memory be
        self.arrivals = GradientArrivals(named_parameters)
        self._positions = {id(p): i for i, (_, p) in enumerate(named_parameters)}
        self._device = named_parameters[0][1].device if named_parameters else torch.device("cpu")
        # an adaptive schedule's per-parameter squared gradient norms of the step, summed in parameter order
        self._squared_norms = torch.zeros(len(named_parameters), dtype=torch.float64, device=self._device)
        self._shapes, self._assembler = self._routes()
        # parameters of dense units whose state owed by the memory (a checkpoint of another plan, where they were
        # compressed) went with their first gradient of a compressed step; a memory keeps none for them after that
        self._flushed_dense: set[str] = set()
        # model-sized buffers (a unit's flat copy, its average, its wire summand) kept from step to step
        self.workspace = Workspace()
        self._dense = IdentityCompressor()
        # identity compressor, no memory, no node structure: DDP's own in-place scaled allreduce of the bucket
        self._dense_only = isinstance(compressor, IdentityCompressor) and isinstance(memory, NoMemory) and not topology
        self._current: StepStats | None = None
        self._in_flight: deque[_Exchange] = deque()
        self.track_layers = False
        #: called once, at the first bucket, where every rank is in step (the strategies plan the units again
        #: there with the output layer found from the first forward pass: :meth:`keep_dense`)
        self.before_first_bucket: Callable[[], None] | None = None
        self._capture: frozenset[str] = frozenset()
        #: the loss scale the gradients are multiplied by under AMP (``GradScaler.get_scale``), for an adaptive
        #: schedule's gradient norms; the strategies set it from their precision plugin's scaler
        self.loss_scale: Callable[[], float] | None = None

    def _routes(self) -> "tuple[dict[int, dict[str, object]], UnitAssembler]":
        """What follows from the units: the shapes told to a compressor that compresses a flat unit parameter by
        parameter, and the assembler that gathers each unit's gradients from the buckets."""
        shapes = {u.index: {"shapes": u.shapes} if self.compressor.takes_shapes else {} for u in self.units}
        return shapes, UnitAssembler(self.units)

    def keep_dense(self, dense_names: frozenset[str]) -> None:
        """Plan the units afresh with ``dense_names`` averaged densely, before the hook's first bucket (an output
        layer found from the model's first forward pass: :attr:`before_first_bucket`).

        Nothing planned from the units exists yet then; what a checkpoint restored (memories by parameter name,
        warm starts by unit label) is keyed by names, not by the units' order.
        """
        if self.calls:
            raise RuntimeError("the units are planned before the hook's first bucket; it has handled some already")
        self.units = self._plan_units(dense_names=dense_names)
        self._shapes, self._assembler = self._routes()
        self._flushed_dense = set()

    def request_capture(self, names: "frozenset[str] | set[str] | list[str]") -> None:
        """Keep the tensors of parameters ``names`` at the next compressed step, in ``StepStats.captures``.

        Requests add up (several diagnostics may ask at the same step). Only the latest step keeps its
        captures: finishing a step drops the previous step's, so history holds no tensors for long.
        """
        self._capture = self._capture | frozenset(names)

    @property
    def pending_captures(self) -> frozenset[str]:
        """Parameter names whose tensors the next compressed step will capture."""
        return self._capture

    @property
    def last_step(self) -> StepStats | None:
        """Statistics of the last completed step, or ``None`` before the first."""
        return self.history[-1] if self.history else None

    def state_dict(self) -> dict:
        """What must survive a restart: the step counter (random streams derive from it), the compressor's
        warm starts, the schedule's state (an adaptive one's statistics and regime) and the memory's state
        (residuals, shifts: live tensors, as ``Module.state_dict``)."""
        return {
            "step": self.step,
            "warm_starts": self.warm_starts.state_dict(),
            "schedule": self.schedule.state_dict(),
            "memory": self.memory.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`'s output, the memory's onto the parameters' device (a state without
        ``"memory"``, as the strategies' checkpoint shards keep it apart, leaves the memory as it is)."""
        self.step = int(state["step"])
        self.warm_starts.load_state_dict(state.get("warm_starts", {}))
        self.schedule.load_state_dict(state.get("schedule", {}))
        if "memory" in state:
            self.memory.load_state_dict({k: v.to(self._device) for k, v in state["memory"].items()})

    def __call__(self, bucket: dist.GradBucket) -> torch.futures.Future[Tensor]:
        """Average ``bucket`` across ranks (compressed after the warm-up): a future of the bucket's buffer.

        A compressed bucket's future completes once every unit it holds a part of has landed (at the
        next bucket's call, at the latest with the last bucket), so its exchange overlaps the rest of
        the backward pass; dense steps (warm-up, identity baseline) return the allreduce's future.
        """
        buffer = bucket.buffer()
        if self.before_first_bucket is not None:
            first, self.before_first_bucket = self.before_first_bucket, None
            first()
        if self._current is None:
            self._current = self._plan_step()
        stats = self._current
        if self.schedule.observes:  # this rank's gradient as it arrived, before anything touches it
            for p, grad in zip(bucket.parameters(), bucket.gradients(), strict=True):
                norm = torch.linalg.vector_norm(grad, dtype=torch.float32)  # a half-precision norm overflows
                self._squared_norms[self._positions[id(p)]] = norm.square()
        stats.buckets += 1
        stats.numel += buffer.numel()
        stats.dense_bytes += buffer.numel() * buffer.element_size()
        self.calls += 1

        if stats.compressed:
            future: torch.futures.Future[Tensor] = torch.futures.Future()
            grads = [g.reshape(-1) for g in bucket.gradients()]
            ready = self._assembler.deliver(self._bucket_names(bucket), grads, future, buffer)
            if ready:
                self._in_flight.append(self._launch(ready, stats))
            # the exchange just launched runs on while the backward pass computes the next bucket;
            # earlier ones land now (all of them at the last bucket)
            while len(self._in_flight) > (0 if bucket.is_last() else 1):
                self._land(self._in_flight.popleft(), stats)
            if bucket.is_last():
                self._assembler.end_step()
        else:
            # a dense step sends everything: what error feedback still owes goes with this step's gradient
            names = self._bucket_names(bucket)
            for name, grad, out in zip(names, bucket.gradients(), self._sat_out(names), strict=True):
                if not out:
                    self.memory.flush_(name, grad.view(-1))  # state is flat, as the units hand it over
            # DDP's own path: scaled in place, reduced while the backward pass goes on
            future = self.collectives.all_reduce_async(buffer.mul_(1.0 / self.world_size))

        if bucket.is_last():
            self._finish_step(stats)
        return future

    def _plan_step(self) -> StepStats:
        """Zero the counters and let the schedule plan the step that starts (an adaptive schedule first decides,
        at the end of each interval, from its statistics summed over the ranks: one small collective)."""
        self.counter.reset()
        if self.topology.intra_counter is not None:
            self.topology.intra_counter.reset()
        if self.schedule.due(self.step):
            summed = self.collectives.all_reduce_(self.schedule.statistics().to(self._device))
            self.schedule.decide(self.step, summed, self.world_size)
        plan = self.schedule.plan(self.step)
        if plan.compress and plan.density is not None:
            self.compressor.density = plan.density
        return StepStats(
            step=self.step,
            compressed=plan.compress and not self._dense_only,
            regime=plan.regime,
            planned_density=plan.density if plan.compress else None,
        )

    def _bucket_names(self, bucket: dist.GradBucket) -> list[str]:
        try:
            return [self._names[id(p)] for p in bucket.parameters()]
        except KeyError:
            raise RuntimeError("a bucket holds a parameter that is not in the module given to the hook") from None

    def _launch(self, ready: list[tuple[Unit, list[Tensor]]], stats: StepStats) -> _Exchange:
        """Compress the units that are complete and launch their aggregation, all in one (steps 2-5)."""
        start = time.perf_counter()
        comm_before = self.counter.seconds
        intra_before = self._intra_seconds()
        raws = {  # before the node sum below, which may overwrite the gradients in place
            unit.index: [g.clone() for g in grads]
            for unit, grads in ready
            if unit.compressed and self._capture.intersection(unit.names) and self.topology.owns(unit.index)
        }
        # flat: every unit is this rank's gradient; per node: the node's sum, and only the units this rank owns
        unit_tensors = [self._unit_tensor(unit, grads) for unit, grads in ready]
        self.topology.enter_(unit_tensors)
        owned = [i for i, (unit, _) in enumerate(ready) if self.topology.owns(unit.index)]
        mine = [ready[i] for i in owned]
        tensors = [unit_tensors[i] for i in owned]
        for (unit, _), x in zip(mine, tensors, strict=True):
            if unit.compressed:  # grad + residual (or grad - h_i), in place: no model-sized temporary
                parts = pieces(x, unit.numels)
                for name, part, out in zip(unit.names, parts, self._sat_out(unit.names), strict=True):
                    if not out:  # a parameter this rank sent no gradient for sends nothing of its memory
                        self.memory.compensate_(name, part)
        scales = self._shared_scales([unit for unit, _ in mine], tensors)
        if self.compressor.takes_scratch:  # this rank's payloads end to end in a kept buffer: sent as one span
            compressed = [(unit.index, x) for (unit, _), x in zip(mine, tensors, strict=True) if unit.compressed]
            sizes = [self.compressor.payload_nbytes(x.shape, x.dtype) for _, x in compressed]
            self.workspace.lay_out([index for index, _ in compressed], OWN_PAYLOAD, sizes, self._device)
        contributions = []
        for (unit, _), x in zip(mine, tensors, strict=True):
            scratch = self.workspace.scratch(unit.index)  # the unit's kept buffers: no allocation per step
            if unit.compressed:
                generator = self.streams.generator(x.device, self.step, unit.key)
                extra = {
                    **scales.get(unit.index, {}),
                    **self.warm_starts.arguments(unit, x),
                    **self._shapes[unit.index],
                    **({"scratch": scratch} if self.compressor.takes_scratch else {}),
                }
                payload = self.compressor.compress(x, generator, **extra)
                target = partial(scratch, "mean", unit.numel, x.dtype, x.device)
                contributions.append(Contribution(self.compressor, payload, target, scratch))
                selected = payload.selected
                stats.numel_compressed += x.numel()
                stats.payload_bytes += payload.nbytes
                stats.selected += selected or 0
                if self.track_layers:
                    stats.layers[unit.label] = LayerStats(x.numel(), payload.nbytes, selected)
            else:
                if not self._flushed_dense.issuperset(unit.names):  # what a memory owes from another plan, once
                    for name, part, out in zip(
                        unit.names, pieces(x, unit.numels), self._sat_out(unit.names), strict=True
                    ):
                        if not out and name not in self._flushed_dense:
                            self._flushed_dense.add(name)
                            self.memory.flush_(name, part)
                contributions.append(Contribution(self._dense, self._dense.compress(x), scratch=scratch))
        pending = self.aggregator.start(contributions, self.topology.collectives) if contributions else None
        waited = self.counter.seconds - comm_before + self._intra_seconds() - intra_before  # scales, sizes, node sums
        stats.seconds_compress += time.perf_counter() - start - waited
        stats.seconds_communicate += waited
        return _Exchange(ready, mine, tensors, contributions, raws, pending)

    def _land(self, exchange: _Exchange, stats: StepStats) -> None:
        """Wait for an exchange's collectives, then let the memory write each estimate into the bucket (step 6)."""
        start = time.perf_counter()
        comm_before = self.counter.seconds
        intra_before = self._intra_seconds()
        aggregates = exchange.pending.wait() if exchange.pending is not None else []
        mine, contributions, raws = exchange.mine, exchange.contributions, exchange.raws
        for (unit, grads), x, contribution, agg in zip(mine, exchange.tensors, contributions, aggregates, strict=True):
            parts = pieces(x, unit.numels)  # each parameter's share of what was compressed (views)
            if not unit.compressed:
                for grad, mean in zip(grads, agg.mean.split(unit.numels), strict=True):
                    grad.copy_(mean)
                continue
            # The mean is written over the compressed tensor itself (DDP's bucket, or the unit's kept copy) when
            # what must be read first can be: what this rank sent (for the memory, a capture, or the decoding
            # itself: a gathered dense payload is a view of that tensor) and whether the mean is finite (for a
            # memory with state); else it is decoded into a kept buffer first.
            reads_sent = self.memory.uses_sent or unit.index in raws or not agg.from_sum
            early = (agg.reached_before_mean or not reads_sent) and (agg.finite_known or not self.memory.keeps_state)
            if not early:
                agg.decode_into(None)
            if unit.index in raws:  # before the bucket, which may hold the compensated tensor, is overwritten
                self._record_capture(stats, unit, raws[unit.index], parts, contribution, agg.sent)
            reached = agg.reached.split(unit.numels) if self.memory.uses_sent else [None] * len(unit.names)
            # Every rank holds the same mean, so all skip (or not) alike: a NaN/Inf step reaches the
            # optimizer as under plain DDP (GradScaler skips it) but never enters the memory (a memoryless
            # method has none to keep it from: no pass over the mean to find out). On a device whether it is
            # finite stays there, a flag the memory's updates are kept by: the host does not wait for it.
            finite = agg.finite if self.memory.keeps_state else True
            stats.nonfinite_units += nonfinite_count(finite)
            for name, part, sent, out in zip(unit.names, parts, reached, self._sat_out(unit.names), strict=True):
                if not out:
                    self.memory.settle_(name, part, sent, unit_numel=unit.numel, finite=finite)
            means = agg.decode_into(x.reshape(-1) if early else None).split(unit.numels)
            for name, grad, mean in zip(unit.names, grads, means, strict=True):
                self.memory.conclude_(name, mean, out=grad, unit_numel=unit.numel, update=finite)
        self._share(exchange)
        for finished, result in self._assembler.done([unit for unit, _ in exchange.ready]):
            finished.set_result(result)
        waited = self.counter.seconds - comm_before + self._intra_seconds() - intra_before
        stats.seconds_communicate += waited
        stats.seconds_decompress += time.perf_counter() - start - waited

    def _share(self, exchange: _Exchange) -> None:
        """Zero the gradients of the units another rank owns, then let the topology complete them (per node:
        one exact sum over the node; flat: every unit is this rank's, nothing to zero or share)."""
        if len(exchange.mine) < len(exchange.ready):
            owned = {unit.index for unit, _ in exchange.mine}
            for unit, grads in exchange.ready:
                if unit.index not in owned:
                    for grad in grads:
                        grad.zero_()
        self.topology.share_([grad for _, grads in exchange.ready for grad in grads])

    def _sat_out(self, names: list[str]) -> list[bool]:
        """For each of ``names``: whether that parameter received no gradient on this rank this step
        (:mod:`lightning_gradcomp.ddp.arrivals`). Per node the owner compresses the node's sum, which any of its ranks
        may have used: nothing sits out there."""
        if isinstance(self.topology, FlatTopology):
            return self.arrivals.sat_out(names)
        return [False] * len(names)

    def _intra_seconds(self) -> float:
        counter = self.topology.intra_counter
        return counter.seconds if counter is not None else 0.0

    def _unit_tensor(self, unit: Unit, grads: list[Tensor]) -> Tensor | Segments:
        """The tensor a unit is compressed from: a lone parameter's gradient itself (a view of DDP's bucket,
        in its shape); gradients that lie back to back in one bucket, as one flat view of it; the unit's
        gradients where they lie, as :class:`Segments`, for a compressor that reads them so (no copy; gradients of
        one dtype, which DDP buckets apart from others); else
        the gradients copied into a flat buffer allocated once and kept (a node's sum is taken in the
        tensor the unit is compressed from, whichever it is)."""
        if len(grads) == 1:
            return grads[0].view(unit.shape)
        inside_bucket = adjoining(grads)
        if inside_bucket is not None:
            return inside_bucket
        if (
            unit.compressed
            and self.compressor.takes_segments
            and isinstance(self.topology, FlatTopology)
            and len({(g.dtype, g.device) for g in grads}) == 1  # else the flat copy casts them to one dtype
        ):
            return Segments(grads)
        like = grads[0]
        return torch.cat(grads, out=self.workspace.buffer(unit.index, "unit", unit.numel, like.dtype, like.device))

    def _record_capture(
        self,
        stats: StepStats,
        unit: Unit,
        raws: list[Tensor],
        parts: list[Tensor],
        contribution: Contribution,
        sent: Tensor,
    ) -> None:
        compressed = self.compressor.decompress(contribution.payload).split(unit.numels)
        sents = sent.split(unit.numels)
        for name, raw, part, local, mine in zip(unit.names, raws, parts, compressed, sents, strict=True):
            if name in self._capture:
                stats.captures[name] = Capture(raw, part.clone(), local.clone(), mine.clone())
        self._capture = self._capture.difference(stats.captures)

    def _shared_scales(self, units: list[Unit], tensors: list[Tensor]) -> dict[int, dict[str, Tensor]]:
        """By unit index, the MAX over ranks of each compressed unit's local scale (one small collective),
        with the local scale itself: ``compress``'s ``scale`` and ``local_scale`` arguments."""
        if not self.compressor.shares_scale:
            return {}
        pairs = zip(units, tensors, strict=True)
        local = {unit.index: self.compressor.local_scale(x) for unit, x in pairs if unit.compressed}
        if not local:
            return {}
        stacked = torch.stack([scale.float() for scale in local.values()])
        assert self.topology.collectives is not None  # a rank that compresses a unit has collectives for it
        self.topology.collectives.all_reduce_(stacked, op=dist.ReduceOp.MAX)
        return {
            index: {"scale": shared, "local_scale": own}
            for (index, own), shared in zip(local.items(), stacked.unbind(), strict=True)
        }

    def _finish_step(self, stats: StepStats) -> None:
        self.arrivals.end_step()
        stats.take_counts(self.counter)
        if self.topology.intra_counter is not None:
            stats.bytes_sent_intra_node = self.topology.intra_counter.bytes_sent
            stats.bytes_received_intra_node = self.topology.intra_counter.bytes_received
            stats.collectives += self.topology.intra_counter.calls
        if not stats.compressed:
            stats.seconds_communicate = self.counter.seconds
        if self.schedule.observes:
            squared = self._squared_norms.sum()
            if self.loss_scale is not None:  # AMP's loss scale multiplies the gradients: take it out
                squared = squared / float(self.loss_scale()) ** 2
            self.schedule.observe(squared)
            self._squared_norms.zero_()
        if self.history:
            self.history[-1].captures.clear()
        self.history.append(stats)
        self._current = None
        self.step += 1


def gradcomp_comm_hook(state: GradCompHook, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: compress, aggregate and average ``bucket`` with ``state``."""
    return state(bucket)
