"""What one exchange cost on this rank (:class:`StepStats`), the record every front end keeps per step and the
callbacks read: bytes handed to collectives, counted by the comm layer, against what plain DDP would send."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from torch import Tensor

from lightning_gradcomp.core.comm.counter import CommCounter
from lightning_gradcomp.core.schedule import Regime

__all__ = ["Capture", "LayerStats", "StepStats", "bytes_per_compressed_step"]


@dataclass
class StepStats:
    """What one optimizer step's gradient exchange cost on this rank.

    ``regime``: what the schedule made of the step (``"warmup"``: one of the dense first steps;
    ``"critical"`` / ``"relaxed"``: an adaptive schedule's regimes; ``"steady"`` otherwise).
    ``compressed``: the step's gradients went through the compression pipeline (memory, compressor,
    aggregator); a step that is not compressed was averaged densely, as DDP does (a warm-up step, a
    critical step of a schedule that averages those densely, or any step of the dense baseline:
    identity compressor, no memory). ``planned_density``: the density the schedule set for the step
    (``None`` when it set none; :attr:`density` is what was actually sent).
    ``dense_bytes`` is what plain DDP hands to allreduce for the same buckets; ``bytes_sent`` what
    this hook handed to collectives (padding and size exchanges included), so
    ``compression_ratio = dense_bytes / bytes_sent`` is measured, not computed from a formula;
    ``bytes_sent_by_dtype`` splits it by the element type the collectives carried.
    Under ``hierarchy="node"`` the dense sums and shares inside the node are counted apart, in
    ``bytes_sent_intra_node`` / ``bytes_received_intra_node``: ``bytes_sent`` is then what this rank
    handed to collectives between nodes.
    ``nonfinite_units`` counts units whose average held NaN/Inf: their memory was left as it was
    (counted under a memory with state only: ``memory="none"`` has nothing to protect, and its
    average reaches the optimizer as it is, as under plain DDP). Off the CPU it is a 0-dim int64
    tensor on the device, counted there without making the host wait (``int()`` reads it).
    ``synchronised``: a DiLoCo inner step that ended with a synchronisation (the others send nothing; their
    ``dense_bytes`` is still what DDP would have sent, so a window's ratio is the saving per inner step).
    ``selected`` counts the entries of sparse payloads. ``layers`` (with ``track_layers``) and
    ``captures`` (after :meth:`GradCompHook.request_capture`) are filled for the diagnostics.
    """

    step: int
    compressed: bool = False
    synchronised: bool = False
    regime: Regime = "steady"
    planned_density: float | None = None
    buckets: int = 0
    numel: int = 0
    numel_compressed: int = 0
    payload_bytes: int = 0
    dense_bytes: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    bytes_sent_intra_node: int = 0
    bytes_received_intra_node: int = 0
    bytes_sent_by_dtype: dict[str, int] = field(default_factory=dict)
    collectives: int = 0
    seconds_compress: float = 0.0
    seconds_communicate: float = 0.0
    seconds_decompress: float = 0.0
    nonfinite_units: int | Tensor = 0
    selected: int = 0
    layers: dict[str, LayerStats] = field(default_factory=dict)
    captures: dict[str, Capture] = field(default_factory=dict)

    def take_counts(self, counter: CommCounter) -> None:
        """The step's collectives as ``counter`` counted them: bytes sent and received, calls, bytes by dtype."""
        self.bytes_sent, self.bytes_received = counter.bytes_sent, counter.bytes_received
        self.collectives, self.bytes_sent_by_dtype = counter.calls, dict(counter.sent_by_dtype)

    def add(self, part: StepStats) -> None:
        """Add ``part``'s counts and times (one unit's exchange of this step) to this record."""
        for key in _SUMMED:
            setattr(self, key, getattr(self, key) + getattr(part, key))
        for dtype, sent in part.bytes_sent_by_dtype.items():
            self.bytes_sent_by_dtype[dtype] = self.bytes_sent_by_dtype.get(dtype, 0) + sent

    @property
    def warmup(self) -> bool:
        """Whether the step was one of the dense warm-up steps (averaged as DDP does)."""
        return self.regime == "warmup"

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


#: The counts and times of a :class:`StepStats` that its parts add up to.
_SUMMED = ("numel", "dense_bytes", "numel_compressed", "payload_bytes", "selected", "bytes_sent",
           "bytes_received", "collectives", "nonfinite_units", "seconds_compress", "seconds_communicate",
           "seconds_decompress")  # fmt: skip


def bytes_per_compressed_step(history: Iterable[StepStats]) -> tuple[float, float] | None:
    """Mean ``(bytes_sent, dense_bytes)`` over the compressed steps of a DDP hook's ``history`` (dense steps, of the
    warm-up or of the dense baseline, left out); ``None`` when no step was compressed. (DiLoCo's whole-run figures
    per inner step are :meth:`~lightning_gradcomp.diloco.OuterSync.totals`.)"""
    compressed = [s for s in history if s.compressed]
    if not compressed:
        return None
    sent = sum(s.bytes_sent for s in compressed)
    dense = sum(s.dense_bytes for s in compressed)
    return sent / len(compressed), dense / len(compressed)


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
