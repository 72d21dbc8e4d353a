"""The DDP hook planned, built and installed: which parameters stay dense (the patterns given, the output layer
declared or found from the first forward pass), the node topology, the check that every rank was configured alike,
the hook registered on a ``DistributedDataParallel`` with a state restored before it existed, and the warning of a
run that never compressed."""

from __future__ import annotations

import copy
import fnmatch
from collections.abc import Iterable, Sequence
from datetime import timedelta
from typing import Any

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch.nn.parallel import DistributedDataParallel

from lightning_gradcomp.core.adaptive import Accordion
from lightning_gradcomp.core.checkpoint import ShardTags
from lightning_gradcomp.core.comm.hierarchy import NodeLayout, NodeTopology, node_id_from_environment
from lightning_gradcomp.core.compressors import Compressor, IdentityCompressor
from lightning_gradcomp.core.memory import Memory, NoMemory
from lightning_gradcomp.core.schedule import WarmupSchedule
from lightning_gradcomp.core.units import refuse_sparse_gradients
from lightning_gradcomp.ddp.hook import GradCompHook, gradcomp_comm_hook
from lightning_gradcomp.ddp.output_layer import (
    OutputLayerWatch,
    declared_output_layer,
    output_layer_names,
    registered_last,
)

__all__ = ["HookSetup"]


class HookSetup:
    """Plans, builds and installs the hook from the arguments a
    :class:`~lightning_gradcomp.ddp.arguments.CompressionArguments` holds (``compressor``, ``memory``, ``schedule``,
    ...). ``gradcomp_hook`` is the hook once :meth:`install_hook` ran (``None`` before)."""

    compressor: Compressor
    memory: Memory
    schedule: WarmupSchedule
    #: the installed hook (``None`` before :meth:`install_hook`)
    gradcomp_hook: GradCompHook | None = None
    #: the parameters of the output layer ``keep_last_layer_dense`` keeps dense, once declared or found
    output_layer: list[str] | None = None
    _output_watch: OutputLayerWatch | None = None
    _pending_hook_state: dict | None = None
    _run_tags: ShardTags | None = None

    @property
    def _tags(self) -> ShardTags:
        """This run's shard tags: its run tag replaced by rank 0's at setup, so that all ranks share it."""
        if self._run_tags is None:
            self._run_tags = ShardTags()
        return self._run_tags

    def dense_parameter_names(
        self, named_parameters: Sequence[tuple[str, torch.nn.Parameter]], module: torch.nn.Module | None = None
    ) -> frozenset[str]:
        """Names of the parameters kept dense by ``dense_parameters`` and ``keep_last_layer_dense``.

        ``module``, the model the parameters belong to, tells its output layer where it declares it
        (:func:`~lightning_gradcomp.ddp.output_layer.output_layer_names`: a tied embedding, under LoRA too).
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
        (:class:`~lightning_gradcomp.ddp.output_layer.OutputLayerWatch`) and plan ``hook``'s units again with it dense.

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
