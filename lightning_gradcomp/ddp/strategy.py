"""``GradCompStrategy``: Lightning's DDP with a compression hook that runs on CPU and GPU alike."""

from __future__ import annotations

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
from lightning.pytorch.utilities.exceptions import _augment_message
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from lightning_gradcomp.core.checkpoint import CHECKPOINT_KEY, remove_shards
from lightning_gradcomp.core.compressors import Compressor
from lightning_gradcomp.core.units import DEFAULT_UNIT_CAP_MB
from lightning_gradcomp.ddp.arguments import SETTINGS, check_ddp_keywords
from lightning_gradcomp.ddp.presets import register_presets
from lightning_gradcomp.ddp.settings import CompressionSettings

_OWNED_DDP_ARGUMENTS = ("ddp_comm_hook", "ddp_comm_state", "ddp_comm_wrapper", "model_averaging_period")

__all__ = [
    "GradCompStrategy",
]


#: What ``DistributedDataParallel`` raises when parameters got no gradient in the previous step.
UNUSED_PARAMETERS_ERROR = ".*Expected to have finished reduction in the prior iteration.*"
#: What a compressed strategy says instead.
UNUSED_PARAMETERS_ADVICE = (
    "It looks like your LightningModule has parameters that were not used in producing the loss returned by "
    "training_step. If this is intentional, enable the detection of unused parameters in DDP and keep the "
    "compression: strategy='<preset>_find_unused_parameters_true' (e.g. 'ddp_topk_find_unused_parameters_true'), "
    "GradCompStrategy.from_preset('<preset>', find_unused_parameters=True), or "
    "GradCompStrategy(..., find_unused_parameters=True)."
)


