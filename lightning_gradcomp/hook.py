"""One DDP communication hook: bucket -> memory -> compressor -> aggregator -> memory -> bucket.

For each gradient bucket DDP hands over, :class:`GradCompHook`

1. splits the bucket into *units*: one per parameter (``granularity="layer"``) or one for all
   compressed parameters of the bucket (``"bucket"``); parameters smaller than
   ``min_compress_numel`` form one dense unit that is averaged exactly;
2. asks the memory for the tensor to compress (``grad + residual`` under error feedback);
3. compresses each unit (a one-parameter unit in the parameter's shape), after agreeing on
   shared scales with one MAX allreduce when the compressor asks for them;
4. aggregates all units of the bucket in one go (one collective, plus a size exchange when
   sizes vary across ranks);
5. asks the memory for the gradient estimate (``reconstruct``) and hands it what was sent
   (``update``), then writes the averaged gradient back into the bucket.

During the first ``warmup_steps`` steps the bucket is averaged densely, exactly as DDP does, and so
is every step of the identity compressor without memory (the dense baseline).

Non-finite gradients: the average is returned as is (NaN/Inf reach the optimizer exactly as under
plain DDP, so AMP's GradScaler skips the step), and the memory update of every unit whose average
is not finite is skipped, so residuals and shifts keep their last finite values.
The hook records a :class:`StepStats` per optimizer step for the callbacks; nothing else flows
back. (No ``from __future__ import annotations`` here: DDP checks the hook's annotations.)
"""

import time
from collections import deque
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_gradcomp.comm import AGGREGATORS, Aggregator, Collectives, CommCounter, Contribution
from lightning_gradcomp.compressors import Compressor, IdentityCompressor, SparsePayload
from lightning_gradcomp.memory import Memory, NoMemory

GRANULARITIES = ("layer", "bucket")


@dataclass
class StepStats:
    """What one optimizer step's gradient exchange cost on this rank.

    ``dense_bytes`` is what plain DDP hands to allreduce for the same buckets; ``bytes_sent`` what
    this hook handed to collectives (padding and size exchanges included), so
    ``compression_ratio = dense_bytes / bytes_sent`` is measured, not computed from a formula.
    ``nonfinite_units`` counts units whose average held NaN/Inf: their memory was left as it was.
    ``selected`` counts the entries of sparse payloads. ``layers`` (with ``track_layers``) and
    ``captures`` (after :meth:`GradCompHook.request_capture`) are filled for the diagnostics.
    """

    step: int
    compressed: bool = False
    buckets: int = 0
    numel: int = 0
    numel_compressed: int = 0
    payload_bytes: int = 0
    dense_bytes: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    collectives: int = 0
    seconds_compress: float = 0.0
    seconds_communicate: float = 0.0
    seconds_decompress: float = 0.0
    nonfinite_units: int = 0
    selected: int = 0
    layers: dict[str, "LayerStats"] = field(default_factory=dict)
    captures: dict[str, "Capture"] = field(default_factory=dict)

    @property
    def density(self) -> float | None:
        """Entries sent over entries compressed, for sparse payloads (``None`` otherwise)."""
        return self.selected / self.numel_compressed if self.selected and self.numel_compressed else None

    @property
    def compression_ratio(self) -> float:
        """Dense bytes over bytes actually sent (``inf`` if nothing was sent)."""
        return self.dense_bytes / self.bytes_sent if self.bytes_sent else float("inf")

    @property
    def bits_per_element(self) -> float:
        """Bits sent per gradient element of the step."""
        return 8.0 * self.bytes_sent / self.numel if self.numel else 0.0


@dataclass(frozen=True)
class LayerStats:
    """One compressed unit's share of a step: elements in, payload bytes out, entries sent if sparse."""

    numel: int
    payload_bytes: int
    selected: int | None


