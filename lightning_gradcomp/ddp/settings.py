"""The DDP front end's settings, which every entry point shares (the Trainer's and Fabric's strategies and
:func:`~lightning_gradcomp.make_hook`), in three homes: the arguments validated where they enter
(:mod:`~lightning_gradcomp.ddp.arguments`), the hook planned, built and installed
(:mod:`~lightning_gradcomp.ddp.hook_setup`), and each rank's state beside a checkpoint
(:mod:`~lightning_gradcomp.ddp.shards`). The strategies add only what their framework needs."""

from __future__ import annotations

import inspect

from torch.nn.parallel import DistributedDataParallel

from lightning_gradcomp.core.presets import FromPreset
from lightning_gradcomp.ddp.arguments import CompressionArguments
from lightning_gradcomp.ddp.presets import NAMED_STRATEGIES
from lightning_gradcomp.ddp.shards import CompressionShards

__all__ = ["CompressionSettings"]


class CompressionSettings(FromPreset, CompressionShards, CompressionArguments):
    """What to compress and how (:class:`~lightning_gradcomp.ddp.arguments.CompressionArguments`), the hook built from
    it (:class:`~lightning_gradcomp.ddp.hook_setup.HookSetup`) and its state in checkpoints
    (:class:`~lightning_gradcomp.ddp.shards.CompressionShards`); see :class:`~lightning_gradcomp.GradCompStrategy`
    for every argument."""

    presets = NAMED_STRATEGIES

    @classmethod
    def preset_keywords(cls) -> set[str]:
        """What ``from_preset`` may change (``GradCompStrategy.from_preset("ddp_topk", find_unused_parameters=True,
        density=0.05)``): the compression arguments, the framework strategy's own and ``DistributedDataParallel``'s
        keywords (the constructor refuses those the strategy owns, naming them)."""
        named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
        initialisers = [vars(base)["__init__"] for base in cls.__mro__ if "__init__" in vars(base)]
        keywords = {
            p.name for init in initialisers for p in inspect.signature(init).parameters.values() if p.kind in named
        }
        return (keywords | set(inspect.signature(DistributedDataParallel).parameters)) - {"self"}
