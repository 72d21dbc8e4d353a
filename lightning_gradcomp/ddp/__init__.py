"""The DDP front end: a ``DistributedDataParallel`` communication hook that compresses every gradient bucket's trip
(:mod:`~lightning_gradcomp.ddp.hook`), its arguments (:mod:`~lightning_gradcomp.ddp.arguments`), the planning and
installing of the hook (:mod:`~lightning_gradcomp.ddp.hook_setup`), each rank's state beside a checkpoint
(:mod:`~lightning_gradcomp.ddp.shards`), and the entry points that build it: the Trainer's
:class:`~lightning_gradcomp.ddp.strategy.GradCompStrategy`, Fabric's
:class:`~lightning_gradcomp.ddp.fabric.GradCompFabricStrategy` and :func:`~lightning_gradcomp.ddp.torch_ddp.make_hook`
for a hand-made ``DistributedDataParallel``, with their named presets (:mod:`~lightning_gradcomp.ddp.presets`)."""

from lightning_gradcomp.ddp.fabric import GradCompFabricStrategy
from lightning_gradcomp.ddp.hook import GradCompHook, gradcomp_comm_hook
from lightning_gradcomp.ddp.presets import NAMED_STRATEGIES
from lightning_gradcomp.ddp.strategy import GradCompStrategy
from lightning_gradcomp.ddp.torch_ddp import make_hook

__all__ = ["NAMED_STRATEGIES", "GradCompFabricStrategy", "GradCompHook", "GradCompStrategy", "gradcomp_comm_hook",
           "make_hook"]  # fmt: skip
