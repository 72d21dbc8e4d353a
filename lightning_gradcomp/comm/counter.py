"""Counts what this rank hands to collectives: the only source of byte figures in the project."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class CommCounter:
    """Bytes this rank handed to collectives (``sent``) and got back (``received``), calls, time.

    ``sent`` is the size of the input tensors, padding included; ``received`` the size of the
    output tensors. Neither is a formula: both are read off the tensors given to torch.distributed.
    """

    bytes_sent: int = 0
    bytes_received: int = 0
    calls: int = 0
    seconds: float = 0.0

    def record(self, sent: int, received: int, seconds: float) -> None:
        """Add one collective call."""
        self.bytes_sent += sent
        self.bytes_received += received
        self.calls += 1
        self.seconds += seconds

    def reset(self) -> None:
        """Zero every count (the hook does this at the start of each step)."""
        self.bytes_sent = self.bytes_received = self.calls = 0
        self.seconds = 0.0
