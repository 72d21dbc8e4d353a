"""``GradCompStrategy``: Lightning's DDP with a compression hook that runs on CPU and GPU alike."""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies import _StrategyRegistry
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy
from torch.nn.parallel import DistributedDataParallel

from lightning_gradcomp.comm import AGGREGATORS
from lightning_gradcomp.compressors import Compressor, build_compressor
from lightning_gradcomp.hook import GRANULARITIES, GradCompHook, gradcomp_comm_hook
from lightning_gradcomp.memory import MEMORIES, Memory, build_memory

_OWNED_DDP_ARGUMENTS = ("ddp_comm_hook", "ddp_comm_state", "ddp_comm_wrapper", "model_averaging_period")

#: Named strategies registered with Lightning when ``lightning_gradcomp`` is imported.
NAMED_STRATEGIES: dict[str, tuple[str, dict[str, Any]]] = {
    "ddp_gradcomp_dense": (
        "Dense baseline through the gradcomp hook (identity compressor, allreduce)",
        {"compressor": "none", "memory": "none", "aggregator": "allreduce"},
    ),
    "ddp_topk": (
        "Top-k sparsification with error feedback, allgather of sparse payloads",
        {"compressor": "topk", "memory": "ef", "aggregator": "allgather"},
    ),
}


def _check_int(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


class GradCompStrategy(DDPStrategy):
    """DDP whose gradient exchange is compressed by a communication hook.

    Lightning's :class:`~lightning.pytorch.strategies.DDPStrategy` registers comm hooks only on
    CUDA; this strategy registers its hook on every device (gloo on CPU included).

    Args:
        compressor: a registry name (``"none"``, ``"topk"``) or a :class:`Compressor` instance.
        memory: ``"none"`` or ``"ef"`` (error feedback).
        aggregator: ``"allreduce"``, ``"allgather"``, or ``"auto"`` (the compressor's choice for
            the world size: allgather for sparse payloads, allreduce otherwise by default).
        granularity: ``"layer"`` compresses each parameter on its own; ``"bucket"`` compresses all
            of a DDP bucket's compressed parameters as one vector (the gTop-k authors' setting).
        density: fraction of entries kept by sparsifying compressors, in (0, 1]; only with a name.
        warmup_steps: optimizer steps averaged densely before compression starts (DDP rebuilds its
            buckets after the first one; state is keyed by parameter name, so 0 is allowed).
        min_compress_numel: parameters with fewer elements (biases, norms) are averaged densely.
        seed: base seed of the compressors' random generators (distinct per rank).
        compressor_kwargs: further arguments for a compressor given by name.
        **kwargs: every other :class:`DDPStrategy` argument (``timeout``, ``start_method``, ...)
            and ``DistributedDataParallel`` keyword (``bucket_cap_mb``, ``find_unused_parameters``, ...).
    """

    strategy_name = "ddp_gradcomp"

    def __init__(
        self,
        compressor: str | Compressor = "topk",
        memory: str = "ef",
        aggregator: str = "auto",
        granularity: Literal["layer", "bucket"] = "layer",
        density: float | None = None,
        warmup_steps: int = 1,
        min_compress_numel: int = 1024,
        seed: int = 0,
        compressor_kwargs: dict[str, Any] | None = None,
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        **kwargs: Any,
    ) -> None:
        owned = sorted(set(kwargs) & set(_OWNED_DDP_ARGUMENTS))
        if owned:
            raise ValueError(f"GradCompStrategy installs its own communication hook; do not pass {owned}")
        compressor_args = dict(compressor_kwargs or {})
        if density is not None:
            compressor_args["density"] = density
        self.compressor = build_compressor(compressor, **compressor_args)
        if not isinstance(memory, str) or memory not in MEMORIES:
            raise ValueError(f"memory must be one of {sorted(MEMORIES)}, got {memory!r}")
        if not isinstance(aggregator, str) or (aggregator not in AGGREGATORS and aggregator != "auto"):
            raise ValueError(f"aggregator must be one of {[*sorted(AGGREGATORS), 'auto']}, got {aggregator!r}")
        if granularity not in GRANULARITIES:
            raise ValueError(f"granularity must be one of {list(GRANULARITIES)}, got {granularity!r}")
        self.warmup_steps = _check_int("warmup_steps", warmup_steps, 0)
        self.min_compress_numel = _check_int("min_compress_numel", min_compress_numel, 0)
        self.seed = _check_int("seed", seed, 0)
        self.aggregator_name = aggregator
        self.granularity = granularity
        self.memory: Memory = build_memory(memory)
        self.gradcomp_hook: GradCompHook | None = None
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
            **kwargs,
        )

    def resolved_aggregator(self, world_size: int) -> str:
        """The aggregator for ``world_size`` ranks: as given, or the compressor's choice for ``"auto"``."""
        if self.aggregator_name == "auto":
            return self.compressor.preferred_aggregator(world_size)
        return self.aggregator_name

    def _register_ddp_hooks(self) -> None:
        """Attach the compression hook, whatever the device (the parent does so only on CUDA)."""
        assert isinstance(self.model, DistributedDataParallel)
        names = {id(p): name for name, p in self.model.module.named_parameters()}
        self.gradcomp_hook = GradCompHook(
            compressor=self.compressor,
            memory=self.memory,
            aggregator=self.resolved_aggregator(self.world_size),
            param_names=names,
            granularity=self.granularity,
            warmup_steps=self.warmup_steps,
            min_compress_numel=self.min_compress_numel,
            seed=self.seed,
            group=self.model.process_group,
        )
        self.model.register_comm_hook(state=self.gradcomp_hook, hook=gradcomp_comm_hook)

    @classmethod
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        """Register ``ddp_gradcomp`` and the named presets in :data:`NAMED_STRATEGIES`."""
        strategy_registry.register(
            cls.strategy_name, cls, description="DDP with gradient compression (configure via arguments)", override=True
        )
        for name, (description, init_params) in NAMED_STRATEGIES.items():
            strategy_registry.register(name, cls, description=description, override=True, **init_params)
