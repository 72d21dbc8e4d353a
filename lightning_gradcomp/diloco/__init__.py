"""DiLoCo: local SGD with an outer optimizer, synchronising every ``H`` inner steps (a front end beside the DDP
hook, over the same core: :mod:`lightning_gradcomp.comm` for the exchange and its byte count)."""

from lightning_gradcomp.diloco.outer import OuterSync
from lightning_gradcomp.diloco.strategy import GradCompDiLoCoStrategy

__all__ = ["GradCompDiLoCoStrategy", "OuterSync"]
