"""``CompressionMonitor``: what compression saves and what it costs, logged while training runs.

Every number comes from the hook's per-step record (:class:`~lightning_gradcomp.core.stats.StepStats`):
bytes are those the comm layer counted as handed to collectives (padding and size exchanges
included), never a formula, so the logged compression ratio is the measured one.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, fields
from typing import Any

import lightning.pytorch as pl
from rich.console import Console
from rich.table import Table

from lightning_gradcomp.callbacks._common import (
    gather_vectors,
    log_to_loggers,
    new_steps,
    recorder_of,
    require_recording_strategy,
)
from lightning_gradcomp.core.stats import StepStats
from lightning_gradcomp.core.validation import check_bool, check_int
from lightning_gradcomp.diloco import GradCompDiLoCoStrategy


@dataclass
class _Totals:
    """Sums over a run of steps on one rank (the fields travel to rank 0 as one float64 vector)."""

    steps: float = 0.0
    compressed_steps: float = 0.0
    bytes_sent: float = 0.0
    bytes_received: float = 0.0
    dense_bytes: float = 0.0
    numel: float = 0.0
    numel_compressed: float = 0.0
    selected: float = 0.0
    seconds_compress: float = 0.0
    seconds_communicate: float = 0.0
    seconds_decompress: float = 0.0
    seconds_step: float = 0.0
    nonfinite_units: float = 0.0
    critical_steps: float = 0.0

    def add(self, stats: StepStats) -> None:
        self.steps += 1
        self.compressed_steps += stats.compressed
        self.critical_steps += stats.regime == "critical"
        self.bytes_sent += stats.bytes_sent
        self.bytes_received += stats.bytes_received
        self.dense_bytes += stats.dense_bytes
        self.numel += stats.numel
        self.numel_compressed += stats.numel_compressed
        self.selected += stats.selected
        self.seconds_compress += stats.seconds_compress
        self.seconds_communicate += stats.seconds_communicate
        self.seconds_decompress += stats.seconds_decompress
        self.nonfinite_units += stats.nonfinite_units

    def merge(self, other: _Totals) -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    def vector(self) -> list[float]:
        return [float(getattr(self, f.name)) for f in fields(self)]

    @classmethod
    def from_vector(cls, values: list[float]) -> _Totals:
        return cls(**{f.name: v for f, v in zip(fields(cls), values, strict=True)})


@dataclass
class _LayerTotals:
    """Rank 0's per-layer sums (from ``StepStats.layers``, filled when ``per_layer=True``)."""

    steps: int = 0
    numel: int = 0
    payload_bytes: int = 0
    selected: int = 0
    sparse: bool = False


@dataclass
class RankSummary:
    """One rank's (``rank="0"``, ...) or all ranks' (``rank="all"``) figures over the run.

    ``steps`` are optimizer steps (per rank); bytes are per step, summed over the ranks for
    ``"all"``; ``compression_ratio`` is ``dense_bytes / bytes_sent`` over the same steps;
    ``time_*`` are shares of the measured step time; ``layers`` (``"all"`` only, with
    ``per_layer=True``) holds rank 0's per-layer payloads.
    """

    rank: str
    steps: int
    compressed_steps: int
    bytes_sent: float
    bytes_received: float
    dense_bytes: float
    compression_ratio: float
    bits_per_element: float
    density: float | None
    time_compress: float
    time_communicate: float
    time_decompress: float
    residual_norm: float | None
    layers: dict[str, dict[str, Any]] = field(default_factory=dict)


def _adaptive(recorder: object) -> bool:
    """Whether the recorder's steps follow an adaptive schedule (DiLoCo's outer loop has none)."""
    schedule = getattr(recorder, "schedule", None)
    return bool(schedule is not None and schedule.observes)


def _ratio(num: float, den: float) -> float:
    return num / den if den else math.inf


def _share(part: float, whole: float) -> float:
    return part / whole if whole > 0 else 0.0