class GradCompStrategy(CompressionSettings, DDPStrategy):
    """DDP whose gradient exchange is compressed by a communication hook.

    Lightning's :class:`~lightning.pytorch.strategies.DDPStrategy` registers comm hooks only on
    CUDA; this strategy registers its hook on every device (gloo on CPU included).

    Args:
        compressor: a registry name (``"none"``, ``"topk"``, ``"gaussiank"``, ``"dgc"``, ``"randomk"``, ``"sign"``,
            ``"terngrad"``, ``"quantizer"``, ``"qsgd"``, ``"atomo"``, ``"powersgd"``;
            :data:`~lightning_gradcomp.COMPRESSORS`) or a :class:`Compressor` instance.
        memory: ``"none"``, ``"ef"`` (error feedback) or ``"diana"`` (compressed gradient
            differences; needs a compressor unbiased for the gradient it is given).
        memory_kwargs: arguments of the memory, e.g. ``{"alpha": 0.5}`` for DIANA (default
            ``1 / (omega + 1)`` from the quantizer's variance bound).
        aggregator: ``"allreduce"``, ``"allgather"``, ``"gtopk"`` (sparse sets merged pairwise in
            log2(P) rounds, Shi et al., ICDCS 2019, Sec. IV; for the Top-k family), or ``"auto"`` (the
            compressor's choice for the world size: allgather for sparse payloads, allreduce otherwise by
            default).
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
            see :mod:`lightning_gradcomp.core.schedule`); 0 for none. Excludes ``density_schedule``.
        density_warmup_start: the density at the first compressed step of the warm-up.
        warmup_steps: optimizer steps averaged densely before compression starts (DDP rebuilds its
            buckets after the first one; state is keyed by parameter name, so 0 is allowed).
        adaptive: ``"none"``, or ``"accordion"`` to decide from the run how much to compress
            (Agarwal et al., MLSys 2021; :class:`~lightning_gradcomp.core.adaptive.Accordion`): every
            ``interval`` steps the gradient norm is compared with the last interval's, and a relative
            change of at least ``threshold`` marks a critical regime, compressed less (at
            ``critical_density``, or densely); otherwise the compressor's own density. Excludes the
            density warm-up and ``density_schedule``; the first ``warmup_steps`` stay dense.
        adaptive_kwargs: Accordion's arguments: ``interval`` (steps, default 50), ``threshold``
            (default 0.5, the paper's), ``critical_density`` (a sparsifier's density in critical
            regimes, default four times ``density``; ``None`` averages them densely, the default for a
            compressor without a density).
        min_compress_numel: parameters with fewer elements (biases, norms) are averaged densely.
        seed: base seed of the compressors' random streams; a unit's stream at a step is a pure
            function of (seed, rank, step, unit), the same after any restart.
        compressor_kwargs: further arguments for a compressor given by name.
        wire_precision: ``"fp16"`` or ``"bf16"`` to send the compressor's float values (dense tensors,
            sparse values, PowerSGD's factors) in half precision, divided by the world size before any
            sum (:class:`~lightning_gradcomp.core.compressors.WirePrecision`); ``"2bit"``: a fixed-count sparsifier's
            values as a sign and one of two magnitudes per block of 256 entries, gathered
            (:class:`~lightning_gradcomp.core.compressors.lowbit.TwoBitValues`, SparseLoCo's wire); ``None``: the
            gradient's dtype.
        dense_parameters: ``fnmatch`` patterns of parameter names averaged densely, uncompressed
            (each must match a parameter of the model, checked at setup).
        keep_last_layer_dense: average the output layer's parameters densely, as the TernGrad authors did: the
            module a model declares as its output (Hugging Face's ``get_output_embeddings()``, the shared
            matrix of tied embeddings; nothing when LoRA freezes it), else the module holding the last
            registered trainable parameter (:mod:`lightning_gradcomp.ddp.output_layer`). Logged at setup.
        hierarchy: ``"none"`` (every rank compresses and exchanges with every rank) or ``"node"``:
            gradients are summed densely inside each node and only the nodes' sums are compressed and
            exchanged between nodes (:mod:`lightning_gradcomp.core.comm.hierarchy`); on a single node
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
    beside the checkpoint file, in ``<checkpoint>.gradcomp/`` (see :mod:`lightning_gradcomp.core.checkpoint`);
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
        check_ddp_keywords("GradCompStrategy", kwargs)
        arguments = locals()
        CompressionSettings.__init__(self, **{name: arguments[name] for name in SETTINGS})
        #: bounds the collectives of the node groups that ``hierarchy="node"`` creates, as the world's
        self.process_group_timeout = timeout
        DDPStrategy.__init__(
            self,
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

    @override
    def on_exception(self, exception: BaseException) -> None:
        """DDP's error for parameters that got no gradient names the compressed ways to allow them (Lightning's own
        advice, ``strategy="ddp_find_unused_parameters_true"``, would drop the compression)."""
        _augment_message(exception, pattern=UNUSED_PARAMETERS_ERROR, new_message=UNUSED_PARAMETERS_ADVICE)
        super().on_exception(exception)

    @override
    def on_train_end(self) -> None:
        """Warn when the warm-up (or a dense critical regime) outlasted the run (:meth:`warn_if_never_compressed`)."""
        super().on_train_end()
        self.warn_if_never_compressed()

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        """Apply the density schedule for the current epoch before the step's backward pass."""
        super().on_train_batch_start(batch, batch_idx)
        density = self.density_for_epoch(self.lightning_module.trainer.current_epoch)
        if density is not None:
            self.compressor.density = density

    @override
    def configure_ddp(self) -> None:
        """Wrap the module in ``DistributedDataParallel`` as Lightning does, then register the compression hook
        on it, whatever the device (Lightning registers comm hooks on CUDA only, and has none to register here:
        the strategy owns ``ddp_comm_hook``)."""
        super().configure_ddp()
        assert isinstance(self.model, DistributedDataParallel)
        node_id = self.cluster_environment.node_rank() if self.cluster_environment is not None else None
        self.install_hook(self.model, node_id=node_id, timeout=self.process_group_timeout)

    @override
    def _optimizers_to_check(self) -> list[torch.optim.Optimizer]:
        return list(self.optimizers)

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        super().setup(trainer)
        self.check_momentum_correction(self.lightning_module.named_parameters(), self.optimizers)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """Write this rank's compression state beside ``filepath`` (every rank), then the checkpoint (rank 0).

        The checkpoint records only a manifest under ``"gradcomp"``; a weights-only checkpoint (no
        optimizer states) gets no compression state either.
        """
        if "optimizer_states" in checkpoint:
            checkpoint[CHECKPOINT_KEY] = self.save_compression_state(filepath, self.global_rank, self.world_size)
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        """Remove the checkpoint and its compression-state shards (rank 0 all of them, each rank its own)."""
        super().remove_checkpoint(filepath)
        remove_shards(filepath, self.global_rank, self.world_size)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Load the checkpoint and give this rank its own compression state back (see ``on_world_size_change``).

        Checkpoints of the earlier single-file format (every rank's state inline) still load.
        """
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        saved = checkpoint.get(CHECKPOINT_KEY)
        if saved is not None:
            self.load_compression_state(checkpoint_path, saved, self.global_rank, self.world_size, self.root_device)
        return checkpoint

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        """Register ``ddp_gradcomp`` and the named presets
        (:data:`~lightning_gradcomp.ddp.presets.NAMED_STRATEGIES`)."""
        register_presets(strategy_registry, cls, cls.strategy_name)
