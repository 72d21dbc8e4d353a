"""lightning-gradcomp: compressed gradient exchange for PyTorch Lightning's DDP.

Importing the package registers the named strategies (``Trainer(strategy="ddp_topk")``).
"""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_gradcomp.compressors import COMPRESSORS, Compressor, IdentityCompressor, TopKCompressor
from lightning_gradcomp.hook import GradCompHook, StepStats, gradcomp_comm_hook
from lightning_gradcomp.memory import MEMORIES, ErrorFeedback, Memory, NoMemory
from lightning_gradcomp.strategy import NAMED_STRATEGIES, GradCompStrategy

__version__ = "0.1.0.dev0"

GradCompStrategy.register_strategies(StrategyRegistry)

__all__ = [
    "COMPRESSORS",
    "MEMORIES",
    "NAMED_STRATEGIES",
    "Compressor",
    "ErrorFeedback",
    "GradCompHook",
    "GradCompStrategy",
    "IdentityCompressor",
    "Memory",
    "NoMemory",
    "StepStats",
    "TopKCompressor",
    "__version__",
    "gradcomp_comm_hook",
]
