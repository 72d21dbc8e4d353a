"""``GradCompStrategy``: Lightning's DDP with a compression hook that runs on CPU and GPU alike."""

from __future__ import annotations

import fnmatch
import math
import uuid
from collections.abc import Sequence
from datetime import timedelta
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies import _StrategyRegistry
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_deprecation, rank_zero_info, rank_zero_warn
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from lightning_gradcomp.checkpoint import (
    CHECKPOINT_KEY,
    FORMAT,
    ShardError,
    manifest,
    read_shard,
    remove_shards,
    write_shard,
)
from lightning_gradcomp.comm import AGGREGATORS
from lightning_gradcomp.comm.hierarchy import HIERARCHIES, SCHEMES, NodeLayout, NodeTopology, node_id_from_environment
from lightning_gradcomp.compressors import Compressor, IdentityCompressor, WirePrecision, build_compressor
from lightning_gradcomp.compressors.topk import validate_density
from lightning_gradcomp.hook import GradCompHook, gradcomp_comm_hook
from lightning_gradcomp.memory import MEMORIES, Diana, Memory, NoMemory, build_memory
from lightning_gradcomp.schedule import DensityWarmup
from lightning_gradcomp.units import DEFAULT_UNIT_CAP_MB, GRANULARITIES

_OWNED_DDP_ARGUMENTS = ("ddp_comm_hook", "ddp_comm_state", "ddp_comm_wrapper", "model_averaging_period")

#: Compressed steps of the Top-k family's density warm-up in the presets (see :mod:`lightning_gradcomp.schedule`).
PRESET_DENSITY_WARMUP_STEPS = 200

#: Dense steps before ATOMO's first compressed one in its preset: at lr 0.05 / momentum 0.9 LeNet-5's
#: first ~50 steps are on the edge of stability (plain DDP itself dips to 11% accuracy with one seed),
#: and budget-3 atoms compressed from step 2 pushed 2 of 8 seeds down to 9-16%, from which they ended
#: 1-2 points short (benchmarks/README.md, "Time to accuracy"). PyTorch's PowerSGD hook starts dense
#: for the same reason (``start_powerSGD_iter``).
PRESET_ATOMO_DENSE_STEPS = 100

#: Dense steps before PowerSGD's first compressed one in its preset: PyTorch's ``start_powerSGD_iter``,
#: which its documentation suggests setting to about 10% of training (1000 by default there).
PRESET_POWERSGD_DENSE_STEPS = 100

#: What every compressed preset shares: the logits layer stays dense (TernGrad's authors' practice;
#: it is small and its gradient is the one every class's error flows through).
_LAST_LAYER_DENSE = {"keep_last_layer_dense": True}
_SPARSIFIER = {"memory": "ef", "granularity": "model", "density_warmup_steps": PRESET_DENSITY_WARMUP_STEPS}

#: The half-precision dense presets: every parameter (none too small) in size-capped groups, as DDP's buckets.
_HALF_WIRE = {"compressor": "none", "memory": "none", "aggregator": "allreduce", "granularity": "group",
              "min_compress_numel": 0}  # fmt: skip

