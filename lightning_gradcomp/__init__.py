"""lightning-gradcomp: compressed gradient exchange for PyTorch Lightning's DDP, Fabric and plain torch DDP.

Importing the package registers the named strategies with the Trainer (``Trainer(strategy="ddp_topk")``)
and with Fabric (``Fabric(strategy="ddp_topk")``); :func:`make_hook` serves hand-made
``DistributedDataParallel`` scripts and :class:`ReplicaExchange` hand-made HSDP ones.
"""

from lightning.fabric.strategies import STRATEGY_REGISTRY as FABRIC_STRATEGY_REGISTRY
from lightning.pytorch.strategies import StrategyRegistry

from lightning_gradcomp.callbacks import BoundCheck, CompressionMonitor, GradientHistogram
from lightning_gradcomp.compressed_adam import (
    COMPRESSED_ADAM_PRESETS,
    CompressedAdam,
    GradCompAdamFabricStrategy,
    GradCompAdamStrategy,
)
from lightning_gradcomp.core.comm import (
    AGGREGATORS,
    AllgatherAggregator,
    AllreduceAggregator,
    ChoosersAggregator,
    GTopKAggregator,
    TwoPhaseAggregator,
)
from lightning_gradcomp.core.compressors import (
    COMPRESSORS,
    AtomoCompressor,
    BlockQuantizer,
    ChunkedTopKCompressor,
    Compressor,
    DGCCompressor,
    FP8Compressor,
    GaussianKCompressor,
    IdentityCompressor,
    Int8Compressor,
    PowerSGDCompressor,
    QSGDCompressor,
    RandomKCompressor,
    ScaledSignCompressor,
    TernGradCompressor,
    TopKCompressor,
    TwoBitValues,
    WirePrecision,
)
from lightning_gradcomp.core.memory import MEMORIES, Diana, ErrorFeedback, Memory, NoMemory
from lightning_gradcomp.core.stats import StepStats
from lightning_gradcomp.ddp.fabric import GradCompFabricStrategy
from lightning_gradcomp.ddp.hook import GradCompHook, gradcomp_comm_hook
from lightning_gradcomp.ddp.presets import NAMED_STRATEGIES
from lightning_gradcomp.ddp.strategy import GradCompStrategy
from lightning_gradcomp.ddp.torch_ddp import make_hook
from lightning_gradcomp.diloco import DILOCO_PRESETS, GradCompDiLoCoFabricStrategy, GradCompDiLoCoStrategy, OuterSync
from lightning_gradcomp.hsdp import HSDP_PRESETS, GradCompHSDPFabricStrategy, GradCompHSDPStrategy, ReplicaExchange

__version__ = "0.1.0.dev0"

GradCompStrategy.register_strategies(StrategyRegistry)
GradCompDiLoCoStrategy.register_strategies(StrategyRegistry)
GradCompFabricStrategy.register_strategies(FABRIC_STRATEGY_REGISTRY)
GradCompDiLoCoFabricStrategy.register_strategies(FABRIC_STRATEGY_REGISTRY)
GradCompHSDPStrategy.register_strategies(StrategyRegistry)
GradCompHSDPFabricStrategy.register_strategies(FABRIC_STRATEGY_REGISTRY)
GradCompAdamStrategy.register_strategies(StrategyRegistry)
GradCompAdamFabricStrategy.register_strategies(FABRIC_STRATEGY_REGISTRY)

__all__ = [
    "AGGREGATORS",
    "COMPRESSED_ADAM_PRESETS",
    "COMPRESSORS",
    "DILOCO_PRESETS",
    "HSDP_PRESETS",
    "MEMORIES",
    "NAMED_STRATEGIES",
    "AllgatherAggregator",
    "AllreduceAggregator",
    "AtomoCompressor",
    "BlockQuantizer",
    "BoundCheck",
    "ChoosersAggregator",
    "ChunkedTopKCompressor",
    "CompressedAdam",
    "CompressionMonitor",
    "Compressor",
    "DGCCompressor",
    "Diana",
    "ErrorFeedback",
    "FP8Compressor",
    "GTopKAggregator",
    "GaussianKCompressor",
    "GradCompAdamFabricStrategy",
    "GradCompAdamStrategy",
    "GradCompDiLoCoFabricStrategy",
    "GradCompDiLoCoStrategy",
    "GradCompFabricStrategy",
    "GradCompHSDPFabricStrategy",
    "GradCompHSDPStrategy",
    "GradCompHook",
    "GradCompStrategy",
    "GradientHistogram",
    "IdentityCompressor",
    "Int8Compressor",
    "Memory",
    "NoMemory",
    "OuterSync",
    "PowerSGDCompressor",
    "QSGDCompressor",
    "RandomKCompressor",
    "ReplicaExchange",
    "ScaledSignCompressor",
    "StepStats",
    "TernGradCompressor",
    "TopKCompressor",
    "TwoBitValues",
    "TwoPhaseAggregator",
    "WirePrecision",
    "__version__",
    "gradcomp_comm_hook",
    "make_hook",
]
