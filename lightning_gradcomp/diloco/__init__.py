"""DiLoCo: local SGD with an outer optimizer, synchronising every ``H`` inner steps (a front end beside the DDP
hook, over the same core: :class:`~lightning_gradcomp.core.flat_average.CompressedAverage` for a compressed exchange,
:mod:`lightning_gradcomp.core.comm` for its byte count, the per-rank shards of
:mod:`lightning_gradcomp.core.checkpoint`)."""

from lightning_gradcomp.diloco.fabric import GradCompDiLoCoFabricStrategy
from lightning_gradcomp.diloco.outer import OuterSync
from lightning_gradcomp.diloco.presets import DILOCO_PRESETS
from lightning_gradcomp.diloco.strategy import GradCompDiLoCoStrategy

__all__ = [
    "DILOCO_PRESETS",
    "GradCompDiLoCoFabricStrategy",
    "GradCompDiLoCoStrategy",
    "OuterSync",
]