#: Named strategies registered with Lightning when ``lightning_gradcomp`` is imported.
NAMED_STRATEGIES: dict[str, tuple[str, dict[str, Any]]] = {
    "ddp_gradcomp_dense": (
        "Dense baseline through the gradcomp hook (identity compressor, allreduce)",
        {"compressor": "none", "memory": "none", "aggregator": "allreduce"},
    ),
    "ddp_atomo": (
        "Spectral ATOMO: unbiased sampling of rank-1 SVD atoms (budget 3), allgather of variable-size payloads; "
        f"{PRESET_ATOMO_DENSE_STEPS} dense steps first, last layer dense",
        {
            "compressor": "atomo",
            "memory": "none",
            "aggregator": "allgather",
            "warmup_steps": PRESET_ATOMO_DENSE_STEPS,
            **_LAST_LAYER_DENSE,
        },
    ),
    "ddp_diana": (
        "DIANA: compressed gradient differences with per-rank shifts, QSGD with 7 levels (4 bits per element, a "
        "2-norm per block of 512), last layer dense",
        {"compressor": "qsgd", "memory": "diana", "aggregator": "allgather", **_LAST_LAYER_DENSE},
    ),
    "ddp_efsign": (
        "EF-SignSGD: scaled signs (1 bit per element, one scale per layer) with error feedback, allgather of "
        "the averaged scaled signs; last layer dense",
        {"compressor": "sign", "memory": "ef", "aggregator": "allgather", **_LAST_LAYER_DENSE},
    ),
    "ddp_fp16": (
        "Dense gradients sent as float16, divided by the world size before the sum (PyTorch's fp16_compress_hook), "
        "allreduce per parameter group",
        _HALF_WIRE | {"wire_precision": "fp16"},
    ),
    "ddp_bf16": (
        "Dense gradients sent as bfloat16 (float32's range, 8-bit mantissa), divided by the world size before the "
        "sum, allreduce per parameter group",
        _HALF_WIRE | {"wire_precision": "bf16"},
    ),
    "ddp_gaussiank": (
        "Gaussian_k: O(d) threshold selection with error feedback, k/2 to k entries in k fixed slots, allgather; "
        "density warm-up, last layer dense",
        {"compressor": "gaussiank", "aggregator": "allgather", **_SPARSIFIER, **_LAST_LAYER_DENSE},
    ),
    "ddp_gtopk": (
        "gTop-k: Top-k with error feedback, sparse butterfly aggregation in O(k log P); density warm-up, "
        "last layer dense",
        {"compressor": "topk", "aggregator": "gtopk", **_SPARSIFIER, **_LAST_LAYER_DENSE},
    ),
    "ddp_powersgd": (
        "PowerSGD: rank-4 approximations by one warm-started power iteration with error feedback, two "
        f"allreduces per group of matrices; {PRESET_POWERSGD_DENSE_STEPS} dense steps first, last layer dense",
        {
            "compressor": "powersgd",
            "compressor_kwargs": {"rank": 4},
            "memory": "ef",
            "aggregator": "allreduce",
            "granularity": "group",
            "warmup_steps": PRESET_POWERSGD_DENSE_STEPS,
            **_LAST_LAYER_DENSE,
        },
    ),
    "ddp_terngrad": (
        "TernGrad: 2-bit stochastic ternary gradients, shared per-layer scalers, 2.5-sigma clipping, last layer dense",
        {"compressor": "terngrad", "memory": "none", "aggregator": "auto", **_LAST_LAYER_DENSE},
    ),
    "ddp_topk": (
        "Top-k sparsification with error feedback, allgather of sparse payloads; density warm-up, last layer dense",
        {"compressor": "topk", "aggregator": "allgather", **_SPARSIFIER, **_LAST_LAYER_DENSE},
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
        memory: ``"none"``, ``"ef"`` (error feedback) or ``"diana"`` (compressed gradient
            differences; needs a compressor unbiased for the gradient it is given).
        memory_kwargs: arguments of the memory, e.g. ``{"alpha": 0.5}`` for DIANA (default
            ``1 / (omega + 1)`` from the quantizer's variance bound).
        aggregator: ``"allreduce"``, ``"allgather"``, or ``"auto"`` (the compressor's choice for
            the world size: allgather for sparse payloads, allreduce otherwise by default).
        granularity: what is compressed together, decided by the parameters alone (never by DDP's
            buckets, which change after the first step and after a restart): ``"layer"``, each
            parameter in its own shape; ``"model"``, all compressed parameters as one flat vector
            (the gTop-k and Gaussian_k authors' setting); ``"group"``, flat groups of at most
            ``unit_cap_mb``. ``"bucket"`` is a deprecated alias of ``"group"``.
        unit_cap_mb: size cap in MiB of a ``"group"`` unit and of a group of dense parameters.
        density: fraction of entries kept by sparsifying compressors, in (0, 1]; only with a name.
        density_schedule: densities by epoch, the last one kept for later epochs (the authors'
            warm-up: ``[0.004, 0.001]`` for Top-k, ``[1/64, 0.004, 0.001]`` for Gaussian_k).
        density_warmup_steps: compressed steps over which the density falls geometrically from
            ``density_warmup_start`` to ``density`` (DGC's exponential warm-up counted in steps,
            see :mod:`lightning_gradcomp.schedule`); 0 for none. Excludes ``density_schedule``.
        density_warmup_start: the density at the first compressed step of the warm-up.
        warmup_steps: optimizer steps averaged densely before compression starts (DDP rebuilds its
            buckets after the first one; state is keyed by parameter name, so 0 is allowed).
        min_compress_numel: parameters with fewer elements (biases, norms) are averaged densely.
        seed: base seed of the compressors' random streams; a unit's stream at a step is a pure
            function of (seed, rank, step, unit), the same after any restart.
        compressor_kwargs: further arguments for a compressor given by name.
        wire_precision: ``"fp16"`` or ``"bf16"`` to send the compressor's float values (dense tensors,
            sparse values, PowerSGD's factors) in half precision, divided by the world size before any
            sum (:class:`~lightning_gradcomp.compressors.WirePrecision`); ``None``: the gradient's dtype.
        dense_parameters: ``fnmatch`` patterns of parameter names averaged densely, uncompressed
            (each must match a parameter of the model, checked at setup).
        keep_last_layer_dense: average the last layer's parameters (the module holding the last
            registered parameter, usually the logits layer) densely, as the TernGrad authors did.
        hierarchy: ``"none"`` (every rank compresses and exchanges with every rank) or ``"node"``:
            gradients are summed densely inside each node and only the nodes' sums are compressed and
            exchanged between nodes (:mod:`lightning_gradcomp.comm.hierarchy`); on a single node
            ``"node"`` averages densely. Nodes are read from the cluster environment (``NODE_RANK``,
            torchrun's ``GROUP_RANK``, SLURM's node id).
        hierarchy_scheme: with ``hierarchy="node"``, who compresses a unit on each node:
            ``"sharded"`` (the node's local ranks share the units) or ``"leader"`` (local rank 0).
        on_world_size_change: resuming from a checkpoint written by a different number of ranks
            raises a ``ValueError`` naming both sizes (``"error"``), or starts the compression state
            afresh with a warning (``"reset"``): residuals and shifts are per rank and cannot be split
            or merged without changing the run.
        **kwargs: every other :class:`DDPStrategy` argument (``timeout``, ``start_method``, ...)
            and ``DistributedDataParallel`` keyword (``bucket_cap_mb``, ``find_unused_parameters``, ...).

    Checkpoints: every rank writes its own compression state (residuals, shifts, step counter)
    beside the checkpoint file, in ``<checkpoint>.gradcomp/`` (see :mod:`lightning_gradcomp.checkpoint`);
    rank 0 never holds another rank's state.
    """

    strategy_name = "ddp_gradcomp"

    def __init__(
        self,
        compressor: str | Compressor = "topk",
        memory: str = "ef",
        memory_kwargs: dict[str, Any] | None = None,
        aggregator: str = "auto",
        granularity: Literal["layer", "model", "group", "bucket"] = "layer",
        unit_cap_mb: float = DEFAULT_UNIT_CAP_MB,
        density: float | None = None,
        density_schedule: Sequence[float] | None = None,
        density_warmup_steps: int = 0,
        density_warmup_start: float = 0.25,
        warmup_steps: int = 1,
        min_compress_numel: int = 1024,
        seed: int = 0,
        compressor_kwargs: dict[str, Any] | None = None,
        wire_precision: Literal["fp16", "bf16"] | None = None,
        dense_parameters: Sequence[str] = (),
        keep_last_layer_dense: bool = False,
        hierarchy: Literal["none", "node"] = "none",
        hierarchy_scheme: Literal["sharded", "leader"] = "sharded",
        on_world_size_change: Literal["error", "reset"] = "error",
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
        owned = sorted(k for k in _OWNED_DDP_ARGUMENTS if kwargs.get(k) is not None)
        if owned:
            raise ValueError(f"GradCompStrategy installs its own communication hook; do not pass {owned}")
        for key in _OWNED_DDP_ARGUMENTS:  # config parsers pass DDPStrategy's defaults (None) explicitly
            kwargs.pop(key, None)
        compressor_args = dict(compressor_kwargs or {})
        if density is not None:
            compressor_args["density"] = density
        self.compressor = build_compressor(compressor, **compressor_args)
        if wire_precision is not None:
            if aggregator == "gtopk":
                raise ValueError(
                    f"wire_precision={wire_precision!r} with aggregator='gtopk': the butterfly sums entries in the "
                    "messages' precision at every round; use aggregator='allgather'"
                )
            self.compressor = WirePrecision(self.compressor, wire_precision)
        if not isinstance(memory, str) or memory not in MEMORIES:
            raise ValueError(f"memory must be one of {sorted(MEMORIES)}, got {memory!r}")
        memory_args = dict(memory_kwargs or {})
        if memory == Diana.name:
            if not self.compressor.unbiased:
                raise ValueError(
                    f"memory='diana' needs a compressor that is unbiased for the gradient it is given, "
                    f"E[C(x)] = x (Mishchenko et al., 2019, Sec. 2), and {self.compressor!r} is not: "
                    f"{self.compressor.bias_reason}"
                )
            if memory_args.get("alpha") is None:
                if not callable(getattr(self.compressor, "omega", None)):
                    raise ValueError(
                        f"memory='diana' without memory_kwargs={{'alpha': ...}} needs a compressor with a variance "
                        f"bound omega(numel), and {self.compressor!r} has none"
                    )
                memory_args["variance_bound"] = self.compressor.omega
        if not isinstance(aggregator, str) or (aggregator not in AGGREGATORS and aggregator != "auto"):
            raise ValueError(f"aggregator must be one of {[*sorted(AGGREGATORS), 'auto']}, got {aggregator!r}")
        if aggregator == "allreduce" and not self.compressor.summable_across_ranks:
            raise ValueError(
                f"aggregator='allreduce' sums compressed codes across ranks, which {self.compressor!r} cannot do "
                "as configured (TernGrad needs share_scale=True); use aggregator='allgather' or 'auto'"
            )
        if aggregator in ("allgather", "gtopk") and not self.compressor.gatherable:
            raise ValueError(
                f"aggregator={aggregator!r} gathers each rank's payload bytes, but {self.compressor!r} is summed over "
                "ranks in rounds (each computed from the last one's sum); use aggregator='allreduce' or 'auto'"
            )
        if granularity == "bucket":
            rank_zero_deprecation(
                "granularity='bucket' is deprecated: units no longer follow DDP's buckets (which change after "
                "the first step and after a restart); it now means granularity='group', flat groups of at most "
                "unit_cap_mb. Use 'model' for one unit of the whole model (the gTop-k authors' setting)."
            )
            granularity = "group"
        if granularity not in GRANULARITIES:
            raise ValueError(f"granularity must be one of {list(GRANULARITIES)}, got {granularity!r}")
        if granularity != "layer" and self.compressor.needs_layer_shape:
            raise ValueError(
                f"granularity={granularity!r} hands {self.compressor.name!r} flat vectors, but it works on each "
                "parameter's own shape; use granularity='layer'"
            )
        if (
            isinstance(unit_cap_mb, bool)
            or not isinstance(unit_cap_mb, (int, float))
            or not math.isfinite(unit_cap_mb)
            or unit_cap_mb <= 0
        ):
            raise ValueError(f"unit_cap_mb must be a positive number of MiB, got {unit_cap_mb!r}")
        self.unit_cap_mb = float(unit_cap_mb)
        self.warmup_steps = _check_int("warmup_steps", warmup_steps, 0)
        self.min_compress_numel = _check_int("min_compress_numel", min_compress_numel, 0)
        self.seed = _check_int("seed", seed, 0)
        self.density_schedule = self._check_schedule(density_schedule)
        self.density_warmup = self._check_density_warmup(density_warmup_steps, density_warmup_start)
        if isinstance(dense_parameters, str) or not all(isinstance(p, str) for p in dense_parameters):
            raise ValueError(f"dense_parameters must be a list of name patterns, got {dense_parameters!r}")
        if not isinstance(keep_last_layer_dense, bool):
            raise ValueError(f"keep_last_layer_dense must be True or False, got {keep_last_layer_dense!r}")
        if on_world_size_change not in ("error", "reset"):
            raise ValueError(f"on_world_size_change must be 'error' or 'reset', got {on_world_size_change!r}")
        self.on_world_size_change = on_world_size_change
        if hierarchy not in HIERARCHIES:
            raise ValueError(f"hierarchy must be one of {list(HIERARCHIES)}, got {hierarchy!r}")
        if hierarchy_scheme not in SCHEMES:
            raise ValueError(f"hierarchy_scheme must be one of {list(SCHEMES)}, got {hierarchy_scheme!r}")
        self.hierarchy = hierarchy
        self.hierarchy_scheme = hierarchy_scheme
        self._pending_hook_state: dict | None = None
        self._run_tag = uuid.uuid4().hex  # replaced by rank 0's at setup, so that all ranks share it
        self._saves = 0
        self.dense_parameters = tuple(dense_parameters)
        self.keep_last_layer_dense = keep_last_layer_dense
        self.aggregator_name = aggregator
        self.granularity = granularity
        self.memory: Memory = build_memory(memory, **memory_args)
        if getattr(self.memory, "momentum", 0.0) and not hasattr(self.compressor, "density"):
            raise ValueError(
                f"memory_kwargs={{'momentum': {self.memory.momentum}}} is DGC's momentum correction for "
                f"sparsifiers (topk, gaussiank, dgc); {self.compressor!r} does not sparsify"
            )
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

    def _check_schedule(self, schedule: Sequence[float] | None) -> tuple[float, ...] | None:
        if schedule is None:
            return None
        if isinstance(schedule, (str, bytes)) or not isinstance(schedule, Sequence) or not schedule:
            raise ValueError(f"density_schedule must be a non-empty list of densities in (0, 1], got {schedule!r}")
        if not hasattr(self.compressor, "density"):
            raise ValueError(f"density_schedule needs a compressor with a density; {self.compressor!r} has none")
        try:
            return tuple(validate_density(d) for d in schedule)
        except ValueError as err:
            raise ValueError(f"density_schedule: {err}") from None

    def _check_density_warmup(self, steps: int, start: float) -> DensityWarmup | None:
        _check_int("density_warmup_steps", steps, 0)
        if isinstance(start, bool) or not isinstance(start, (int, float)) or not 0.0 < start <= 1.0:
            raise ValueError(f"density_warmup_start must be a density in (0, 1], got {start!r}")
        if steps == 0:
            return None
        if not hasattr(self.compressor, "density"):
            raise ValueError(f"density_warmup_steps needs a compressor with a density; {self.compressor!r} has none")
        if self.density_schedule is not None:
            raise ValueError(
                f"density_warmup_steps={steps} and density_schedule={list(self.density_schedule)} both set the "
                "density; give one (the warm-up counts steps, the schedule epochs)"
            )
        return DensityWarmup(self.compressor.density, steps, start)

    def density_for_epoch(self, epoch: int) -> float | None:
        """The scheduled density for ``epoch`` (``None`` without a schedule)."""
        if self.density_schedule is None:
            return None
        return self.density_schedule[min(epoch, len(self.density_schedule) - 1)]

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        """Apply the density schedule for the current epoch before the step's backward pass."""
        super().on_train_batch_start(batch, batch_idx)
        density = self.density_for_epoch(self.lightning_module.trainer.current_epoch)
        if density is not None:
            self.compressor.density = density

    def dense_parameter_names(self, named_parameters: Sequence[tuple[str, torch.nn.Parameter]]) -> frozenset[str]:
        """Names of the parameters kept dense by ``dense_parameters`` and ``keep_last_layer_dense``."""
        names = [name for name, _ in named_parameters]
        dense: set[str] = set()
        for pattern in self.dense_parameters:
            matched = fnmatch.filter(names, pattern)
            if not matched:
                raise ValueError(f"dense_parameters pattern {pattern!r} matches no parameter; parameters are {names}")
            dense.update(matched)
        if self.keep_last_layer_dense and names:
            owner = names[-1].rpartition(".")[0]
            dense.update(n for n in names if n.rpartition(".")[0] == owner)
        return frozenset(dense)

    def resolved_aggregator(self, world_size: int) -> str:
        """The aggregator for ``world_size`` ranks: as given, or the compressor's choice for ``"auto"``."""
        if self.aggregator_name == "auto":
            return self.compressor.preferred_aggregator(world_size)
        return self.aggregator_name

    def build_hook(
        self, module: torch.nn.Module, group: torch.distributed.ProcessGroup | None = None, node_id: object = None
    ) -> GradCompHook:
        """The hook this strategy installs for ``module``'s parameters over ``group`` (default: the world).

        Also the way to use the strategy's settings with a hand-made ``DistributedDataParallel``:
        ``ddp.register_comm_hook(strategy.build_hook(model), gradcomp_comm_hook)``. With
        ``hierarchy="node"`` every rank must call it (it gathers every rank's node and creates the
        node groups); ``node_id`` labels this rank's node (default: from the environment).
        """
        named = list(module.named_parameters())
        world_size = torch.distributed.get_world_size(group)
        topology = self._node_topology(group, node_id) if self.hierarchy == "node" else None
        if self.hierarchy == "node" and topology is None:
            return self._dense_hook(named, group)
        exchanging = topology.nodes if topology is not None else world_size
        return GradCompHook(
            compressor=self.compressor,
            memory=self.memory,
            aggregator=self.resolved_aggregator(exchanging),
            named_parameters=named,
            granularity=self.granularity,
            unit_cap_mb=self.unit_cap_mb,
            warmup_steps=self.warmup_steps,
            min_compress_numel=self.min_compress_numel,
            dense_names=self.dense_parameter_names(named),
            density_warmup=self.density_warmup,
            seed=self.seed,
            group=group,
            topology=topology,
        )

    def _node_topology(self, group: torch.distributed.ProcessGroup | None, node_id: object) -> NodeTopology | None:
        """The node topology of the world, or ``None`` (with a one-line info) when it is a single node."""
        if group is not None and group != torch.distributed.group.WORLD:
            raise ValueError("hierarchy='node' builds its node groups from the world; the hook's group must be it")
        if node_id is None:
            node_id = self.cluster_environment.node_rank() if self.cluster_environment is not None else None
        layout = NodeLayout.gather(node_id if node_id is not None else node_id_from_environment())
        if len(layout.nodes) == 1:
            rank_zero_info("hierarchy='node' on a single node: gradients are averaged densely (no slow link to spare)")
            return None
        return NodeTopology(layout, self.hierarchy_scheme, timeout=self._timeout)

    def _dense_hook(
        self, named: list[tuple[str, torch.nn.Parameter]], group: torch.distributed.ProcessGroup | None
    ) -> GradCompHook:
        """Plain DDP's average through the hook (so statistics and checkpoints work as for any run)."""
        return GradCompHook(IdentityCompressor(), NoMemory(), "allreduce", named, warmup_steps=0, group=group)

    def _register_ddp_hooks(self) -> None:
        """Attach the compression hook, whatever the device (the parent does so only on CUDA)."""
        assert isinstance(self.model, DistributedDataParallel)
        self._check_settings_agree(list(self.model.module.named_parameters()))
        self.gradcomp_hook = self.build_hook(self.model.module, self.model.process_group)
        if self._pending_hook_state is not None:
            self.gradcomp_hook.load_state_dict(self._pending_hook_state)
            self._pending_hook_state = None
        self.model.register_comm_hook(state=self.gradcomp_hook, hook=gradcomp_comm_hook)

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        super().setup(trainer)
        self._check_momentum_correction()

    def _check_momentum_correction(self) -> None:
        """Under momentum correction the momentum is applied before sparsifying: refuse it twice.

        The optimizer must not add its own momentum to the compressed parameters (Lin et al., 2018,
        Sec. 3.2); parameters averaged densely (biases, a dense last layer) may keep theirs in a
        parameter group of their own.
        """
        if not getattr(self.memory, "momentum", 0.0) or self.gradcomp_hook is None:
            return
        compressed = {name for unit in self.gradcomp_hook.units if unit.compressed for name in unit.names}
        names = {id(p): name for name, p in self.lightning_module.named_parameters()}
        for optimizer in self.optimizers:
            for index, group in enumerate(optimizer.param_groups):
                clash = sorted(names[id(p)] for p in group["params"] if names.get(id(p)) in compressed)
                if group.get("momentum", 0.0) and clash:
                    raise ValueError(
                        f"memory_kwargs={{'momentum': {self.memory.momentum}}} applies momentum on each rank before "
                        f"sparsifying (DGC's momentum correction), but parameter group {index} of "
                        f"{type(optimizer).__name__} adds momentum {group['momentum']} again to compressed "
                        f"parameters {clash[:3]}{' ...' if len(clash) > 3 else ''}: give those momentum 0"
                    )

    def compression_settings(self, named_parameters: Sequence[tuple[str, torch.nn.Parameter]]) -> dict[str, str]:
        """Every setting all ranks must share, as text: compared across ranks at setup."""
        return {
            "compressor": repr(self.compressor),
            "memory": f"{self.memory.name} {getattr(self.memory, 'alpha', '')} {getattr(self.memory, 'momentum', '')}",
            "aggregator": self.resolved_aggregator(self.world_size),
            "granularity": self.granularity,
            "unit_cap_mb": str(self.unit_cap_mb),
            "warmup_steps": str(self.warmup_steps),
            "min_compress_numel": str(self.min_compress_numel),
            "density_schedule": str(self.density_schedule),
            "density_warmup": repr(self.density_warmup),
            "dense parameters": str(sorted(self.dense_parameter_names(named_parameters))),
            "seed": str(self.seed),
            "hierarchy": f"{self.hierarchy} {self.hierarchy_scheme}",
            "parameters": str([(name, tuple(p.shape)) for name, p in named_parameters]),
        }

    def _check_settings_agree(self, named_parameters: Sequence[tuple[str, torch.nn.Parameter]]) -> None:
        """Raise on every rank, naming what differs, when ranks were configured differently.

        Different densities or compressors would make the ranks disagree on payload sizes: a hang or
        garbage at the first compressed step. One object gather at setup rules that out; it also
        hands every rank rank 0's run tag, which marks this run's checkpoint shards.
        """
        assert isinstance(self.model, DistributedDataParallel)
        local = self.compression_settings(named_parameters)
        if self.world_size == 1:
            return
        every: list[Any] = [None] * self.world_size
        torch.distributed.all_gather_object(every, (local, self._run_tag), group=self.model.process_group)
        self._run_tag = every[0][1]
        every = [settings for settings, _ in every]
        differences = [
            f"{key}: " + ", ".join(f"rank {r} has {settings[key]}" for r, settings in enumerate(every))
            for key in local
            if len({settings[key] for settings in every}) > 1
        ]
        if differences:
            raise ValueError("GradCompStrategy settings differ across ranks; " + "; ".join(differences))

    def compression_state(self) -> dict[str, Any]:
        """This rank's compression state (memory and step counter), on the CPU."""
        hook_state = self.gradcomp_hook.state_dict() if self.gradcomp_hook is not None else self._pending_hook_state
        return {
            "memory": self.memory.name,
            "compressor": self.compressor.name,
            "memory_state": {k: v.detach().cpu() for k, v in self.memory.state_dict().items()},
            "hook": hook_state,
        }

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """Write this rank's compression state beside ``filepath`` (every rank), then the checkpoint (rank 0).

        The checkpoint records only a manifest under ``"gradcomp"``; a weights-only checkpoint (no
        optimizer states) gets no compression state either.
        """
        if "optimizer_states" in checkpoint:
            self._saves += 1
            tag = f"{self._run_tag}-{self._saves}"
            write_shard(filepath, self.global_rank, self.world_size, {"tag": tag, **self.compression_state()})
            checkpoint[CHECKPOINT_KEY] = manifest(self.world_size, tag, self.memory.name, self.compressor.name)
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        """Remove the checkpoint and its compression-state shards (rank 0 all of them, each rank its own)."""
        super().remove_checkpoint(filepath)
        remove_shards(filepath, self.global_rank, self.world_size)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Load the checkpoint and give this rank its own compression state back (see ``on_world_size_change``).

        Every rank reads its own shard; if any rank's shard is missing, unreadable or foreign, every
        rank raises the same :class:`~lightning_gradcomp.checkpoint.ShardError` naming the files, and
        nothing is restored. Checkpoints of the earlier single-file format (every rank's state inline)
        still load.
        """
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        saved = checkpoint.get(CHECKPOINT_KEY)
        if saved is None:
            return checkpoint
        if saved["world_size"] != self.world_size:
            message = (
                f"the checkpoint {checkpoint_path} holds compression state of {saved['world_size']} ranks, "
                f"but this run has {self.world_size}"
            )
            if self.on_world_size_change == "error":
                raise ValueError(f"{message}; pass on_world_size_change='reset' to start the state afresh")
            rank_zero_warn(f"{message}: compression state (residuals, shifts, step counter) starts afresh")
            return checkpoint
        state, error = None, None
        try:
            state = self._read_state(checkpoint_path, saved)
        except ShardError as err:
            error = str(err)
        errors = self._every_rank(error)
        if any(errors):
            raise ShardError("; ".join(dict.fromkeys(e for e in errors if e)))
        assert state is not None
        self.memory.load_state_dict({k: v.to(self.root_device) for k, v in state["memory_state"].items()})
        if state["hook"] is not None:
            if self.gradcomp_hook is not None:
                self.gradcomp_hook.load_state_dict(state["hook"])
            else:
                self._pending_hook_state = state["hook"]
        return checkpoint

    def _read_state(self, checkpoint_path: Any, saved: dict[str, Any]) -> dict[str, Any]:
        """This rank's state from a checkpoint's ``"gradcomp"`` entry: its shard, or inline (format 1)."""
        version = saved.get("format", 1)
        if version == 1:  # every rank's state gathered into the checkpoint
            state = saved["ranks"][self.global_rank]
        elif version == FORMAT:
            state = read_shard(checkpoint_path, self.global_rank, saved)
        else:
            raise ShardError(
                f"the checkpoint {checkpoint_path} holds compression state of format {version!r}; this version "
                f"reads formats 1 and {FORMAT}"
            )
        for what, mine in (("memory", self.memory.name), ("compressor", self.compressor.name)):
            theirs = state.get(what, saved.get(what))
            if theirs is not None and theirs != mine:
                raise ShardError(
                    f"the checkpoint {checkpoint_path} holds compression state of {what}={theirs!r}, "
                    f"but this run uses {what}={mine!r}"
                )
        return state

    def _every_rank(self, value: Any) -> list[Any]:
        """``value`` from every rank, in rank order (one object gather; just ``[value]`` alone)."""
        if self.world_size == 1 or not torch.distributed.is_initialized():
            return [value]
        every: list[Any] = [None] * self.world_size
        torch.distributed.all_gather_object(every, value)
        return every

    @classmethod
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        """Register ``ddp_gradcomp`` and the named presets in :data:`NAMED_STRATEGIES`."""
        strategy_registry.register(
            cls.strategy_name, cls, description="DDP with gradient compression (configure via arguments)", override=True
        )
        for name, (description, init_params) in NAMED_STRATEGIES.items():
            strategy_registry.register(name, cls, description=description, override=True, **init_params)
