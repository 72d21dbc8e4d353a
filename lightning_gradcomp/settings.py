"""The compression settings every entry point shares: the Trainer's and Fabric's strategies and :func:`make_hook`.

:class:`CompressionSettings` validates the arguments once (a ``ValueError`` naming the argument, the
value and what is allowed), builds the :class:`~lightning_gradcomp.hook.GradCompHook` for a module,
checks at setup that every rank was configured alike, installs the hook on a
``DistributedDataParallel``, and writes and reads each rank's compression state beside a checkpoint
(:mod:`lightning_gradcomp.checkpoint`). The strategies add only what their framework needs.
"""

from __future__ import annotations

import copy
import difflib
import fnmatch
import inspect
from collections.abc import Iterable, Sequence
from datetime import timedelta
from typing import Any, Literal, TypeVar

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.utilities.rank_zero import rank_zero_deprecation, rank_zero_info, rank_zero_warn
from torch.nn.parallel import DistributedDataParallel

from lightning_gradcomp.adaptive import DEFAULT_INTERVAL, DEFAULT_THRESHOLD, Accordion
from lightning_gradcomp.checkpoint import (
    FORMAT,
    ShardError,
    ShardTags,
    manifest,
    on_every_rank,
    read_shard,
    write_shard,
)
from lightning_gradcomp.comm.hierarchy import HIERARCHIES, SCHEMES, NodeLayout, NodeTopology, node_id_from_environment
from lightning_gradcomp.compressors import Compressor, IdentityCompressor
from lightning_gradcomp.hook import GradCompHook, gradcomp_comm_hook
from lightning_gradcomp.memory import NoMemory
from lightning_gradcomp.output_layer import (
    OutputLayerWatch,
    declared_output_layer,
    output_layer_names,
    registered_last,
)
from lightning_gradcomp.pipeline import build_pipeline
from lightning_gradcomp.presets import preset_arguments
from lightning_gradcomp.schedule import DensityWarmup, WarmupSchedule
from lightning_gradcomp.units import DEFAULT_UNIT_CAP_MB, GRANULARITIES, refuse_sparse_gradients
from lightning_gradcomp.validation import check_bool, check_choice, check_density, check_int, check_number

#: The adaptive schedules (``adaptive=``) and the arguments Accordion takes (``adaptive_kwargs=``).
ADAPTIVE = ("none", "accordion")
ACCORDION_ARGUMENTS = ("interval", "threshold", "critical_density")
#: A sparsifier's density in Accordion's critical regimes, over its own density, unless given; above the limit
#: (where a sparse payload's indices and values cost about what the dense gradient does) critical regimes are dense.
CRITICAL_DENSITY_FACTOR = 4.0
CRITICAL_DENSITY_LIMIT = 0.25


def check_ddp_keywords(owner: str, keywords: Iterable[str]) -> None:
    """Refuse ``keywords`` that are not ``DistributedDataParallel``'s (where the strategies pass them on), naming
    each with the compression setting it was probably meant to be: a misspelt setting fails here, not inside DDP."""
    unknown = sorted(set(keywords) - set(inspect.signature(DistributedDataParallel).parameters))
    if unknown:
        close = {name: difflib.get_close_matches(name, SETTINGS, n=1) for name in unknown}
        hints = "; ".join(f"{name!r}: did you mean {match[0]!r}?" for name, match in close.items() if match)
        raise ValueError(
            f"{owner} got unknown arguments {unknown}: neither compression settings {sorted(SETTINGS)} nor "
            f"DistributedDataParallel keywords{f' ({hints})' if hints else ''}"
        )


def refuse_density_schedule(density_schedule: Sequence[float] | None, where: str) -> None:
    """``density_schedule`` counts epochs, which only the Trainer has: refuse it elsewhere, naming the way out."""
    if density_schedule is not None:
        raise ValueError(
            f"density_schedule={list(density_schedule)!r} sets the density by epoch, and {where} has no epochs the "
            "hook can see; use density_warmup_steps (a warm-up counted in steps)"
        )


_Settings = TypeVar("_Settings", bound="CompressionSettings")


