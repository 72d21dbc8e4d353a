"""Moving payloads between ranks, counting every byte handed to a collective."""

from lightning_gradcomp.core.comm.aggregators import (
    AGGREGATORS,
    Aggregate,
    Aggregator,
    AllgatherAggregator,
    AllreduceAggregator,
    ChoosersAggregator,
    Contribution,
    Pending,
)
from lightning_gradcomp.core.comm.collectives import Collectives, InFlight
from lightning_gradcomp.core.comm.counter import CommCounter
from lightning_gradcomp.core.comm.gtopk import GTopKAggregator
from lightning_gradcomp.core.comm.two_phase import TwoPhaseAggregator

AGGREGATORS[GTopKAggregator.name] = GTopKAggregator
AGGREGATORS[TwoPhaseAggregator.name] = TwoPhaseAggregator

__all__ = [
    "AGGREGATORS",
    "Aggregate",
    "Aggregator",
    "AllgatherAggregator",
    "AllreduceAggregator",
    "ChoosersAggregator",
    "Collectives",
    "CommCounter",
    "Contribution",
    "GTopKAggregator",
    "InFlight",
    "Pending",
    "TwoPhaseAggregator",
]
