"""DiLoCo's synchronisation: the pseudo-gradient averaged over the ranks, applied by an outer optimizer.

Douillard et al., 2023 (arXiv 2311.08105), Algorithm 1: every rank keeps the weights of the last synchronisation
``theta_prev`` and takes ``H`` inner optimizer steps that exchange nothing; then the pseudo-gradient
``delta = theta_prev - theta_local`` is averaged over the ranks and applied to ``theta_prev`` by the outer
optimizer (SGD with Nesterov momentum; the paper's outer lr 0.7 and momentum 0.9), and every rank goes on from
the result. The inner optimizer's state carries on across synchronisations.

The order of the operations follows torchft's ``DiLoCo`` (``torchft.local_sgd``, 0.2.0), so that the two agree
bit for bit on two ranks: the pseudo-gradient in the parameters' dtype, summed over the ranks and divided by their
number in place; the parameters put back to ``theta_prev``; the average set as their gradient; the outer step;
the result kept as the next ``theta_prev``; the gradients dropped. Tensors of one dtype travel in one allreduce
(torchft sends each parameter on its own; on two ranks the sums are the same element by element, on more gloo may
add the ranks in another order).

Given a ``compressor``, the pseudo-gradient is averaged through it instead, with a ``memory`` (error feedback, with
SparseLoCo's decay; DIANA) and an aggregator (:class:`~lightning_gradcomp.core.flat_average.CompressedAverage`):
SparseLoCo (Sarfi et al., 2025, arXiv 2508.15706) is Top-k with 2-bit values under error feedback with decay, and a
plain outer SGD step (no momentum) of lr 1. Every inner step leaves a :class:`~lightning_gradcomp.core.stats.StepStats`
in :attr:`OuterSync.history`: no bytes between synchronisations, the synchronisation's counted bytes at its step,
against what plain DDP would send every step (``dense_bytes``), so a window's ratio is the saving per inner step.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_gradcomp.core.comm import Aggregator, Collectives, CommCounter
from lightning_gradcomp.core.compressors import Compressor
from lightning_gradcomp.core.flat_average import CompressedAverage, check_flat_compressor
from lightning_gradcomp.core.memory import Memory, NoMemory
from lightning_gradcomp.core.pipeline_arguments import aggregator_name, build_pipeline
from lightning_gradcomp.core.stats import StepStats
from lightning_gradcomp.core.validation import check_bool, check_int, check_number

__all__ = ["OuterSync", "check_anchor", "check_exchange_arguments", "check_outer_arguments"]


def check_outer_arguments(sync_every: int, outer_lr: float, outer_momentum: float, nesterov: bool) -> None:
    """``ValueError`` naming the first of DiLoCo's outer arguments out of range (where they enter: ``OuterSync``
    and the strategy)."""
    check_int("sync_every", sync_every, 1)
    check_number("outer_lr", outer_lr, 0, float("inf"), open_min=True, open_max=True)
    check_number("outer_momentum", outer_momentum, 0, 1, open_max=True)
    check_bool("nesterov", nesterov)
    if nesterov and not outer_momentum:
        raise ValueError("nesterov=True needs outer_momentum > 0; pass nesterov=False for plain outer SGD")


def check_exchange_arguments(
    compressor: str | Compressor | None,
    compressor_kwargs: dict[str, Any] | None,
    density: float | None,
    wire_precision: str | None,
    memory: str,
    memory_kwargs: dict[str, Any] | None,
    aggregator: str | Aggregator,
    min_compress_numel: int,
    seed: int,
) -> tuple[Compressor, Memory] | None:
    """The compressed exchange's compressor and memory (``None``: the dense average), or a ``ValueError`` naming the
    first argument out of range or refused by another (as the DDP strategies refuse them)."""
    check_int("min_compress_numel", min_compress_numel, 0)
    check_int("seed", seed, 0)
    if compressor is None:
        given = (
            compressor_kwargs,
            density,
            wire_precision,
            memory,
            memory_kwargs,
            aggregator,
            min_compress_numel,
            seed,
        )
        if given != (None, None, None, "none", None, "auto", 0, 0):
            raise ValueError(
                "compressor_kwargs, density, wire_precision, memory, memory_kwargs, aggregator, min_compress_numel and "
                "seed configure a compressed exchange; pass compressor= too (without one the pseudo-gradient is "
                "averaged densely)"
            )
        return None
    name = aggregator_name(aggregator)
    built = build_pipeline(compressor, compressor_kwargs, density, wire_precision, memory, memory_kwargs, name)
    codec = built[0]
    check_flat_compressor(codec, "DiLoCo's exchange", name, shapes_known=True)
    return built


def check_anchor(saved: Mapping[str, Tensor], trained: Mapping[str, Tensor]) -> None:
    """``ValueError`` unless a saved ``theta_prev`` holds the parameters ``trained`` (name: tensor), with their shapes
    and dtypes."""
    theirs = {name: (tuple(t.shape), t.dtype) for name, t in saved.items()}
    here = {name: (tuple(t.shape), t.dtype) for name, t in trained.items()}
    if theirs != here:
        raise ValueError(f"the saved DiLoCo state has theta_prev for {theirs}, this model trains {here}")


class OuterSync:
    """DiLoCo's outer loop for ``parameters``: call :meth:`step` after each inner optimizer step.

    Every rank starts from rank 0's trained parameters (broadcast once here; the strategies broadcast the whole
    module, frozen parameters and buffers too, as DDP does), so the ranks agree however they were initialised.
    Without an initialised process group it runs alone (the average of one rank is its own).

    Args:
        parameters: the model's ``(name, parameter)`` pairs (``named_parameters()``) on their devices; frozen ones
            are left alone, and which are trained must not change afterwards.
        sync_every: inner steps between two synchronisations (``H``, at least 1).
        outer_lr: the outer optimizer's learning rate (> 0).
        outer_momentum: its momentum, in [0, 1).
        nesterov: Nesterov momentum (the paper's), which needs ``outer_momentum > 0``.
        group: the process group of the ranks (default: the world).
        compressor: ``None`` (the default) averages the pseudo-gradient densely, as the paper and torchft do; a
            compressor's registry name or instance averages it compressed, with ``compressor_kwargs``,
            ``density``, ``wire_precision`` (``"fp16"``, ``"bf16"``, ``"2bit"``), ``memory`` (``"none"``,
            ``"ef"``, ``"diana"``) with ``memory_kwargs`` (error feedback's ``decay``: SparseLoCo's ``beta``), and
            ``aggregator``, validated as the DDP strategies validate them.
        min_compress_numel: parameters with fewer elements are averaged densely (compressed exchange only).
        seed: base seed of the compressor's random streams, a function of (seed, rank, synchronisation, unit).
        history: how many inner steps' :class:`~lightning_gradcomp.core.stats.StepStats` to keep.
    """

    def __init__(
        self,
        parameters: Iterable[tuple[str, nn.Parameter]],
        sync_every: int,
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        nesterov: bool = True,
        group: torch.distributed.ProcessGroup | None = None,
        *,
        compressor: str | Compressor | None = None,
        compressor_kwargs: dict[str, Any] | None = None,
        density: float | None = None,
        wire_precision: str | None = None,
        memory: str = "none",
        memory_kwargs: dict[str, Any] | None = None,
        aggregator: str | Aggregator = "auto",
        min_compress_numel: int = 0,
        seed: int = 0,
        history: int = 1000,
    ) -> None:
        check_outer_arguments(sync_every, outer_lr, outer_momentum, nesterov)
        check_int("history", history, 1)
        built = check_exchange_arguments(
            compressor, compressor_kwargs, density, wire_precision, memory, memory_kwargs, aggregator,
            min_compress_numel, seed,
        )  # fmt: skip
        self.sync_every = sync_every
        named = list(parameters)
        self._parameters = [(name, p) for name, p in named if p.requires_grad]
        self._frozen = [(name, p) for name, p in named if not p.requires_grad]
        if not self._parameters:
            raise ValueError("parameters holds no trainable parameter: there is nothing to synchronise")
        #: counts the bytes of every synchronisation, over the whole run (each one's are in its step's record)
        self.counter = CommCounter()
        self.collectives = Collectives(group, self.counter) if dist.is_available() and dist.is_initialized() else None
        if self.collectives is not None and self.collectives.world_size > 1:
            source = dist.get_global_rank(group, 0) if group is not None else 0
            with torch.no_grad():
                for _, p in self._parameters:
                    dist.broadcast(p.data, src=source, group=group)
        #: the weights at the last synchronisation (``theta_prev``), kept once for the whole run
        self.anchor = {name: p.detach().clone() for name, p in self._parameters}
        self.outer = torch.optim.SGD(
            [p for _, p in self._parameters], lr=outer_lr, momentum=outer_momentum, nesterov=nesterov
        )
        self.inner_steps = 0
        self._flats, self._deltas = self._flat_by_kind()
        #: the compressed exchange (``None``: dense, as torchft)
        self.exchange: CompressedAverage | None = None
        if built is not None:
            shapes = {name: p.shape for name, p in self._parameters}
            self.exchange = CompressedAverage(*built, aggregator, self.collectives, seed, min_compress_numel, shapes)
        #: this rank's state between synchronisations (error feedback's residuals, DIANA's shifts)
        self.memory: Memory = built[1] if built is not None else NoMemory()
        #: one record per inner step, the latest last
        self.history: deque[StepStats] = deque(maxlen=history)
        self._numel = sum(p.numel() for _, p in self._parameters)
        self._dense_bytes = sum(p.numel() * p.element_size() for _, p in self._parameters)
        self._steps = self._synchronisations = 0

    def totals(self) -> tuple[int, int, int, int]:
        """``(inner steps, bytes sent, dense bytes, synchronisations)`` since this object was built: whole-run figures
        whatever ``history`` keeps (``dense_bytes`` is what DDP would have sent over those steps)."""
        return self._steps, self.counter.bytes_sent, self._steps * self._dense_bytes, self._synchronisations

    @property
    def last_step(self) -> StepStats | None:
        """The latest inner step's record (``None`` before the first)."""
        return self.history[-1] if self.history else None

    def _flat_by_kind(self) -> tuple[list[Tensor], dict[str, Tensor]]:
        """A flat pseudo-gradient buffer per (device, dtype), allocated once, and each parameter's view of it."""
        by_kind: dict[tuple[torch.device, torch.dtype], list[tuple[str, nn.Parameter]]] = {}
        for name, p in self._parameters:
            by_kind.setdefault((p.device, p.dtype), []).append((name, p))
        flats, views = [], {}
        for (device, dtype), named in by_kind.items():
            flat = torch.empty(sum(p.numel() for _, p in named), dtype=dtype, device=device)
            for (name, p), part in zip(named, flat.split([p.numel() for _, p in named]), strict=True):
                views[name] = part.view_as(p)
            flats.append(flat)
        return flats, views

    def step(self) -> bool:
        """Count an inner step; every ``sync_every``-th, synchronise. Returns whether it did."""
        self.inner_steps += 1
        self._steps += 1
        stats = StepStats(step=self.inner_steps - 1, numel=self._numel, dense_bytes=self._dense_bytes)
        self.history.append(stats)
        if self.inner_steps % self.sync_every:
            return False
        before = self.counter.copy()  # the counter runs on over the whole run: this synchronisation's is the rest
        self.synchronise(stats)
        self._synchronisations += 1
        stats.synchronised = True
        stats.compressed = self.exchange is not None
        counted = self.counter.since(before)
        stats.take_counts(counted)
        if self.exchange is None:
            stats.seconds_communicate = counted.seconds
        return True

    @torch.no_grad()
    def synchronise(self, stats: StepStats | None = None) -> None:
        """Average the pseudo-gradients and take the outer step from ``theta_prev`` (every rank alike); ``stats``,
        when given, counts what the compressed exchange compressed and how long it took. :meth:`step` calls it
        every ``sync_every``-th inner step (and records it); the random streams follow that count."""
        changed = sorted(name for name, p in self._parameters if not p.requires_grad)
        if changed:
            raise RuntimeError(
                f"parameters {changed} were frozen after OuterSync was built, and its outer momentum would still move "
                "them; build a new OuterSync for the parameters trained now"
            )
        thawed = sorted(name for name, p in self._frozen if p.requires_grad)
        if thawed:
            raise RuntimeError(
                f"parameters {thawed} were unfrozen after OuterSync was built and would train apart on every rank, "
                "never averaged; build a new OuterSync for the parameters trained now"
            )
        for name, p in self._parameters:  # delta = theta_prev - theta_local, in the parameter's dtype
            torch.sub(self.anchor[name], p, out=self._deltas[name])
        if self.exchange is not None:
            synchronisation = self.inner_steps // self.sync_every - 1
            deltas = [(name, self._deltas[name].view(-1)) for name, _ in self._parameters]
            self.exchange.average_(deltas, synchronisation, stats if stats is not None else StepStats(step=-1))
        elif self.collectives is not None:
            world = self.collectives.world_size
            for flat in self._flats:
                self.collectives.all_reduce_(flat)
                flat.div_(world)
        for name, p in self._parameters:
            p.copy_(self.anchor[name])
            p.grad = self._deltas[name]
        self.outer.step()
        for name, p in self._parameters:
            self.anchor[name].copy_(p)
        self.outer.zero_grad(set_to_none=True)

    def state_dict(self) -> dict:
        """What a resumed run needs: the inner step count, ``theta_prev`` and the outer optimizer's state (every rank
        holds the same), and this rank's memory (its own)."""
        return {
            "inner_steps": self.inner_steps,
            "anchor": {name: t.detach().to("cpu", copy=True) for name, t in self.anchor.items()},
            "outer": self.outer.state_dict(),
            "memory": {name: t.detach().to("cpu", copy=True) for name, t in self.memory.state_dict().items()},
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`'s output."""
        check_anchor(state["anchor"], self.anchor)
        self.inner_steps = int(state["inner_steps"])
        for name, value in state["anchor"].items():
            self.anchor[name].copy_(value)
        self.outer.load_state_dict(state["outer"])
        device = next(iter(self.anchor.values())).device
        self.memory.load_state_dict({name: t.to(device) for name, t in state.get("memory", {}).items()})
