"""Compression units: which parameters are compressed together, decided by the parameters alone.

DDP delivers gradients in buckets, but a bucket is a delivery, not a unit. DDP's first iteration
uses one layout (in torch 2.13 a single bucket of every parameter), rebuilds its buckets in
gradient-ready order after it, and every fresh DDP, including the one a resumed run builds,
starts again from the first layout. Anything tied to buckets (what is compressed together,
which random draws land where, DIANA's ``omega``, the order of float sums in an allreduce)
would therefore differ between a run and its resumption. Units are planned once from the
module's parameters, so none of that changes:

* ``granularity="layer"``: each compressed parameter is a unit of its own, in its own shape;
* ``granularity="model"``: all compressed parameters form one flat unit, as the gTop-k and
  Gaussian_k authors flatten the whole model (Shi et al., ICDCS 2019, Sec. IV);
* ``granularity="group"``: flat units of at most ``unit_cap_mb``, filled in reverse registration
  order (roughly the order in which backward produces gradients), so that early units can be
  exchanged while the backward pass goes on.

Parameters left dense (small ones, the patterns a user keeps dense) are grouped the same
size-capped way into dense units, averaged exactly. :class:`UnitAssembler` collects the
gradients DDP's buckets deliver and releases each unit once all of its parameters have arrived,
and each bucket once all units touching it are done: the hook may hold a bucket's future open
until then (DDP waits for every bucket's future only at the end of the backward pass).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from lightning_gradcomp.core.validation import check_choice

GRANULARITIES = ("layer", "model", "group")

#: Default cap of a ``"group"`` unit and of a dense unit, as DDP's default ``bucket_cap_mb``.
DEFAULT_UNIT_CAP_MB = 25.0


def unit_key(names: Sequence[str]) -> int:
    """A 63-bit identity of a unit from its parameter names: stable across processes and restarts.

    (Python's ``hash`` of a string is salted per process, so it cannot seed anything reproducible.)
    """
    digest = hashlib.blake2b("\0".join(names).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


@dataclass(frozen=True)
class Unit:
    """Parameters compressed (or averaged densely) together, in a fixed order.

    ``shape`` is the parameter's own shape for a one-parameter compressed unit, else the flat
    length; ``shapes`` are the parameters' own shapes, for compressors that compress a flat unit
    parameter by parameter (PowerSGD's matrices). ``key`` identifies the unit (seeds its randomness).
    """

    index: int
    names: tuple[str, ...]
    numels: tuple[int, ...]
    shape: torch.Size
    compressed: bool
    key: int
    shapes: tuple[torch.Size, ...]

    @property
    def numel(self) -> int:
        """Elements of the unit as it is compressed."""
        return sum(self.numels)

    @property
    def label(self) -> str:
        """The names joined with ``+``: how statistics name the unit."""
        return "+".join(self.names)


def refuse_sparse_gradients(module: torch.nn.Module) -> None:
    """Raise ``ValueError`` naming the first trainable parameter that gets sparse gradients (an ``nn.Embedding`` or
    ``nn.EmbeddingBag`` built with ``sparse=True``): DDP hands a communication hook dense buckets only (it reduces
    sparse gradients apart), so no unit can hold it."""
    for path, sub in module.named_modules():
        if isinstance(sub, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and sub.sparse and sub.weight.requires_grad:
            name = f"{path}.weight" if path else "weight"
            raise ValueError(
                f"parameter {name!r} gets sparse gradients ({type(sub).__name__}(sparse=True)); a DDP communication "
                "hook exchanges dense buckets only, so it cannot be compressed: build it with sparse=False (its "
                "gradient is then dense and compressed like any other), or freeze it"
            )


def is_compressed(name: str, param: Tensor, min_compress_numel: int, dense_names: frozenset[str]) -> bool:
    """Whether parameter ``name`` is compressed: floating point, large enough, and not kept dense."""
    return param.is_floating_point() and param.numel() >= min_compress_numel and name not in dense_names


def _capped_groups(params: Sequence[tuple[str, Tensor]], cap_bytes: int) -> list[list[tuple[str, Tensor]]]:
    """Consecutive runs of ``params`` of at most ``cap_bytes`` each (a larger parameter stands alone)."""
    groups: list[list[tuple[str, Tensor]]] = []
    size = 0
    for name, p in params:
        nbytes = p.numel() * p.element_size()
        if not groups or size + nbytes > cap_bytes:
            groups.append([])
            size = 0
        groups[-1].append((name, p))
        size += nbytes
    return groups


def plan_units(
    named_parameters: Sequence[tuple[str, Tensor]],
    granularity: str,
    min_compress_numel: int,
    dense_names: frozenset[str] = frozenset(),
    unit_cap_mb: float = DEFAULT_UNIT_CAP_MB,
) -> tuple[Unit, ...]:
    """The units of ``named_parameters`` (those that require gradients, as DDP buckets them).

    Compressed units come first, then dense ones; each lists its parameters in reverse
    registration order.
    """
    check_choice("granularity", granularity, GRANULARITIES)
    trained = [(n, p) for n, p in named_parameters if p.requires_grad][::-1]
    compressed = [(n, p) for n, p in trained if is_compressed(n, p, min_compress_numel, dense_names)]
    dense = [(n, p) for n, p in trained if not is_compressed(n, p, min_compress_numel, dense_names)]
    cap_bytes = int(unit_cap_mb * 1024 * 1024)
    if granularity == "layer":
        compressed_groups = [[item] for item in compressed]
    elif granularity == "model":
        compressed_groups = [compressed] if compressed else []
    else:
        compressed_groups = _capped_groups(compressed, cap_bytes)
    units = []
    for flag, groups in ((True, compressed_groups), (False, _capped_groups(dense, cap_bytes))):
        for group in groups:
            names = tuple(n for n, _ in group)
            numels = tuple(p.numel() for _, p in group)
            shape = group[0][1].shape if flag and granularity == "layer" else torch.Size([sum(numels)])
            shapes = tuple(p.shape for _, p in group)
            units.append(Unit(len(units), names, numels, shape, flag, unit_key(names), shapes))
    return tuple(units)


@dataclass
class _Delivery:
    """A bucket handed over by DDP: its future completes once every unit it touches is done."""

    future: torch.futures.Future[Tensor]
    buffer: Tensor
    waiting_for: set[int] = field(default_factory=set)


class UnitAssembler:
    """Collects the gradients of DDP's buckets and releases complete units, then finished buckets.

    Per step: :meth:`deliver` each bucket (in DDP's order), process the units it returns, call
    :meth:`done` with them and complete the buckets it returns. After the last bucket every
    unit has been released and every bucket finished, whatever the bucket layout was.
    """

    def __init__(self, units: Sequence[Unit]) -> None:
        self.units = tuple(units)
        self._unit_of = {name: unit.index for unit in self.units for name in unit.names}
        self._grads: dict[str, Tensor] = {}
        self._missing = [len(unit.names) for unit in self.units]
        self._deliveries: list[_Delivery] = []

    def deliver(
        self, names: Sequence[str], grads: Sequence[Tensor], future: torch.futures.Future[Tensor], buffer: Tensor
    ) -> list[tuple[Unit, list[Tensor]]]:
        """Take one bucket's gradients (flat views); return the units now complete, in plan order."""
        delivery = _Delivery(future, buffer)
        ready = []
        for name, grad in zip(names, grads, strict=True):
            index = self._unit_of.get(name)
            if index is None:
                raise RuntimeError(f"DDP delivered a gradient for {name!r}, which is not in the hook's units")
            if name in self._grads:
                raise RuntimeError(f"DDP delivered the gradient of {name!r} twice in one step")
            self._grads[name] = grad
            delivery.waiting_for.add(index)
            self._missing[index] -= 1
            if self._missing[index] == 0:
                ready.append(index)
        self._deliveries.append(delivery)
        return [(self.units[i], [self._grads[n] for n in self.units[i].names]) for i in sorted(ready)]

    def done(self, units: Sequence[Unit]) -> list[tuple[torch.futures.Future[Tensor], Tensor]]:
        """Mark ``units`` processed; return ``(future, buffer)`` of each bucket now finished."""
        finished = {unit.index for unit in units}
        still, released = [], []
        for delivery in self._deliveries:
            delivery.waiting_for -= finished
            (still if delivery.waiting_for else released).append(delivery)
        self._deliveries = still
        return [(d.future, d.buffer) for d in released]

    def end_step(self) -> None:
        """Check that the step delivered every unit and finished every bucket, and start afresh."""
        missing = [unit.label for unit in self.units if self._missing[unit.index]]
        pending = len(self._deliveries)
        self._grads = {}
        self._missing = [len(unit.names) for unit in self.units]
        self._deliveries = []
        if missing or pending:
            raise RuntimeError(
                f"the backward pass ended with units {missing} incomplete and {pending} buckets pending; "
                "does the model have parameters that get no gradient? (pass find_unused_parameters=True)"
            )