class CompressionSettings:
    """What to compress and how, validated where it enters; see :class:`~lightning_gradcomp.GradCompStrategy`
    for every argument. ``gradcomp_hook`` is the hook once :meth:`install_hook` ran (``None`` before)."""

    @classmethod
    def from_preset(cls: type[_Settings], name: str, **overrides: Any) -> _Settings:
        """The named strategy ``name`` (``"ddp_topk"``, ...) with any argument changed, DDP's own included:
        ``GradCompStrategy.from_preset("ddp_topk", find_unused_parameters=True, density=0.05)``. A ``*_kwargs``
        dict updates the preset's key by key (:func:`~lightning_gradcomp.presets.preset_arguments`)."""
        return cls(**preset_arguments(name, overrides))

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
        adaptive: Literal["none", "accordion"] = "none",
        adaptive_kwargs: dict[str, Any] | None = None,
        min_compress_numel: int = 1024,
        seed: int = 0,
        compressor_kwargs: dict[str, Any] | None = None,
        wire_precision: Literal["fp16", "bf16", "2bit"] | None = None,
        dense_parameters: Sequence[str] = (),
        keep_last_layer_dense: bool = False,
        hierarchy: Literal["none", "node"] = "none",
        hierarchy_scheme: Literal["sharded", "leader"] = "sharded",
        on_world_size_change: Literal["error", "reset"] = "error",
    ) -> None:
        for name, value in (
            ("compressor_kwargs", compressor_kwargs),
            ("memory_kwargs", memory_kwargs),
            ("adaptive_kwargs", adaptive_kwargs),
        ):
            if value is not None and not isinstance(value, dict):
                raise ValueError(f"{name} must be a dictionary of keyword arguments or None, got {value!r}")
        if not isinstance(dense_parameters, (list, tuple)) or not all(isinstance(p, str) for p in dense_parameters):
            raise ValueError(f"dense_parameters must be a list of name patterns, got {dense_parameters!r}")
        self.compressor, self.memory = build_pipeline(
            compressor, compressor_kwargs, density, wire_precision, memory, memory_kwargs, aggregator
        )
        if granularity == "bucket":
            rank_zero_deprecation(
                "granularity='bucket' is deprecated: units no longer follow DDP's buckets (which change after "
                "the first step and after a restart); it now means granularity='group', flat groups of at most "
                "unit_cap_mb. Use 'model' for one unit of the whole model (the gTop-k authors' setting)."
            )
            granularity = "group"
        check_choice("granularity", granularity, GRANULARITIES)
        if granularity != "layer" and self.compressor.needs_layer_shape:
            raise ValueError(
                f"granularity={granularity!r} hands {self.compressor.name!r} flat vectors, but it works on each "
                "parameter's own shape; use granularity='layer'"
            )
        self.unit_cap_mb = check_number("unit_cap_mb", unit_cap_mb, 0, open_min=True, note="MiB")
        self.warmup_steps = check_int("warmup_steps", warmup_steps, 0)
        self.min_compress_numel = check_int("min_compress_numel", min_compress_numel, 0)
        self.seed = check_int("seed", seed, 0)
        self.density_schedule = self._check_schedule(density_schedule)
        self.density_warmup = self._check_density_warmup(density_warmup_steps, density_warmup_start)
        check_bool("keep_last_layer_dense", keep_last_layer_dense)
        check_choice("on_world_size_change", on_world_size_change, ("error", "reset"))
        self.on_world_size_change = on_world_size_change
        check_choice("hierarchy", hierarchy, HIERARCHIES)
        check_choice("hierarchy_scheme", hierarchy_scheme, SCHEMES)
        self.hierarchy = hierarchy
        self.hierarchy_scheme = hierarchy_scheme
        self._pending_hook_state: dict | None = None
        self._output_watch: OutputLayerWatch | None = None
        #: the parameters of the output layer ``keep_last_layer_dense`` keeps dense, once declared or found
        self.output_layer: list[str] | None = None
        self._tags = ShardTags()  # its run tag replaced by rank 0's at setup, so that all ranks share it
        self.dense_parameters = tuple(dense_parameters)
        self.keep_last_layer_dense = keep_last_layer_dense
        self.aggregator_name = aggregator
        self.granularity = granularity
        self.schedule = self._build_schedule(check_choice("adaptive", adaptive, ADAPTIVE), adaptive_kwargs or {})
        self.gradcomp_hook: GradCompHook | None = None

    def _check_schedule(self, schedule: Sequence[float] | None) -> tuple[float, ...] | None:
        if schedule is None:
            return None
        if isinstance(schedule, (str, bytes)) or not isinstance(schedule, Sequence) or not schedule:
            raise ValueError(f"density_schedule must be a non-empty list of densities in (0, 1], got {schedule!r}")
        if not hasattr(self.compressor, "density"):
            raise ValueError(f"density_schedule needs a compressor with a density; {self.compressor!r} has none")
        try:
            return tuple(check_density("density", d) for d in schedule)
        except ValueError as err:
            raise ValueError(f"density_schedule: {err}") from None

    def _check_density_warmup(self, steps: int, start: float) -> DensityWarmup | None:
        check_int("density_warmup_steps", steps, 0)
        check_density("density_warmup_start", start)
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

    def _build_schedule(self, adaptive: str, kwargs: dict[str, Any]) -> WarmupSchedule:
        """The schedule that plans each step: the warm-ups as given, or Accordion (which replaces the density's)."""
        if adaptive == "none":
            if kwargs:
                raise ValueError(f"adaptive_kwargs={kwargs!r} configure an adaptive schedule; set adaptive='accordion'")
            return WarmupSchedule(self.warmup_steps, self.density_warmup)
        for setting, value in (
            ("density_warmup_steps", self.density_warmup),
            ("density_schedule", self.density_schedule),
        ):
            if value is not None:
                raise ValueError(f"adaptive={adaptive!r} sets the density itself; do not give {setting} as well")
        unknown = sorted(set(kwargs) - set(ACCORDION_ARGUMENTS))
        if unknown:
            raise ValueError(f"adaptive_kwargs has unknown arguments {unknown}; Accordion takes {ACCORDION_ARGUMENTS}")
        if isinstance(self.compressor, IdentityCompressor) and isinstance(self.memory, NoMemory):
            raise ValueError(f"adaptive={adaptive!r} with compressor='none' and memory='none': every step is dense, "
                             "there is nothing to adapt")  # fmt: skip
        density = getattr(self.compressor, "density", None)
        # four times denser in critical regimes, or dense once that would send more than a quarter of the entries
        critical = CRITICAL_DENSITY_FACTOR * density if density is not None else None
        critical = critical if critical is not None and critical <= CRITICAL_DENSITY_LIMIT else None
        return Accordion(
            density=density,
            critical_density=kwargs.get("critical_density", critical),
            interval=kwargs.get("interval", DEFAULT_INTERVAL),
            threshold=kwargs.get("threshold", DEFAULT_THRESHOLD),
            warmup_steps=self.warmup_steps,
        )

    def density_for_epoch(self, epoch: int) -> float | None:
        """The scheduled density for ``epoch`` (``None`` without a schedule)."""
        if self.density_schedule is None:
            return None
        return self.density_schedule[min(epoch, len(self.density_schedule) - 1)]

    def dense_parameter_names(
        self, named_parameters: Sequence[tuple[str, torch.nn.Parameter]], module: torch.nn.Module | None = None
    ) -> frozenset[str]:
        """Names of the parameters kept dense by ``dense_parameters`` and ``keep_last_layer_dense``.

        ``module``, the model the parameters belong to, tells its output layer where it declares it
        (:func:`~lightning_gradcomp.output_layer.output_layer_names`: a tied embedding, under LoRA too).
        """
        if not self.keep_last_layer_dense:
            output: list[str] = []
        elif self.output_layer is not None:  # declared, or found from the first forward pass
            names = {name for name, _ in named_parameters}
            output = [name for name in self.output_layer if name in names]
        else:
            output = output_layer_names(module, named_parameters)
        return self._matched_dense(named_parameters) | frozenset(output)

    def _matched_dense(self, named_parameters: Sequence[tuple[str, torch.nn.Parameter]]) -> frozenset[str]:
        """Names matched by the ``dense_parameters`` patterns (each must match one)."""
        names = [name for name, _ in named_parameters]
        dense: set[str] = set()
        for pattern in self.dense_parameters:
            matched = fnmatch.filter(names, pattern)
            if not matched:
                raise ValueError(f"dense_parameters pattern {pattern!r} matches no parameter; parameters are {names}")
            dense.update(matched)
        return frozenset(dense)

    def warn_if_never_compressed(self) -> None:
        """Warn once, at the end of a run, when none of its steps was compressed (a warm-up, or an adaptive
        schedule's dense critical regimes, that outlasted it): the run exchanged exactly what plain DDP would. The
        dense baseline (the identity compressor, no wire precision) never compresses by design and is let be."""
        hook = self.gradcomp_hook
        if hook is None or type(hook.compressor) is IdentityCompressor or not hook.history:
            return
        if any(s.compressed for s in hook.history):
            return
        steps = len(hook.history)
        warmup = sum(s.regime == "warmup" for s in hook.history)
        critical = sum(s.regime == "critical" for s in hook.history)
        causes, advice = [f"{warmup} in the warm-up of warmup_steps={self.warmup_steps}"], ["lower warmup_steps"]
        if isinstance(self.schedule, Accordion):
            causes.append(f"{critical} in Accordion's dense critical regimes")
            advice.append("pass adaptive='none' or a shorter adaptive_kwargs={'interval': ...} (its first two "
                          "intervals are critical)")  # fmt: skip
        rank_zero_warn(
            f"lightning_gradcomp: none of the run's {steps} steps was compressed ({', '.join(causes)}): every gradient "
            f"was averaged densely, as plain DDP does. For a short run {', or '.join(advice)}."
        )

    def _logged_dense_names(
        self, named: Sequence[tuple[str, torch.nn.Parameter]], module: torch.nn.Module
    ) -> frozenset[str]:
        """:meth:`dense_parameter_names`, with the output layer ``keep_last_layer_dense`` keeps said once: the one
        the model declares, or that it will be found from the first training step."""
        if not self.keep_last_layer_dense:
            return self._matched_dense(named)
        declared = declared_output_layer(module, named)
        if declared is not None:
            self._say_output_layer(declared, named, "declared by the model (get_output_embeddings)")
            return self._matched_dense(named) | frozenset(declared)
        rank_zero_info(
            "keep_last_layer_dense: the model declares no output layer (get_output_embeddings); the module nearest "
            "the output of the first training step's forward pass will be averaged densely"
        )
        return self._matched_dense(named) | frozenset(registered_last(named))

    def _say_output_layer(self, names: list[str], named: Sequence[tuple[str, torch.nn.Parameter]], how: str) -> None:
        """Log the output layer kept dense, and its share of the trained elements; keep it in :attr:`output_layer`."""
        self.output_layer = list(names)
        sizes = {name: p.numel() for name, p in named if p.requires_grad}
        share = sum(sizes[n] for n in names) / max(1, sum(sizes.values()))
        said = f"{names} ({share:.1%} of the trained elements)" if names else "frozen (none)"
        rank_zero_info(f"keep_last_layer_dense: the output layer averaged densely is {said}, {how}")

    def resolved_aggregator(self, world_size: int) -> str:
        """The aggregator for ``world_size`` ranks: as given, or the compressor's choice for ``"auto"``."""
        if self.aggregator_name == "auto":
            return self.compressor.preferred_aggregator(world_size)
        return self.aggregator_name

    def build_hook(
        self,
        module: torch.nn.Module,
        group: torch.distributed.ProcessGroup | None = None,
        node_id: object = None,
        timeout: timedelta | None = None,
    ) -> GradCompHook:
        """The hook this strategy installs for ``module``'s parameters over ``group`` (default: the world).

        (:func:`~lightning_gradcomp.make_hook` is the way for a hand-made ``DistributedDataParallel``: it
        also checks that the ranks agree.) With ``hierarchy="node"`` every rank must call it (it gathers
        every rank's node and creates the node groups); ``node_id`` labels this rank's node (default: from
        the environment), ``timeout`` bounds the node groups' collectives (default: torch.distributed's).
        """
        named = list(module.named_parameters())
        world_size = torch.distributed.get_world_size(group)
        topology = self._node_topology(group, node_id, timeout) if self.hierarchy == "node" else None
        if self.hierarchy == "node" and topology is None:
            return self._dense_hook(named, group)
        exchanging = topology.nodes if topology is not None else world_size
        hook = GradCompHook(
            compressor=self.compressor,
            memory=self.memory,
            aggregator=self.resolved_aggregator(exchanging),
            named_parameters=named,
            granularity=self.granularity,
            unit_cap_mb=self.unit_cap_mb,
            min_compress_numel=self.min_compress_numel,
            dense_names=self._logged_dense_names(named, module),
            schedule=copy.deepcopy(self.schedule),  # a fresh hook starts its schedule afresh, as its step counter
            seed=self.seed,
            group=group,
            topology=topology,
        )
        if self.keep_last_layer_dense and declared_output_layer(module, named) is None:
            self._watch_output_layer(module, named, hook, group)
        return hook

    def _watch_output_layer(
        self,
        module: torch.nn.Module,
        named: list[tuple[str, torch.nn.Parameter]],
        hook: GradCompHook,
        group: torch.distributed.ProcessGroup | None,
    ) -> None:
        """Find the output layer of a model that declares none from its first forward pass with a graph
        (:class:`~lightning_gradcomp.output_layer.OutputLayerWatch`) and plan ``hook``'s units again with it dense.

        Every rank takes rank 0's finding, broadcast at the hook's first bucket (where DDP holds every rank in
        step, whatever forward passes one rank ran alone before it: a logger tracing the graph on rank 0), so a
        data-dependent graph cannot make the ranks plan different units.
        """
        guess = frozenset(registered_last(named))
        self.output_layer = None  # a model of an earlier fit's may have set it
        if self._output_watch is not None:
            self._output_watch.remove()
        watch = self._output_watch = OutputLayerWatch(module, named)

        def share() -> None:
            names = watch.found if watch.found is not None else watch.nested_found
            watch.remove()
            if torch.distributed.get_world_size(group) > 1:
                shared: list[Any] = [names]
                source = torch.distributed.get_global_rank(group, 0) if group is not None else 0
                torch.distributed.broadcast_object_list(shared, src=source, group=group)
                names = shared[0]
            if names is None:
                self.output_layer = sorted(guess, key=[name for name, _ in named].index)
                rank_zero_info(
                    "keep_last_layer_dense: no forward pass with a graph came before the first gradients; the module "
                    f"of the last registered trainable parameter stays dense: {sorted(guess)}"
                )
                return
            self._say_output_layer(names, named, "found from the first training step's forward pass")
            if frozenset(names) != guess:
                hook.keep_dense(self._matched_dense(named) | frozenset(names))
                self.check_momentum_correction(named, self._optimizers_to_check())

        hook.before_first_bucket = share

    def _optimizers_to_check(self) -> list[torch.optim.Optimizer]:
        """The optimizers :meth:`check_momentum_correction` checks again when the units are planned anew (the
        strategies give theirs)."""
        return []

    def _node_topology(
        self, group: torch.distributed.ProcessGroup | None, node_id: object, timeout: timedelta | None
    ) -> NodeTopology | None:
        """The node topology of the world, or ``None`` (with a one-line info) when it is a single node."""
        if group is not None and group != torch.distributed.group.WORLD:
            raise ValueError("hierarchy='node' builds its node groups from the world; the hook's group must be it")
        if node_id is None:  # a strategy knows its cluster's node rank; else torchrun's variables or the host
            environment = getattr(self, "cluster_environment", None)
            node_id = environment.node_rank() if environment is not None else node_id_from_environment()
        layout = NodeLayout.gather(node_id)
        if len(layout.nodes) == 1:
            rank_zero_info("hierarchy='node' on a single node: gradients are averaged densely (no slow link to spare)")
            return None
        timeout = timeout or getattr(self, "process_group_timeout", None) or default_pg_timeout
        return NodeTopology(layout, self.hierarchy_scheme, timeout=timeout)

    def _dense_hook(
        self, named: list[tuple[str, torch.nn.Parameter]], group: torch.distributed.ProcessGroup | None
    ) -> GradCompHook:
        """Plain DDP's average through the hook (so statistics and checkpoints work as for any run)."""
        return GradCompHook(IdentityCompressor(), NoMemory(), "allreduce", named, warmup_steps=0, group=group)

    def install_hook(
        self, ddp: DistributedDataParallel, node_id: object = None, timeout: timedelta | None = None
    ) -> GradCompHook:
        """Check the ranks agree, build the hook for ``ddp``'s module over its process group, give it a state
        loaded before it existed, and register it on ``ddp``."""
        named = list(ddp.module.named_parameters())
        self.output_layer = None  # found anew for this model
        self.check_settings_agree(named, ddp.process_group, ddp.module)
        if self.gradcomp_hook is not None:  # a hook built before (another fit) stops noting gradients
            self.gradcomp_hook.arrivals.remove()
        self.gradcomp_hook = self.build_hook(ddp.module, ddp.process_group, node_id, timeout)
        if self._pending_hook_state is not None:
            self.gradcomp_hook.load_state_dict(self._pending_hook_state)
            self._pending_hook_state = None
        # under AMP with a GradScaler (the Trainer's ``precision_plugin``, Fabric's ``precision``) the gradients
        # the hook sees are scaled: an adaptive schedule measures them unscaled
        plugin = getattr(self, "precision_plugin", None) or getattr(self, "precision", None)
        scaler = getattr(plugin, "scaler", None)
        if scaler is not None:
            self.gradcomp_hook.loss_scale = scaler.get_scale
        ddp.register_comm_hook(state=self.gradcomp_hook, hook=gradcomp_comm_hook)
        return self.gradcomp_hook

    def check_momentum_correction(
        self, named_parameters: Iterable[tuple[str, torch.nn.Parameter]], optimizers: Iterable[torch.optim.Optimizer]
    ) -> None:
        """Under momentum correction the momentum is applied before sparsifying: refuse it twice.

        The optimizer must not add its own momentum to the compressed parameters (Lin et al., 2018,
        Sec. 3.2); parameters averaged densely (biases, a dense last layer) may keep theirs in a
        parameter group of their own.
        """
        if not getattr(self.memory, "momentum", 0.0) or self.gradcomp_hook is None:
            return
        compressed = {name for unit in self.gradcomp_hook.units if unit.compressed for name in unit.names}
        names = {id(p): name for name, p in named_parameters}
        for optimizer in optimizers:
            for index, group in enumerate(optimizer.param_groups):
                clash = sorted(names[id(p)] for p in group["params"] if names.get(id(p)) in compressed)
                if group.get("momentum", 0.0) and clash:
                    raise ValueError(
                        f"memory_kwargs={{'momentum': {self.memory.momentum}}} applies momentum on each rank before "
                        f"sparsifying (DGC's momentum correction), but parameter group {index} of "
                        f"{type(optimizer).__name__} adds momentum {group['momentum']} again to compressed "
                        f"parameters {clash[:3]}{' ...' if len(clash) > 3 else ''}: give those momentum 0"
                    )

    def compression_settings(
        self,
        named_parameters: Sequence[tuple[str, torch.nn.Parameter]],
        world_size: int,
        module: torch.nn.Module | None = None,
    ) -> dict[str, str]:
        """Every setting all ranks must share, as text: compared across ranks at setup (``module``: the model the
        parameters belong to, for its output layer)."""
        return {
            "compressor": repr(self.compressor),
            "memory": f"{self.memory.name} {getattr(self.memory, 'alpha', '')} {getattr(self.memory, 'momentum', '')}",
            "aggregator": self.resolved_aggregator(world_size),
            "granularity": self.granularity,
            "unit_cap_mb": str(self.unit_cap_mb),
            "warmup_steps": str(self.warmup_steps),
            "min_compress_numel": str(self.min_compress_numel),
            "density_schedule": str(self.density_schedule),
            "density_warmup": repr(self.density_warmup),
            "schedule": repr(self.schedule),
            "dense parameters": str(sorted(self.dense_parameter_names(named_parameters, module))),
            "seed": str(self.seed),
            "hierarchy": f"{self.hierarchy} {self.hierarchy_scheme}",
            "parameters": str([(name, tuple(p.shape)) for name, p in named_parameters]),
        }

    def check_settings_agree(
        self,
        named_parameters: Sequence[tuple[str, torch.nn.Parameter]],
        group: torch.distributed.ProcessGroup | None,
        module: torch.nn.Module | None = None,
    ) -> None:
        """Raise on every rank, naming what differs, when ranks were configured differently.

        Different densities or compressors would make the ranks disagree on payload sizes: a hang or
        garbage at the first compressed step. One object gather at setup rules that out; it also
        hands every rank rank 0's run tag, which marks this run's checkpoint shards.
        """
        if module is not None:
            refuse_sparse_gradients(module)
        world_size = torch.distributed.get_world_size(group)
        local = self.compression_settings(named_parameters, world_size, module)
        if world_size == 1:
            return
        every: list[Any] = [None] * world_size
        torch.distributed.all_gather_object(every, (local, self._tags.run), group=group)
        self._tags.run = every[0][1]
        every = [settings for settings, _ in every]
        differences = [
            f"{key}: " + ", ".join(f"rank {r} has {settings[key]}" for r, settings in enumerate(every))
            for key in local
            if len({settings[key] for settings in every}) > 1
        ]
        if differences:
            raise ValueError("gradient compression settings differ across ranks; " + "; ".join(differences))

    def compression_state(self) -> dict[str, Any]:
        """This rank's compression state (memory and step counter), on the CPU."""
        hook_state = dict(self.gradcomp_hook.state_dict()) if self.gradcomp_hook is not None else None
        if hook_state is not None:
            hook_state.pop("memory")  # saved under its own key, as shards of format 2 always had it
        return {
            "memory": self.memory.name,
            "compressor": self.compressor.name,
            "memory_state": {k: v.detach().cpu() for k, v in self.memory.state_dict().items()},
            "hook": hook_state if hook_state is not None else self._pending_hook_state,
        }

    def save_compression_state(self, filepath: Any, rank: int, world_size: int) -> dict[str, Any]:
        """Write this rank's compression state beside ``filepath``; the manifest the checkpoint should hold."""
        tag = self._tags.next()
        write_shard(filepath, rank, world_size, {"tag": tag, **self.compression_state()})
        return manifest(world_size, tag, self.memory.name, self.compressor.name)

    def load_compression_state(
        self, checkpoint_path: Any, saved: dict[str, Any], rank: int, world_size: int, device: torch.device
    ) -> None:
        """Give this rank its own compression state back from the checkpoint whose manifest is ``saved``.

        Every rank reads its own shard; if any rank's shard is missing, unreadable or foreign, every
        rank raises the same :class:`~lightning_gradcomp.checkpoint.ShardError` naming the files, and
        if any rank's state is refused (another memory's or schedule's), every rank raises the same
        ``ValueError`` naming the ranks. A checkpoint of another world size raises a ``ValueError`` naming both, or
        (``on_world_size_change="reset"``) leaves the state fresh with a warning.
        """
        if saved["world_size"] != world_size:
            message = (
                f"the checkpoint {checkpoint_path} holds compression state of {saved['world_size']} ranks, "
                f"but this run has {world_size}"
            )
            if self.on_world_size_change == "error":
                raise ValueError(f"{message}; pass on_world_size_change='reset' to start the state afresh")
            rank_zero_warn(f"{message}: compression state (residuals, shifts, step counter) starts afresh")
            return
        on_every_rank(lambda: self._restore_state(self._read_state(checkpoint_path, saved, rank), device))

    def _restore_state(self, state: dict[str, Any], device: torch.device) -> None:
        """Apply this rank's ``state``: a refusal (memory state of another kind, a schedule's of another) is raised
        here, while every rank can still agree on it, also for a hook built later (its state is checked on a copy of
        the schedule it will get)."""
        self.memory.load_state_dict({k: v.to(device) for k, v in state["memory_state"].items()})
        hook_state = state["hook"]
        if hook_state is None:
            return
        if self.gradcomp_hook is not None:
            self.gradcomp_hook.load_state_dict(hook_state)
        else:
            copy.deepcopy(self.schedule).load_state_dict(hook_state.get("schedule", {}))
            self._pending_hook_state = hook_state

    def _read_state(self, checkpoint_path: Any, saved: dict[str, Any], rank: int) -> dict[str, Any]:
        """This rank's state from a checkpoint's ``"gradcomp"`` entry: its shard, or inline (format 1)."""
        version = saved.get("format", 1)
        if version == 1:  # every rank's state gathered into the checkpoint
            state = saved["ranks"][rank]
        elif version == FORMAT:
            state = read_shard(checkpoint_path, rank, saved)
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


#: The names of :class:`CompressionSettings`' arguments, in order.
SETTINGS: tuple[str, ...] = tuple(inspect.signature(CompressionSettings).parameters)


def split_settings(arguments: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``arguments`` split into the compression settings and the rest (the framework's own)."""
    settings = {k: v for k, v in arguments.items() if k in SETTINGS}
    return settings, {k: v for k, v in arguments.items() if k not in SETTINGS}
