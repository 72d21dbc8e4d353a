"""The compression pipeline every front end builds from its arguments: compressor, wire precision and memory,
checked against each other and against the aggregator where they enter (a ``ValueError`` naming the argument).

The DDP strategies (:mod:`lightning_gradcomp.ddp.settings`), DiLoCo's outer step (:mod:`lightning_gradcomp.diloco`) and
HSDP's replica exchange (:mod:`lightning_gradcomp.hsdp`) take the same arguments and refuse the same combinations.
"""

from __future__ import annotations

from typing import Any

from lightning_gradcomp.core.comm import AGGREGATORS, Aggregator
from lightning_gradcomp.core.compressors import Compressor, WirePrecision, build_compressor
from lightning_gradcomp.core.compressors.lowbit import TwoBitValues
from lightning_gradcomp.core.memory import MEMORIES, Diana, Memory, build_memory
from lightning_gradcomp.core.validation import check_choice

__all__ = ["WIRE_CHOICES", "aggregator_name", "build_pipeline", "pipeline_names"]

#: What ``wire_precision`` takes: float values in half precision, or a sparsifier's values in 2 bits.
WIRE_CHOICES = (None, "fp16", "bf16", "2bit")


def aggregator_name(aggregator: Any) -> str:
    """The name of ``aggregator`` (a name or an :class:`~lightning_gradcomp.core.comm.Aggregator`), or a
    ``ValueError``."""
    if isinstance(aggregator, str):
        return aggregator
    if isinstance(aggregator, Aggregator):
        return aggregator.name
    raise ValueError(f"aggregator must be one of {[*sorted(AGGREGATORS), 'auto']} or an Aggregator, got {aggregator!r}")


def pipeline_names(compressor: str | Compressor | None, memory: str, wire_precision: str | None) -> tuple[str, str]:
    """The memory's and the compressor's names (``"topk+2bit"`` with a wire precision), as a checkpoint's manifest
    records them: a resume with another pipeline is refused by these names."""
    name = "none" if compressor is None else compressor if isinstance(compressor, str) else type(compressor).__name__
    return memory, f"{name}+{wire_precision}" if wire_precision else name


def build_pipeline(
    compressor: str | Compressor,
    compressor_kwargs: dict[str, Any] | None,
    density: float | None,
    wire_precision: str | None,
    memory: str,
    memory_kwargs: dict[str, Any] | None,
    aggregator: str,
) -> tuple[Compressor, Memory]:
    """The compressor (wrapped for its wire precision) and a fresh memory, or a ``ValueError`` naming the first
    argument that does not fit the others (``aggregator`` is only checked: each front end builds its own)."""
    for name, value in (("compressor_kwargs", compressor_kwargs), ("memory_kwargs", memory_kwargs)):
        if value is not None and not isinstance(value, dict):
            raise ValueError(f"{name} must be a dictionary of keyword arguments or None, got {value!r}")
    if wire_precision not in WIRE_CHOICES:
        raise ValueError(f"wire_precision must be one of {list(WIRE_CHOICES)}, got {wire_precision!r}")
    compressor_args = dict(compressor_kwargs or {})
    if density is not None:
        compressor_args["density"] = density
    built = build_compressor(compressor, **compressor_args)
    if wire_precision == "2bit":
        if aggregator in ("allreduce", "gtopk"):
            raise ValueError(
                f"wire_precision='2bit' sends each rank's entries with their own levels, which are gathered, not "
                f"summed or merged; use aggregator='allgather' or 'auto', not {aggregator!r}"
            )
        built = TwoBitValues(built)
    elif wire_precision is not None:
        if wire_precision == "fp16" and aggregator == "gtopk":
            raise ValueError(
                "wire_precision='fp16' with aggregator='gtopk': the butterfly's merged sums are rounded to the "
                "wire's precision at every round, before any division by the world size, and could overflow "
                "float16; use wire_precision='bf16'"
            )
        built = WirePrecision(built, wire_precision)
    check_choice("memory", memory, sorted(MEMORIES))
    memory_args = dict(memory_kwargs or {})
    if memory == Diana.name:
        if not built.unbiased:
            raise ValueError(
                f"memory='diana' needs a compressor that is unbiased for the gradient it is given, "
                f"E[C(x)] = x (Mishchenko et al., 2019, Sec. 2), and {built!r} is not: "
                f"{built.bias_reason}"
            )
        if memory_args.get("alpha") is None:
            if not callable(getattr(built, "omega", None)):
                raise ValueError(
                    f"memory='diana' without memory_kwargs={{'alpha': ...}} needs a compressor with a variance "
                    f"bound omega(numel), and {built!r} has none"
                )
            memory_args["variance_bound"] = built.omega
    check_choice("aggregator", aggregator, [*sorted(AGGREGATORS), "auto"])
    if aggregator == "allreduce" and not built.summable_across_ranks:
        raise ValueError(
            f"aggregator='allreduce' sums compressed codes across ranks, which {built!r} cannot do "
            "as configured (TernGrad needs share_scale=True); use aggregator='allgather' or 'auto'"
        )
    if aggregator == "two_phase" and not getattr(built, "block_aligned", False):
        raise ValueError(
            f"aggregator='two_phase' cuts each payload at block boundaries for the ranks that own the slices, and "
            f"{built!r} is not block-aligned; use compressor='int8' or 'fp8'"
        )
    if aggregator == "allgather_choosers" and not built.selects_entries:
        raise ValueError(
            f"aggregator='allgather_choosers' averages each index over the ranks that chose it, and {built!r} sends no "
            "chosen entries; use a selecting compressor (topk, chunked_topk, gaussiank, randomk) or 'allgather'"
        )
    if aggregator in ("allgather", "allgather_choosers", "gtopk") and not built.gatherable:
        raise ValueError(
            f"aggregator={aggregator!r} gathers each rank's payload bytes, but {built!r} is summed over "
            "ranks in rounds (each computed from the last one's sum); use aggregator='allreduce' or 'auto'"
        )
    kept = build_memory(memory, **memory_args)
    if getattr(kept, "momentum", 0.0) and not hasattr(built, "density"):
        raise ValueError(
            f"memory_kwargs={{'momentum': {kept.momentum}}} is DGC's momentum correction for "
            f"sparsifiers (topk, gaussiank, dgc); {built!r} does not sparsify"
        )
    return built, kept
