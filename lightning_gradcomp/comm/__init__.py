"""Moving payloads between ranks, counting every byte handed to a collective."""

from lightning_gradcomp.comm.aggregators import (
    AGGREGATORS,
    Aggregate,
    Aggregator,
    AllgatherAggregator,
    AllreduceAggregator,
    Contribution,
    Pending,
)
from lightning_gradcomp.comm.collectives import Collectives, InFlight
from lightning_gradcomp.comm.counter import CommCounter
from lightning_gradcomp.comm.gtopk import GTopKAggregator

AGGREGATORS[GTopKAggregator.name] = GTopKAggregator

__all__ = [
    "AGGREGATORS",
    "Aggregate",
    "Aggregator",
    "AllgatherAggregator",
    "AllreduceAggregator",
    "Collectives",
    "CommCounter",
    "Contribution",
    "GTopKAggregator",
    "InFlight",
    "Pending",
]