@dataclass(frozen=True)
class Capture:
    """One parameter's tensors at a captured step (flat, on the gradient's device).

    ``raw`` is the local gradient, ``compensated`` what the memory handed to the compressor,
    ``compressed`` the local payload decompressed, ``sent`` what of it reached the global result.
    """

    raw: Tensor
    compensated: Tensor
    compressed: Tensor
    sent: Tensor


@dataclass(frozen=True)
class _Unit:
    """Parameters (positions in the bucket) that are compressed together, or sent dense."""

    positions: tuple[int, ...]
    names: tuple[str, ...]
    numels: tuple[int, ...]
    compressed: bool
    shape: torch.Size  # the parameter's shape for a one-parameter unit, else the flat length


@dataclass
class _BucketPlan:
    units: list[_Unit] = field(default_factory=list)


class GradCompHook:
    """State and logic of the compression hook; register it with :func:`gradcomp_comm_hook`.

    Args:
        compressor: compresses each unit.
        memory: per-parameter state (none, error feedback).
        aggregator: ``"allreduce"`` or ``"allgather"`` (or an :class:`Aggregator`).
        param_names: ``id(parameter) -> name`` for the DDP-wrapped module's parameters.
        granularity: ``"layer"`` (one unit per parameter) or ``"bucket"`` (one per bucket).
        warmup_steps: steps averaged densely, as DDP would, before compression starts.
        min_compress_numel: parameters with fewer elements are averaged densely.
        dense_names: names of further parameters averaged densely (e.g. the logits layer).
        seed: base seed of the compressor's generator; rank ``r`` uses ``seed * 65537 + r``.
        group: the process group (default: the world).
        history: how many :class:`StepStats` to keep.
    """

    def __init__(
        self,
        compressor: Compressor,
        memory: Memory,
        aggregator: "str | Aggregator",
        param_names: dict[int, str],
        granularity: str = "layer",
        warmup_steps: int = 1,
        min_compress_numel: int = 1024,
        dense_names: frozenset[str] = frozenset(),
        seed: int = 0,
        group: dist.ProcessGroup | None = None,
        history: int = 10_000,
    ) -> None:
        if granularity not in GRANULARITIES:
            raise ValueError(f"granularity must be one of {list(GRANULARITIES)}, got {granularity!r}")
        if isinstance(aggregator, str):
            if aggregator not in AGGREGATORS:
                raise ValueError(f"aggregator must be one of {sorted(AGGREGATORS)}, got {aggregator!r}")
            aggregator = AGGREGATORS[aggregator]()
        self.compressor = compressor
        self.memory = memory
        self.aggregator = aggregator
        self.param_names = param_names
        self.granularity = granularity
        self.warmup_steps = warmup_steps
        self.min_compress_numel = min_compress_numel
        self.dense_names = dense_names
        self.seed = seed
        self.counter = CommCounter()
        self.collectives = Collectives(group, self.counter)
        self.world_size = self.collectives.world_size
        self.rank = self.collectives.rank
        self.step = 0
        self.calls = 0
        self.history: deque[StepStats] = deque(maxlen=history)
        self._dense = IdentityCompressor()
        # identity compressor, no memory: DDP's own in-place scaled allreduce of the bucket, no copies
        self._dense_only = isinstance(compressor, IdentityCompressor) and isinstance(memory, NoMemory)
        self._plans: dict[tuple[int, ...], _BucketPlan] = {}
        self._generators: dict[torch.device, torch.Generator] = {}
        self._current: StepStats | None = None
        self.track_layers = False
        self._capture: frozenset[str] = frozenset()

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

    @property
    def compressing(self) -> bool:
        """Whether the warm-up is over."""
        return self.step >= self.warmup_steps

    def generator(self, device: torch.device) -> torch.Generator:
        """This rank's generator on ``device``, seeded ``seed * 65537 + rank``: reproducible, distinct per rank."""
        if device not in self._generators:
            self._generators[device] = torch.Generator(device=device).manual_seed(self.seed * 65537 + self.rank)
        return self._generators[device]

    def state_dict(self) -> dict:
        """What must survive a restart besides the memory: the step counter and the generators' states."""
        return {
            "step": self.step,
            "generators": {str(device): gen.get_state() for device, gen in self._generators.items()},
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`'s output (generators are recreated on their devices)."""
        self.step = int(state["step"])
        self._generators = {}
        for device, gen_state in state["generators"].items():
            self.generator(torch.device(device)).set_state(gen_state)

    def __call__(self, bucket: dist.GradBucket) -> torch.futures.Future[Tensor]:
        """Average ``bucket`` across ranks (compressed after the warm-up): a future of the bucket's buffer.

        Compressed buckets complete inside the call; dense ones (warm-up, identity baseline) return
        the allreduce's future, so they overlap the rest of the backward pass as under plain DDP.
        """
        buffer = bucket.buffer()
        if self._current is None:
            self.counter.reset()
            self._current = StepStats(step=self.step, compressed=self.compressing)
        stats = self._current
        stats.buckets += 1
        stats.numel += buffer.numel()
        stats.dense_bytes += buffer.numel() * buffer.element_size()
        self.calls += 1

        if stats.compressed and not self._dense_only:
            self._compress_bucket(bucket, stats)
            future: torch.futures.Future[Tensor] = torch.futures.Future()
            future.set_result(buffer)
        else:
            # DDP's own path: scaled in place, reduced while the backward pass goes on
            future = self.collectives.all_reduce_async(buffer.mul_(1.0 / self.world_size))

        if bucket.is_last():
            self._finish_step(stats)
        return future

    def _compress_bucket(self, bucket: dist.GradBucket, stats: StepStats) -> None:
        params = bucket.parameters()
        grads = [g.reshape(-1) for g in bucket.gradients()]
        plan = self._plan(params)

        start = time.perf_counter()
        inputs: list[list[Tensor]] = []
        tensors: list[Tensor] = []
        for unit in plan.units:
            if unit.compressed:
                parts = [self.memory.compensate(n, grads[p]) for n, p in zip(unit.names, unit.positions, strict=True)]
            else:
                parts = [grads[p] for p in unit.positions]
            inputs.append(parts)
            tensors.append(parts[0].view(unit.shape) if len(parts) == 1 else torch.cat(parts))
        scales = self._shared_scales(plan, tensors)
        contributions = []
        for unit, x in zip(plan.units, tensors, strict=True):
            if unit.compressed:
                payload = self.compressor.compress(x, self.generator(x.device), scales.pop(0) if scales else None)
                contributions.append(Contribution(self.compressor, payload))
                selected = payload.k if isinstance(payload, SparsePayload) else None
                stats.numel_compressed += x.numel()
                stats.payload_bytes += payload.nbytes
                stats.selected += selected or 0
                if self.track_layers:
                    stats.layers["+".join(unit.names)] = LayerStats(x.numel(), payload.nbytes, selected)
            else:
                contributions.append(Contribution(self._dense, self._dense.compress(x)))
        compressed_at = time.perf_counter()
        comm_before = self.counter.seconds

        aggregates = self.aggregator.aggregate(contributions, self.collectives)

        for unit, parts, contribution, agg in zip(plan.units, inputs, contributions, aggregates, strict=True):
            means = agg.mean.split(unit.numels)
            if unit.compressed:
                sents = agg.sent.split(unit.numels)
                outputs = [self.memory.reconstruct(n, m) for n, m in zip(unit.names, means, strict=True)]
                # Every rank holds the same mean, so all skip (or not) alike: a NaN/Inf step reaches the
                # optimizer as under plain DDP (GradScaler skips it) but never enters the memory.
                if bool(torch.isfinite(agg.mean).all()):
                    for name, part, sent, mean in zip(unit.names, parts, sents, means, strict=True):
                        self.memory.update(name, part, sent, mean)
                else:
                    stats.nonfinite_units += 1
                if self._capture.intersection(unit.names):
                    self._record_capture(stats, unit, parts, grads, contribution, sents)
                means = outputs
            for position, mean in zip(unit.positions, means, strict=True):
                grads[position].copy_(mean)
        done = time.perf_counter()
        communicate = self.counter.seconds - comm_before
        stats.seconds_compress += compressed_at - start
        stats.seconds_communicate += communicate
        stats.seconds_decompress += done - compressed_at - communicate

    def _record_capture(
        self,
        stats: StepStats,
        unit: _Unit,
        parts: list[Tensor],
        grads: list[Tensor],
        contribution: Contribution,
        sents: "tuple[Tensor, ...]",
    ) -> None:
        compressed = self.compressor.decompress(contribution.payload).split(unit.numels)
        for name, position, part, local, sent in zip(unit.names, unit.positions, parts, compressed, sents, strict=True):
            if name in self._capture:
                stats.captures[name] = Capture(grads[position].clone(), part.clone(), local.clone(), sent.clone())
        self._capture = self._capture.difference(stats.captures)

    def _shared_scales(self, plan: _BucketPlan, tensors: list[Tensor]) -> list[Tensor]:
        """The MAX over ranks of each compressed unit's local scale: one small collective per bucket."""
        if not self.compressor.shares_scale:
            return []
        local = [self.compressor.local_scale(x) for unit, x in zip(plan.units, tensors, strict=True) if unit.compressed]
        if not local:
            return []
        stacked = torch.stack([scale.float() for scale in local])
        self.collectives.all_reduce_(stacked, op=dist.ReduceOp.MAX)
        return list(stacked.unbind())

    def _plan(self, params: list[Tensor]) -> _BucketPlan:
        key = tuple(id(p) for p in params)
        plan = self._plans.get(key)
        if plan is not None:
            return plan
        names = []
        for p in params:
            if id(p) not in self.param_names:
                raise RuntimeError("a bucket holds a parameter that is not in the module given to the hook")
            names.append(self.param_names[id(p)])
        flags = [
            p.numel() >= self.min_compress_numel and p.is_floating_point() and name not in self.dense_names
            for p, name in zip(params, names, strict=True)
        ]
        if self.granularity == "layer":
            # Bucket order, consecutive dense parameters merged: the concatenated units then have
            # the bucket's layout, so a dense allreduce sums every element as DDP's would.
            groups: list[tuple[list[int], bool]] = []
            for i, flag in enumerate(flags):
                if not flag and groups and not groups[-1][1]:
                    groups[-1][0].append(i)
                else:
                    groups.append(([i], flag))
        else:
            groups = [([i for i, f in enumerate(flags) if f], True), ([i for i, f in enumerate(flags) if not f], False)]
        plan = _BucketPlan()
        for positions, flag in groups:
            if positions:
                plan.units.append(
                    _Unit(
                        positions=tuple(positions),
                        names=tuple(names[i] for i in positions),
                        numels=tuple(params[i].numel() for i in positions),
                        compressed=flag,
                        shape=params[positions[0]].shape
                        if len(positions) == 1
                        else torch.Size([sum(params[i].numel() for i in positions)]),
                    )
                )
        self._plans[key] = plan
        return plan

    def _finish_step(self, stats: StepStats) -> None:
        stats.bytes_sent = self.counter.bytes_sent
        stats.bytes_received = self.counter.bytes_received
        stats.collectives = self.counter.calls
        if not stats.compressed:
            stats.seconds_communicate = self.counter.seconds
        if self.history:
            self.history[-1].captures.clear()
        self.history.append(stats)
        self._current = None
        self.step += 1


def gradcomp_comm_hook(state: GradCompHook, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: compress, aggregate and average ``bucket`` with ``state``."""
    return state(bucket)
