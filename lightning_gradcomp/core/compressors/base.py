"""The compressor contract: pure tensor math, no collectives, no Lightning.

A compressor turns a gradient into a :class:`Payload` and back. Payloads serialise to one uint8
tensor (:meth:`Payload.to_bytes`) whose size is exactly what goes on the wire, and the compressor
parses such bytes back (:meth:`Compressor.unpack`) knowing only the tensor's shape and dtype,
which every rank knows for every layer.

Two optional capabilities serve the allreduce aggregator:

* a *summable* form (:meth:`Compressor.summable` / :meth:`Compressor.from_sum`): a tensor whose
  elementwise sum over ranks decodes to the average (ternary codes summed as integers);
* a *shared scale* (:attr:`Compressor.shares_scale`, :meth:`Compressor.local_scale`): every rank
  compresses with the MAX over ranks of a per-tensor scale, agreed on in one small collective.

A summable form may take several rounds (:meth:`Compressor.next_summable`): PowerSGD sums
``P = MQ`` first and ``Q = M^T P`` after, the second computed from the first's sum. Such a
compressor is not :attr:`~Compressor.gatherable`. A compressor may also carry a *warm start* per
unit from one step to the next (:meth:`Compressor.initial_state`; PowerSGD's ``Q``): the hook keeps
it, the same on every rank, and checkpoints it.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import ClassVar, Protocol

import torch
from torch import Tensor

from lightning_gradcomp.core.compressors.draws import Draws
from lightning_gradcomp.core.workspace import Scratch

#: Elements a codec handles at a time when it streams over a tensor (packing, decoding, comparing): its
#: temporaries (a few MiB) stay in cache, and nothing of the model's size is allocated per call, whose
#: page faults cost more than the arithmetic on a large model. A power of two: every chunk but the last fills
#: whole words of packed codes (16 ternary codes, 32 signs a word).
STREAM_CHUNK = 1 << 20
#: Elements per chunk on an accelerator, where every chunk costs a kernel launch per operation (about as long as
#: streaming a million elements) and a temporary costs no page faults: 64 MiB of fp32 at most, a few chunks for
#: the largest bucket. A power of two, as :data:`STREAM_CHUNK`.
DEVICE_CHUNK = 1 << 24


def chunk_for(device: torch.device, chunk: int) -> int:
    """Elements a codec streams at a time on ``device``: ``chunk`` (cache-sized) on the CPU, at least
    :data:`DEVICE_CHUNK` elsewhere, so that a GPU runs a few large kernels instead of a storm of small ones."""
    return chunk if device.type == "cpu" else max(chunk, DEVICE_CHUNK)


def all_finite(x: Tensor) -> bool:
    """Whether every entry of ``x`` is finite, from one sum (a reduction: no mask is allocated).

    A NaN or an infinity anywhere makes the sum non-finite. Half-precision tensors are summed in
    float32 so that finite values cannot overflow it; a float32 or float64 sum overflows only for
    entries near the type's limit, and then reads as non-finite, which only makes the caller
    skip a memory update.
    """
    if not x.numel():
        return True
    total = x.sum(dtype=torch.float32) if x.element_size() < 4 else x.sum()
    return math.isfinite(float(total))


class Entries(Protocol):
    """Part of this rank's payload, decoded only where it is added: what memory takes from its own payload.

    Sparse payloads give their entries (:class:`~lightning_gradcomp.core.compressors.SparseEntries`),
    ternary payloads their codes with the block scales; either is added into a state tensor in one
    pass, with no dense decoded copy.
    """

    numel: int

    def to_dense(self) -> Tensor:
        """The dense flat tensor (for inspection)."""

    def add_to_(self, out: Tensor, alpha: float = 1.0) -> Tensor:
        """``out += alpha * self`` in place (flat ``out`` of ``numel`` elements); returns ``out``."""

    def subtract_from(self, compensated: Tensor, out: Tensor) -> Tensor:
        """``out = compensated - self`` (flat, ``numel`` elements): error feedback's residual, in as few passes as
        the form allows (:func:`subtract_by_adding` where it has no single pass of its own); returns ``out``."""

    def all_finite(self) -> bool | Tensor:
        """Whether every decoded element is finite: a bool, or where reading it back would make the host wait a 0-dim
        bool tensor on the device (:mod:`~lightning_gradcomp.core.compressors.finiteness`)."""

    def split(self, numels: Sequence[int]) -> list[Entries]:
        """The consecutive slices of ``numels`` elements (one per parameter of a unit)."""

    @property
    def vouches_finite(self) -> bool:
        """Whether :meth:`all_finite` also tells that the whole tensor compressed was finite (its scale summed every
        element), so that error feedback need not read that tensor again to know it."""


def subtract_by_adding(entries: Entries, compensated: Tensor, out: Tensor) -> Tensor:
    """``out = compensated - entries`` as a copy and :meth:`Entries.add_to_` with ``alpha = -1``: two passes, the
    second over ``k`` entries only for a sparse form."""
    return entries.add_to_(out.copy_(compensated), alpha=-1)


class Payload(ABC):
    """What one rank sends for one tensor of ``shape``."""

    shape: torch.Size
    dtype: torch.dtype
    device: torch.device

    @property
    def numel(self) -> int:
        """Elements of the tensor the payload stands for."""
        return self.shape.numel()

    @abstractmethod
    def to_bytes(self) -> Tensor:
        """The wire form: a 1-D uint8 tensor, exactly ``nbytes`` long."""

    @property
    @abstractmethod
    def nbytes(self) -> int:
        """Exact size of the wire form in bytes."""

    def entries(self) -> Entries | None:
        """The payload as :class:`Entries` when it can be added into a tensor without decoding it whole
        (sparse and ternary payloads), else ``None``."""
        return None

    @property
    def selected(self) -> int | None:
        """Entries carried, for a sparse payload (``None`` otherwise)."""
        return None

    def cast(self, dtype: torch.dtype) -> Payload:
        """The same payload with its float values in ``dtype`` (a wire precision, or back to the gradient's).

        Only payloads of compressors with :attr:`Compressor.float_wire` that are gathered implement it.
        """
        raise TypeError(f"{type(self).__name__} has no float values to cast")

    def wire_nbytes(self, float_itemsize: int) -> int:
        """The size of the wire form with every float value taking ``float_itemsize`` bytes."""
        raise TypeError(f"{type(self).__name__} has no float values to send in another precision")


class Compressor(ABC):
    """Compresses gradients; subclasses validate their hyper-parameters in ``__init__``.

    Attributes:
        name: the registry name (``compressor="topk"``).
        unbiased: whether ``E[decompress(compress(x))] == x`` for every ``x`` (TernGrad with clipping is
            unbiased only for the clipped gradient, so it reports False).
        sparse: whether payloads are :class:`~lightning_gradcomp.core.compressors.SparsePayload`,
            which sparse aggregators (gTop-k) can merge.
        needs_layer_shape: whether the compressor works on each parameter's own shape (matrices),
            so a flat unit (``granularity="model"`` or ``"group"``) would defeat it.
        takes_shapes: whether :meth:`compress` takes ``shapes=``, the shapes of the parameters whose
            gradients a flat unit concatenates, and compresses each as its own tensor (PowerSGD: one
            matrix each, the unit's matrices summed together, so a group costs one collective per round).
        takes_segments: whether :meth:`compress` takes a unit of several parameters as
            :class:`~lightning_gradcomp.core.compressors.segments.Segments` (their gradients where DDP's buckets hold
            them) and sums into such pieces, so the unit needs no flat copy and its average no flat buffer.
        gatherable: whether one payload's bytes, gathered from every rank, decode to the average
            (what the allgather and gTop-k aggregators need); PowerSGD's second message depends on
            the sum of the first, so it is all-reduced only.
        warm_started: whether :meth:`compress` takes a ``warm_start=`` tensor, the unit's state
            from :meth:`initial_state` as the last step left it.
        takes_scratch: whether :meth:`compress` takes ``scratch=``, the unit's kept buffers
            (:mod:`lightning_gradcomp.core.workspace`), to write its codes into: a payload of one code per
            element then costs no fresh model-sized allocation per step (nor its page faults).
        float_wire: whether what it sends is float values (and integers such as indices) that a
            half-precision wire can carry (:class:`~lightning_gradcomp.core.compressors.WirePrecision`):
            its payloads implement :meth:`Payload.cast` and :meth:`Payload.wire_nbytes`, or it is
            all-reduced in rounds only.
        keeps_largest: whether it sends the ``k`` entries of largest magnitude unchanged (the Top-k family), so that
            ``||x - C(x)||^2 <= (1 - k/d) ||x||^2`` holds for every ``x``; a random selection (random-k) or quantised
            values do not keep that bound.
    """

    name: ClassVar[str]
    unbiased: ClassVar[bool]
    sparse: ClassVar[bool] = False
    needs_layer_shape: ClassVar[bool] = False
    takes_shapes: ClassVar[bool] = False
    takes_segments: ClassVar[bool] = False
    gatherable: ClassVar[bool] = True
    warm_started: ClassVar[bool] = False
    takes_scratch: ClassVar[bool] = False
    float_wire: ClassVar[bool] = False
    keeps_largest: ClassVar[bool] = False

    @abstractmethod
    def compress(self, x: Tensor, generator: Draws = None, scale: Tensor | None = None) -> Payload:
        """Compress ``x`` (a parameter's gradient in its own shape, or a flat vector).

        ``generator`` drives any randomness (the unit's own stream at this step, on this rank);
        ``scale`` is the shared scale when :attr:`shares_scale` is set, else ``None``. A compressor
        that shares a scale also accepts ``local_scale=``, its own :meth:`local_scale` of ``x``,
        which the caller computed already to agree on ``scale`` (so it need not compute it again).
        """

    @abstractmethod
    def unpack(self, buffer: Tensor, shape: torch.Size, dtype: torch.dtype) -> Payload:
        """Parse the bytes another rank sent for a tensor of ``shape`` and ``dtype``."""

    @abstractmethod
    def accumulate(self, payload: Payload, out: Tensor) -> Tensor:
        """Add the decompressed payload into the flat tensor ``out`` in place and return it."""

    def accumulate_all(self, payloads: Sequence[Payload], out: Tensor) -> Tensor:
        """Add every rank's payload (in rank order) into ``out``: how the allgather aggregator decodes.

        Default: one :meth:`accumulate` per payload. A compressor may sum in a cheaper domain
        (TernGrad adds integer codes under a shared scaler and multiplies once).
        """
        for payload in payloads:
            self.accumulate(payload, out)
        return out

    def average_all(self, payloads: Sequence[Payload], out: Tensor, world: int) -> Tensor:
        """The mean of every rank's decoded payload (in rank order), written over the flat ``out`` (its contents are
        not read): how the allgather aggregator averages. Default: ``out`` zeroed, :meth:`accumulate_all`, divided
        by ``world``; a compressor may fuse the three into one pass (QSGD's levels, scaled signs)."""
        return self.accumulate_all(payloads, out.zero_()).div_(world)

    def payload_nbytes(self, shape: torch.Size, dtype: torch.dtype) -> int | None:
        """Wire size of any payload for this input, when it depends on nothing else; else ``None``.

        A fixed size lets the allgather skip the exchange of sizes (one collective fewer).
        """
        return None

    def decompress(self, payload: Payload) -> Tensor:
        """The dense flat tensor the payload stands for."""
        return self.accumulate(payload, torch.zeros(payload.numel, dtype=payload.dtype, device=payload.device))

    @property
    def selects_entries(self) -> bool:
        """Whether its payloads carry chosen entries (indices and values, :class:`~lightning_gradcomp.core.compressors.
        SparseEntries`), so that the mean over the ranks that chose each index is defined
        (``aggregator="allgather_choosers"``). Default: :attr:`sparse`."""
        return self.sparse

    def preferred_aggregator(self, world_size: int) -> str:
        """The aggregator ``aggregator="auto"`` picks for ``world_size`` ranks: the one moving fewer bytes.

        Default: ``"allgather"`` for sparse payloads, ``"allreduce"`` otherwise.
        """
        return "allgather" if self.sparse else "allreduce"

    @property
    def bias_reason(self) -> str | None:
        """Why ``E[decompress(compress(x))] != x``, for error messages (``None`` when :attr:`unbiased`)."""
        return None if self.unbiased else "it is biased"

    @property
    def shares_scale(self) -> bool:
        """Whether :meth:`compress` wants the MAX over ranks of :meth:`local_scale` as ``scale``."""
        return False

    def local_scale(self, x: Tensor) -> Tensor:
        """This rank's scale for ``x`` (a 0-dim float32 tensor); only called when :attr:`shares_scale`."""
        raise NotImplementedError(f"{type(self).__name__} does not share a scale")

    @property
    def summable_across_ranks(self) -> bool:
        """Whether :meth:`summable` works as configured (the allreduce aggregator relies on it)."""
        return True

    def summable(self, payload: Payload, world_size: int, scratch: Scratch | None = None) -> Tensor:
        """A flat tensor whose sum over ranks :meth:`from_sum` turns into the average.

        The aggregator reduces it in place, so it must be a tensor of its own, never storage the
        payload keeps (what reached the average is read off the payload afterwards). ``scratch``,
        when given, hands out buffers kept from step to step (:mod:`lightning_gradcomp.core.workspace`):
        the summand is written there instead of into a fresh allocation; its ``"mean"`` buffer is
        also the ``out`` of :meth:`from_sum`. Default: the dense decompressed tensor pre-scaled by
        ``1/P``, as DDP's reducer does.
        """
        dense = self.decompress(payload)
        if scratch is None:
            return dense * (1.0 / world_size)
        return torch.mul(dense, 1.0 / world_size, out=scratch("mean", dense.numel(), dense.dtype, dense.device))

    def next_summable(self, payload: Payload, total: Tensor, world_size: int) -> Tensor | None:
        """After a round's ``total`` (the sum over ranks of what this payload last handed over): the
        next round's summand, or ``None`` when ``total`` is the last and goes to :meth:`from_sum`.

        Whether there is a next round may depend on the payload's shape only, never on its values,
        so that every rank runs the same rounds. Default: one round.
        """
        return None

    def from_sum(self, total: Tensor, payload: Payload, world_size: int, out: Tensor | None = None) -> Tensor:
        """The average over ranks (flat, in the payload's dtype) from the summed :meth:`summable`, written into
        ``out`` (a kept buffer of that size and dtype) when one is given and the average is not ``total`` itself."""
        return total

    def initial_state(
        self, shapes: tuple[torch.Size, ...], dtype: torch.dtype, device: torch.device, generator: torch.Generator
    ) -> Tensor | None:
        """A unit's warm start before its first compressed step (only called when :attr:`warm_started`).

        ``shapes`` are the shapes of the unit's parameters (one for a unit of one parameter).
        ``generator`` is seeded alike on every rank (from the seed and the unit alone), so that every
        rank starts from the same state. ``None``: this unit needs none.
        """
        return None

    def __repr__(self) -> str:
        params = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if not k.startswith("_"))
        return f"{type(self).__name__}({params})"
