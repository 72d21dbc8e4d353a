"""The DDP front end's arguments, validated where they enter (a ``ValueError`` naming the argument, the value and what
is allowed): what to compress and how, shared by the Trainer's and Fabric's strategies and :func:`make_hook`
(:class:`~lightning_gradcomp.ddp.settings.CompressionSettings` adds the planning of the hook and its checkpoint
shards)."""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Iterable, Sequence
from typing import Any, Literal

from lightning.pytorch.utilities.rank_zero import rank_zero_deprecation
from torch.nn.parallel import DistributedDataParallel

from lightning_gradcomp.core.adaptive import DEFAULT_INTERVAL, DEFAULT_THRESHOLD, Accordion
from lightning_gradcomp.core.comm.hierarchy import HIERARCHIES, SCHEMES
from lightning_gradcomp.core.compressors import Compressor, IdentityCompressor
from lightning_gradcomp.core.memory import NoMemory
from lightning_gradcomp.core.pipeline_arguments import build_pipeline
from lightning_gradcomp.core.schedule import DensityWarmup, WarmupSchedule
from lightning_gradcomp.core.units import DEFAULT_UNIT_CAP_MB, GRANULARITIES
from lightning_gradcomp.core.validation import check_bool, check_choice, check_density, check_int, check_number

__all__ = ["SETTINGS", "CompressionArguments", "check_ddp_keywords", "refuse_density_schedule", "split_settings"]

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


class CompressionArguments:
    """What to compress and how, validated where it enters; see :class:`~lightning_gradcomp.GradCompStrategy`
    for every argument."""

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
        self.dense_parameters = tuple(dense_parameters)
        self.keep_last_layer_dense = keep_last_layer_dense
        self.aggregator_name = aggregator
        self.granularity = granularity
        self.schedule = self._build_schedule(check_choice("adaptive", adaptive, ADAPTIVE), adaptive_kwargs or {})

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

    def resolved_aggregator(self, world_size: int) -> str:
        """The aggregator for ``world_size`` ranks: as given, or the compressor's choice for ``"auto"``."""
        if self.aggregator_name == "auto":
            return self.compressor.preferred_aggregator(world_size)
        return self.aggregator_name


#: The names of :class:`CompressionArguments`' arguments, in order.
SETTINGS: tuple[str, ...] = tuple(inspect.signature(CompressionArguments).parameters)


def split_settings(arguments: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``arguments`` split into the compression settings and the rest (the framework's own)."""
    settings = {k: v for k, v in arguments.items() if k in SETTINGS}
    return settings, {k: v for k, v in arguments.items() if k not in SETTINGS}
