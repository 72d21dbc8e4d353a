"""Wire precision: another compressor's float values sent as float16 or bfloat16, summed where they cannot overflow.

``WirePrecision(inner, "fp16")`` halves the bytes of what ``inner`` sends as floats: dense
tensors, the values of sparse payloads (indices stay integers), PowerSGD's ``P`` and ``Q``. Nothing
else changes: ``inner`` compresses the gradient in its own precision and the result is decoded
back into it.

* All-reduced forms (dense tensors, PowerSGD's rounds) are divided by the world size before the
  sum, as PyTorch's ``fp16_compress_hook`` does, so the float16 sum on the wire is a mean and
  cannot overflow where the gradient itself does not; the sum is cast back to the gradient's
  dtype before decoding. Unlike that hook, the division comes before the cast, in the gradient's
  precision: PyTorch casts first, so a value above 65504 is infinite before it is divided, and
  values in float16's subnormal range are rounded twice.
* Gathered payloads are cast for the wire and cast back on arrival; every rank's contribution is
  then summed in the gradient's dtype.

Rounding to nearest is deterministic, so the wrapper is biased (by at most half a unit in the
last place of each value: ``2**-11`` relative for float16, ``2**-8`` for bfloat16); under error
feedback the residual keeps the rounding error, since what reached the average is the rounded
payload. bfloat16 keeps float32's range with 8 bits of mantissa; float16 has 11 bits of
mantissa and overflows above 65504.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch
from torch import Tensor

from lightning_gradcomp.core.compressors.base import STREAM_CHUNK, Compressor, Entries, Payload
from lightning_gradcomp.core.compressors.draws import Draws
from lightning_gradcomp.core.compressors.identity import DensePayload
from lightning_gradcomp.core.compressors.segments import Segments
from lightning_gradcomp.core.workspace import Scratch

#: ``wire_precision`` names and the dtypes they send.
WIRE_PRECISIONS: dict[str, torch.dtype] = {"fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass(frozen=True, eq=False)
class CastPayload(Payload):
    """``inner``'s payload, sent with its float values in ``wire`` (cast when the bytes are asked for).

    ``in_rounds``: the payload is all-reduced in rounds (PowerSGD), where the casts happen, so what
    reached the average is the inner payload itself once the rounds are done.
    """

    inner: Payload
    wire: torch.dtype
    in_rounds: bool = False

    @property
    def shape(self) -> torch.Size:  # type: ignore[override]
        return self.inner.shape

    @property
    def dtype(self) -> torch.dtype:  # type: ignore[override]
        return self.inner.dtype

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return self.inner.device

    @property
    def selected(self) -> int | None:
        return self.inner.selected

    @property
    def nbytes(self) -> int:
        return self.inner.wire_nbytes(torch.empty(0, dtype=self.wire).element_size())

    def to_bytes(self) -> Tensor:
        return self.inner.cast(self.wire).to_bytes()

    def arrived(self) -> Payload:
        """The payload as the average sees it: float values rounded to ``wire`` and back to the gradient's
        dtype, or, summed in rounds, the inner payload (the rounding happened in the rounds' sums). Cast once:
        the aggregate, the memory and the decoding each ask for it."""
        return self._arrived

    @cached_property
    def _arrived(self) -> Payload:
        return self.inner if self.in_rounds else self.inner.cast(self.wire).cast(self.inner.dtype)

    def entries(self) -> Entries | None:
        if self.inner.entries() is None:  # a dense payload: no need to cast it twice to learn that
            return None
        return self.arrived().entries()


def scaled_cast(values: Tensor | Segments, factor: float, out: Tensor) -> Tensor:
    """``values * factor`` written into ``out`` (a narrower float dtype): multiplied in ``values``' precision, then
    rounded. On CPU a multiply that stores another dtype runs at a fraction of memory speed, so it goes chunk by
    chunk through a cache-sized buffer of ``values``' dtype (the same numbers, two fast passes in cache). Pieces
    (:class:`Segments`) are each written into their place in ``out``."""
    if isinstance(values, Segments):
        target = out.reshape(-1)
        for part, start in zip(values.parts, values.starts, strict=True):
            scaled_cast(part, factor, target[start : start + part.numel()])
        return out
    flat, target = values.reshape(-1), out.reshape(-1)
    if values.device.type != "cpu" or flat.numel() <= STREAM_CHUNK:
        torch.mul(flat, factor, out=target)
        return out
    product = torch.empty(STREAM_CHUNK, dtype=values.dtype)
    for start in range(0, flat.numel(), STREAM_CHUNK):
        part = flat[start : start + STREAM_CHUNK]
        target[start : start + part.numel()].copy_(torch.mul(part, factor, out=product[: part.numel()]))
    return out


class WirePrecision(Compressor):
    """Sends ``inner``'s float values in float16 or bfloat16 (``wire_precision="fp16"`` or ``"bf16"``).

    Args:
        inner: a compressor whose payloads carry float values (:attr:`Compressor.float_wire`: the
            identity, the sparsifiers, PowerSGD).
        precision: ``"fp16"`` or ``"bf16"``.
    """

    unbiased = False
    float_wire = True

    def __init__(self, inner: Compressor, precision: str) -> None:
        if precision not in WIRE_PRECISIONS:
            raise ValueError(f"wire_precision must be one of {[None, *WIRE_PRECISIONS]}, got {precision!r}")
        if not isinstance(inner, Compressor) or not inner.float_wire or isinstance(inner, WirePrecision):
            raise ValueError(
                f"wire_precision={precision!r} sends float values in half precision, and {inner!r} sends none it can "
                "cast (its codes are integers or its factors keep float32); use it with none, topk, gaussiank, dgc, "
                "randomk or powersgd"
            )
        self.inner = inner
        self.precision = precision
        self.wire = WIRE_PRECISIONS[precision]

    # what the inner compressor is, it stays
    @property
    def name(self) -> str:  # type: ignore[override]
        return self.inner.name

    @property
    def sparse(self) -> bool:  # type: ignore[override]
        return self.inner.sparse

    @property
    def needs_layer_shape(self) -> bool:  # type: ignore[override]
        return self.inner.needs_layer_shape

    @property
    def takes_shapes(self) -> bool:  # type: ignore[override]
        return self.inner.takes_shapes

    @property
    def takes_segments(self) -> bool:  # type: ignore[override]
        return self.inner.takes_segments

    @property
    def gatherable(self) -> bool:  # type: ignore[override]
        return self.inner.gatherable

    @property
    def warm_started(self) -> bool:  # type: ignore[override]
        return self.inner.warm_started

    @property
    def takes_scratch(self) -> bool:  # type: ignore[override]
        return self.inner.takes_scratch

    @property
    def keeps_largest(self) -> bool:  # type: ignore[override]
        return self.inner.keeps_largest

    @property
    def density(self) -> float:
        return self.inner.density  # type: ignore[attr-defined]

    @density.setter
    def density(self, value: float) -> None:
        self.inner.density = value  # type: ignore[attr-defined]

    @property
    def bias_reason(self) -> str:
        reason = "" if self.inner.unbiased else f"{self.inner.bias_reason}, and "
        return f"{reason}it rounds values to {self.precision} (round to nearest)"

    def preferred_aggregator(self, world_size: int) -> str:
        return self.inner.preferred_aggregator(world_size)

    def initial_state(
        self, shapes: tuple[torch.Size, ...], dtype: torch.dtype, device: torch.device, generator: torch.Generator
    ) -> Tensor | None:
        return self.inner.initial_state(shapes, dtype, device, generator)

    def compress(self, x: Tensor, generator: Draws = None, **kwargs: Any) -> CastPayload:
        return CastPayload(self.inner.compress(x, generator, **kwargs), self.wire, not self.inner.gatherable)

    def unpack(self, buffer: Tensor, shape: torch.Size, dtype: torch.dtype) -> CastPayload:
        return CastPayload(self.inner.unpack(buffer, shape, self.wire).cast(dtype), self.wire)

    def payload_nbytes(self, shape: torch.Size, dtype: torch.dtype) -> int | None:
        return self.inner.payload_nbytes(shape, self.wire)

    @staticmethod
    def _arrived(payload: Payload) -> Payload:
        assert isinstance(payload, CastPayload)
        return payload.arrived()

    def accumulate(self, payload: Payload, out: Tensor) -> Tensor:
        return self.inner.accumulate(self._arrived(payload), out)

    def accumulate_all(self, payloads: Sequence[Payload], out: Tensor) -> Tensor:
        return self.inner.accumulate_all([self._arrived(p) for p in payloads], out)

    def average_all(self, payloads: Sequence[Payload], out: Tensor, world: int) -> Tensor:
        """The inner compressor's mean of the payloads as they arrived (a sparse one divides only where entries
        landed, while they are few)."""
        return self.inner.average_all([self._arrived(p) for p in payloads], out, world)

    def decompress(self, payload: Payload) -> Tensor:
        return self.inner.decompress(self._arrived(payload))

    def summable(self, payload: Payload, world_size: int, scratch: Scratch | None = None) -> Tensor:
        assert isinstance(payload, CastPayload)
        if scratch is not None and isinstance(payload.inner, DensePayload):
            # a dense summand is the tensor times 1/P: scaled in its own precision and rounded as it is stored,
            # in one pass into the kept wire buffer
            values = payload.inner.values
            return scaled_cast(values, 1.0 / world_size, scratch("wire", values.numel(), self.wire, values.device))
        return self._to_wire(self.inner.summable(payload.inner, world_size, scratch), scratch, "wire")

    def next_summable(self, payload: Payload, total: Tensor, world_size: int) -> Tensor | None:
        assert isinstance(payload, CastPayload)
        if isinstance(payload.inner, DensePayload):  # a dense sum is done in one round: nothing to cast back here
            return None
        following = self.inner.next_summable(payload.inner, self._from_wire(total, payload), world_size)
        return None if following is None else self._to_wire(following)

    def from_sum(self, total: Tensor, payload: Payload, world_size: int, out: Tensor | None = None) -> Tensor:
        assert isinstance(payload, CastPayload)
        if out is not None and isinstance(payload.inner, DensePayload) and total.is_floating_point():
            # a dense sum is the mean itself: cast straight into the kept buffer, no allocation
            return self.inner.from_sum(out.copy_(total), payload.inner, world_size, out=out)
        return self.inner.from_sum(self._from_wire(total, payload), payload.inner, world_size, out=out)

    def _to_wire(self, summand: Tensor, scratch: Scratch | None = None, role: str = "") -> Tensor:
        # the inner summand is already divided by the world size: a mean's share, which cannot overflow
        if not summand.is_floating_point():
            return summand
        if scratch is None:
            return summand.to(self.wire)
        return scratch(role, summand.numel(), self.wire, summand.device).copy_(summand)

    @staticmethod
    def _from_wire(total: Tensor, payload: CastPayload) -> Tensor:
        return total.to(payload.inner.dtype) if total.is_floating_point() else total

    def __repr__(self) -> str:
        return f"WirePrecision({self.inner!r}, {self.precision!r})"
