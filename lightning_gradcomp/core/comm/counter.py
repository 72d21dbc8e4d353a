"""Counts what this rank hands to collectives: the only source of byte figures in the project."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CommCounter:
    """Bytes this rank handed to collectives (``sent``) and got back (``received``), calls, time.

    ``sent`` is the size of the input tensors, padding included; ``received`` the size of the
    output tensors. Neither is a formula: both are read off the tensors given to torch.distributed.
    ``sent_by_dtype`` splits ``sent`` by the element type the collectives carried (``"float16"``,
    ``"uint8"`` for packed payloads, ...): what crossed the wire, not what a payload declares.
    """

    bytes_sent: int = 0
    bytes_received: int = 0
    calls: int = 0
    seconds: float = 0.0
    sent_by_dtype: dict[str, int] = field(default_factory=dict)

    def record(self, sent: int, received: int, seconds: float, dtype: str = "uint8") -> None:
        """Add one collective call that carried elements of ``dtype`` (a name: ``"float32"``, ``"uint8"``)."""
        self.bytes_sent += sent
        self.bytes_received += received
        self.calls += 1
        self.seconds += seconds
        if sent:
            self.sent_by_dtype[dtype] = self.sent_by_dtype.get(dtype, 0) + sent

    def copy(self) -> CommCounter:
        """The counts as they stand now."""
        return CommCounter(self.bytes_sent, self.bytes_received, self.calls, self.seconds, dict(self.sent_by_dtype))

    def since(self, earlier: CommCounter) -> CommCounter:
        """What was counted after ``earlier`` (a :meth:`copy` of this counter)."""
        by_dtype = {d: n - earlier.sent_by_dtype.get(d, 0) for d, n in self.sent_by_dtype.items()}
        return CommCounter(self.bytes_sent - earlier.bytes_sent, self.bytes_received - earlier.bytes_received,
                           self.calls - earlier.calls, self.seconds - earlier.seconds,
                           {d: n for d, n in by_dtype.items() if n})  # fmt: skip

    def reset(self) -> None:
        """Zero every count (the hook does this at the start of each step)."""
        self.bytes_sent = self.bytes_received = self.calls = 0
        self.seconds = 0.0
        self.sent_by_dtype = {}