class CompressionMonitor(pl.Callback):
    """Logs bytes, compression ratio, density, time shares and residual norm every ``every_n_steps`` steps.

    Every ``every_n_steps`` optimizer steps (and once more at the end of training for the steps
    left over) each rank sums the hook's :class:`~lightning_gradcomp.core.stats.StepStats` of the steps
    since the last log, the ranks' sums are gathered to rank 0 (one small ``all_gather``), and
    rank 0 writes to every logger of the trainer (values per step, averaged over the window):

    - ``gradcomp/bytes_sent``: bytes handed to collectives by all ranks together;
      ``gradcomp/bytes_sent_rank{r}`` per rank (with ``per_rank=True``); ``gradcomp/bytes_received``;
    - ``gradcomp/dense_bytes``: what plain DDP hands to allreduce for the same buckets, all ranks;
    - ``gradcomp/compression_ratio``: ``dense_bytes / bytes_sent`` (the counted bytes, so the
      ratio includes every overhead: indices, scalers, size exchanges, padding);
    - ``gradcomp/bits_per_element``: ``8 * bytes_sent / elements``, all ranks;
    - ``gradcomp/density``: entries sent over entries compressed (sparse payloads only);
    - ``gradcomp/critical_fraction``: under adaptive compression (``adaptive="accordion"``), the share
      of the window's steps in a critical regime (compressed less, or dense);
    - ``gradcomp/time_compress``, ``gradcomp/time_communicate``, ``gradcomp/time_decompress``:
      shares of the step time (``on_train_batch_start`` to ``on_train_batch_end``, forward,
      backward and optimizer included), summed over ranks; ``gradcomp/step_seconds``, that step
      time itself (mean over ranks);
    - ``gradcomp/residual_norm``: the L2 norm of every rank's memory state taken as one vector
      (error-feedback residuals, DIANA's ``h_i``), when the memory has state.

    Under :class:`~lightning_gradcomp.GradCompDiLoCoStrategy` every inner step is a step: those between two
    synchronisations send nothing and the synchronisation's bytes fall on its step, so the logged bytes are per
    inner step and the ratio is plain DDP's bytes over DiLoCo's, per inner step (``gradcomp/residual_norm``: the
    memory of a compressed outer exchange). Choose ``every_n_steps`` a multiple of ``sync_every``: a window without a
    synchronisation sent nothing (its ratio is infinite). Under :class:`~lightning_gradcomp.GradCompHSDPStrategy` a
    step's bytes are those of every unit's shard exchanged between the replicas, ``dense_bytes`` what FSDP2's own HSDP
    all-reduces there, and ``per_layer=True`` shows one row per FSDP unit.

    With ``progress_bar=True`` rank 0's compression ratio of the latest step is logged as
    ``comp_ratio`` with ``prog_bar=True`` (shown by ``TQDMProgressBar`` and ``RichProgressBar``)
    every ``progress_bar_every_n_steps`` steps; the bar keeps showing the last value in between.
    (``LightningModule.log`` costs about a millisecond on a busy CPU: once a step would be most
    of this callback's cost.)
    At the end of ``fit`` rank 0 prints a rich table of the run per rank and in total, and with
    ``per_layer=True`` (which turns on the hook's per-layer records) one row per compressed layer.
    The same numbers stay in :attr:`summary` on every rank.

    Args:
        every_n_steps: optimizer steps between logs (integer >= 1).
        per_layer: record and print per-layer payload sizes (rank 0's view).
        per_rank: log each rank's bytes sent besides the total.
        progress_bar: show the live compression ratio in the progress bar.
        progress_bar_every_n_steps: optimizer steps between progress bar updates (integer >= 1).
        print_summary: print the end-of-fit table on rank 0.
        prefix: prefix of the logged metric names.
    """

    def __init__(
        self,
        every_n_steps: int = 50,
        per_layer: bool = False,
        per_rank: bool = True,
        progress_bar: bool = True,
        progress_bar_every_n_steps: int = 10,
        print_summary: bool = True,
        prefix: str = "gradcomp/",
    ) -> None:
        self.every_n_steps = check_int("every_n_steps", every_n_steps, 1)
        self.progress_bar_every_n_steps = check_int("progress_bar_every_n_steps", progress_bar_every_n_steps, 1)
        for name, value in (
            ("per_layer", per_layer),
            ("per_rank", per_rank),
            ("progress_bar", progress_bar),
            ("print_summary", print_summary),
        ):
            check_bool(name, value)
        if not isinstance(prefix, str):
            raise ValueError(f"prefix must be a string, got {prefix!r}")
        self.per_layer = per_layer
        self.per_rank = per_rank
        self.progress_bar = progress_bar
        self.print_summary = print_summary
        self.prefix = prefix
        self.summary: list[RankSummary] = []
        #: the output layer the strategy averaged densely (``keep_last_layer_dense``), shown under the table
        self.output_layer: list[str] | None = None
        self._reset()

    def _reset(self) -> None:
        self._last_step = -1
        self._run = _Totals()
        self._layers: dict[str, _LayerTotals] = {}
        self._element_size: dict[str, int] = {}
        self._batch_start: float | None = None
        self._window_seconds = 0.0

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Check that the strategy records steps: a :class:`~lightning_gradcomp.GradCompStrategy`, a
        :class:`~lightning_gradcomp.GradCompDiLoCoStrategy` or a :class:`~lightning_gradcomp.GradCompHSDPStrategy`."""
        require_recording_strategy(trainer, type(self).__name__)
        if self.per_layer and isinstance(trainer.strategy, GradCompDiLoCoStrategy):
            raise ValueError(
                "CompressionMonitor(per_layer=True) prints the DDP hook's per-layer payloads; DiLoCo's outer loop "
                "records whole synchronisations: use per_layer=False"
            )

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._reset()
        self.summary = []
        hook = recorder_of(trainer)
        if self.per_layer:
            hook.track_layers = True
        self._element_size = {name: p.element_size() for name, p in pl_module.named_parameters()}
        if hook.last_step is not None:
            self._last_step = hook.last_step.step

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._batch_start = time.perf_counter()

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._batch_start is not None:
            self._window_seconds += time.perf_counter() - self._batch_start
            self._batch_start = None
        hook = recorder_of(trainer)
        last = hook.last_step
        if last is None or last.step == self._last_step:
            return  # no optimizer step finished in this batch (gradient accumulation)
        if self.progress_bar and (last.step + 1) % self.progress_bar_every_n_steps == 0:
            pl_module.log("comp_ratio", last.compression_ratio, prog_bar=True, logger=False, batch_size=1)
        if (last.step + 1) % self.every_n_steps == 0:
            self._flush(trainer, pl_module)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._flush(trainer, pl_module)
        hook = recorder_of(trainer)
        norm = hook.memory.norm()
        local = [*self._run.vector(), -1.0 if norm is None else norm**2]
        gathered = gather_vectors(trainer, pl_module, local)
        per_rank = [(_Totals.from_vector(row[:-1]), row[-1]) for row in gathered]
        total = _Totals()
        for totals, _ in per_rank:
            total.merge(totals)
        norms = [sq for _, sq in per_rank]
        total_norm = math.sqrt(sum(norms)) if all(sq >= 0 for sq in norms) else None
        self.summary = [
            self._summarise(str(rank), totals, math.sqrt(sq) if sq >= 0 else None, 1)
            for rank, (totals, sq) in enumerate(per_rank)
        ]
        self.summary.append(self._summarise("all", total, total_norm, len(per_rank)))
        self.summary[-1].layers = self._layer_rows()
        self.output_layer = getattr(trainer.strategy, "output_layer", None)
        if self.print_summary and trainer.is_global_zero:
            console = Console()
            console.print(self.summary_table())
            if self.per_layer:
                console.print(self.layer_table())

    def _flush(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Sum the steps since the last flush, gather the sums to every rank, log on rank 0."""
        hook = recorder_of(trainer)
        steps = new_steps(hook, self._last_step)
        window = _Totals()
        for stats in steps:
            window.add(stats)
            for name, layer in stats.layers.items():
                totals = self._layers.setdefault(name, _LayerTotals())
                totals.steps += 1
                totals.numel += layer.numel
                totals.payload_bytes += layer.payload_bytes
                if layer.selected is not None:
                    totals.sparse = True
                    totals.selected += layer.selected
        window.seconds_step = self._window_seconds
        self._window_seconds = 0.0
        if steps:
            self._last_step = steps[-1].step
        norm = hook.memory.norm()
        local = [*window.vector(), -1.0 if norm is None else norm**2]
        gathered = gather_vectors(trainer, pl_module, local)
        self._run.merge(window)
        if not trainer.is_global_zero:
            return
        per_rank = [_Totals.from_vector(row[:-1]) for row in gathered]
        if not per_rank or per_rank[0].steps == 0:
            return
        metrics = self._metrics(per_rank, [row[-1] for row in gathered], _adaptive(hook))
        log_to_loggers(trainer, metrics, trainer.global_step)

    def _metrics(self, per_rank: list[_Totals], norm_squares: list[float], adaptive: bool) -> dict[str, float]:
        total = _Totals()
        for totals in per_rank:
            total.merge(totals)
        steps = per_rank[0].steps
        p = self.prefix
        metrics = {
            f"{p}bytes_sent": total.bytes_sent / steps,
            f"{p}bytes_received": total.bytes_received / steps,
            f"{p}dense_bytes": total.dense_bytes / steps,
            f"{p}compression_ratio": _ratio(total.dense_bytes, total.bytes_sent),
            f"{p}bits_per_element": _share(8.0 * total.bytes_sent, total.numel),
            f"{p}time_compress": _share(total.seconds_compress, total.seconds_step),
            f"{p}time_communicate": _share(total.seconds_communicate, total.seconds_step),
            f"{p}time_decompress": _share(total.seconds_decompress, total.seconds_step),
            f"{p}step_seconds": total.seconds_step / total.steps,
        }
        if self.per_rank:
            for rank, totals in enumerate(per_rank):
                metrics[f"{p}bytes_sent_rank{rank}"] = totals.bytes_sent / totals.steps
        if total.selected and total.numel_compressed:
            metrics[f"{p}density"] = total.selected / total.numel_compressed
        if adaptive:
            metrics[f"{p}critical_fraction"] = total.critical_steps / total.steps
        if all(sq >= 0 for sq in norm_squares):
            metrics[f"{p}residual_norm"] = math.sqrt(sum(norm_squares))
        return metrics

    def _summarise(self, rank: str, t: _Totals, norm: float | None, ranks: int) -> RankSummary:
        """Per-step figures of ``ranks`` ranks' totals ``t``: bytes are summed over the ranks."""
        steps = max(t.steps / ranks, 1.0)
        return RankSummary(
            rank=rank,
            steps=int(t.steps / ranks),
            compressed_steps=int(t.compressed_steps / ranks),
            bytes_sent=t.bytes_sent / steps,
            bytes_received=t.bytes_received / steps,
            dense_bytes=t.dense_bytes / steps,
            compression_ratio=_ratio(t.dense_bytes, t.bytes_sent),
            bits_per_element=_share(8.0 * t.bytes_sent, t.numel),
            density=t.selected / t.numel_compressed if t.selected and t.numel_compressed else None,
            time_compress=_share(t.seconds_compress, t.seconds_step),
            time_communicate=_share(t.seconds_communicate, t.seconds_step),
            time_decompress=_share(t.seconds_decompress, t.seconds_step),
            residual_norm=norm,
        )

    def _layer_rows(self) -> dict[str, dict[str, Any]]:
        rows = {}
        for name, t in self._layers.items():
            element_size = sum(self._element_size.get(part, 4) for part in name.split("+")) / len(name.split("+"))
            dense = t.numel * element_size
            rows[name] = {
                "numel": t.numel // max(t.steps, 1),
                "payload_bytes": t.payload_bytes / max(t.steps, 1),
                "dense_bytes": dense / max(t.steps, 1),
                "compression_ratio": _ratio(dense, t.payload_bytes),
                "density": t.selected / t.numel if t.sparse and t.numel else None,
            }
        return rows

    def summary_table(self, max_ranks: int = 8) -> Table:
        """The end-of-fit table (call after ``fit``): one column per rank (up to ``max_ranks``) and one for all."""
        shown = [s for s in self.summary if s.rank == "all" or len(self.summary) - 1 <= max_ranks]
        table = Table(title="Gradient compression, per optimizer step")
        if self.output_layer is not None:
            table.caption = f"output layer averaged densely: {', '.join(self.output_layer) or 'frozen (none)'}"
        table.add_column("")
        for s in shown:
            table.add_column("all ranks" if s.rank == "all" else f"rank {s.rank}", justify="right")
        rows: list[tuple[str, Any]] = [
            ("steps (compressed)", lambda s: f"{s.steps} ({s.compressed_steps})"),
            ("bytes sent", lambda s: _bytes(s.bytes_sent)),
            ("bytes received", lambda s: _bytes(s.bytes_received)),
            ("dense bytes (plain DDP)", lambda s: _bytes(s.dense_bytes)),
            ("compression ratio", lambda s: f"{s.compression_ratio:.2f}x"),
            ("bits per element", lambda s: f"{s.bits_per_element:.3f}"),
            ("density", lambda s: "-" if s.density is None else f"{s.density:.4g}"),
            ("time: compress", lambda s: f"{100 * s.time_compress:.1f}%"),
            ("time: communicate", lambda s: f"{100 * s.time_communicate:.1f}%"),
            ("time: decompress", lambda s: f"{100 * s.time_decompress:.1f}%"),
            ("residual norm (end)", lambda s: "-" if s.residual_norm is None else f"{s.residual_norm:.4g}"),
        ]
        for label, cell in rows:
            table.add_row(label, *(cell(s) for s in shown))
        return table

    def layer_table(self) -> Table:
        """Rank 0's per-layer payloads (``per_layer=True``): elements, payload and dense bytes, ratio, density."""
        table = Table(title="Compressed layers (rank 0, per step)")
        for column in ("layer", "elements", "payload", "dense", "ratio", "density"):
            table.add_column(column, justify="left" if column == "layer" else "right")
        layers = self.summary[-1].layers if self.summary else {}
        for name, row in layers.items():
            table.add_row(
                name,
                str(row["numel"]),
                _bytes(row["payload_bytes"]),
                _bytes(row["dense_bytes"]),
                f"{row['compression_ratio']:.1f}x",
                "-" if row["density"] is None else f"{row['density']:.4g}",
            )
        return table


def _bytes(n: float) -> str:
    """``n`` bytes in B, kB, MB or GB (powers of 1000)."""
    if abs(n) < 1000:
        return f"{n:.0f} B"
    for unit in ("kB", "MB"):
        n /= 1000
        if abs(n) < 1000:
            return f"{n:.2f} {unit}"
    return f"{n / 1000:.2f} GB"
