"""Compressed Adam: optimizer-side compression, a front end beside the DDP hook, DiLoCo and HSDP, over the same core.

1-bit Adam (Tang et al., 2021) over the user's own Adam or AdamW: a dense warm-up, then the variance frozen and each
rank's momentum averaged compressed in two phases with error feedback on both (:class:`CompressedAdam`,
:class:`~lightning_gradcomp.core.two_phase_average.TwoPhaseAverage`). For the Trainer
(:class:`GradCompAdamStrategy`, ``strategy="ddp_onebit_adam"``), Fabric (:class:`GradCompAdamFabricStrategy`) and a
hand-made ``DistributedDataParallel`` (``CompressedAdam(optimizer, ...).install(ddp)``)."""

from lightning_gradcomp.compressed_adam.fabric import GradCompAdamFabricStrategy
from lightning_gradcomp.compressed_adam.optimizer import CompressedAdam
from lightning_gradcomp.compressed_adam.presets import COMPRESSED_ADAM_PRESETS
from lightning_gradcomp.compressed_adam.strategy import GradCompAdamStrategy

__all__ = ["COMPRESSED_ADAM_PRESETS", "CompressedAdam", "GradCompAdamFabricStrategy", "GradCompAdamStrategy"]
