"""``gradcomp compare``: a recipe run once per strategy, each its own ``gradcomp fit`` process, then one table.

Lightning's DDP launcher re-runs the command line in every rank, so one run per command is the
robust shape. The runs are tabulated against the dense baseline when one ran, and written as
``results.csv``, ``results.json`` and ``accuracy.png``.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lightning.pytorch.strategies import StrategyRegistry

from lightning_gradcomp.cli.catalog import PROG, gradcomp_strategies, registry_help
from lightning_gradcomp.examples.summary import BYTES_FROM_PARAMETERS

#: ``gradcomp compare --strategies`` entry that keeps the recipe's own strategy.
RECIPE_STRATEGY = "recipe"
_COLORS = (
    "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf",
)  # fmt: skip
_LINESTYLES = ("-", "--", "-.", ":")  # identical runs (ddp and ddp_gradcomp_dense) stay visible on top of each other


def parse_strategies(spec: str) -> list[str]:
    """The comma-separated strategy names of ``--strategies``, checked against Lightning's registry."""
    names = [name.strip() for name in spec.split(",") if name.strip()]
    if not names:
        raise ValueError(f"--strategies must name at least one strategy, got {spec!r}")
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise ValueError(f"--strategies names {duplicates} more than once")
    known = set(StrategyRegistry.available_strategies()) | {RECIPE_STRATEGY}
    unknown = [name for name in names if name not in known]
    if unknown:
        allowed = ["ddp", *gradcomp_strategies(), RECIPE_STRATEGY]
        raise ValueError(f"--strategies: unknown strategy {', '.join(map(repr, unknown))}; registered: {allowed}")
    return names


def fit_command(config: Path, strategy: str, run_dir: Path, overrides: Sequence[str]) -> list[str]:
    """The ``gradcomp fit`` command line of one comparison run (as ``python -m lightning_gradcomp.cli``)."""
    command = [sys.executable, "-m", "lightning_gradcomp.cli", "fit", "--config", str(config)]
    if strategy != RECIPE_STRATEGY:
        command.append(f"--trainer.strategy={strategy}")
    command += [
        f"--trainer.default_root_dir={run_dir}",
        f"--summary.path={run_dir / 'summary.json'}",
        *overrides,
    ]
    return command


def _run(command: list[str], log: Path, timeout: float | None) -> int:
    """Run ``command`` in its own session, output to ``log``; on timeout, end its whole process group."""
    with log.open("w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            return process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            out.write(f"\n{PROG} compare: killed after {timeout} s\n")
            return -signal.SIGKILL


def run_comparison(
    config: Path, strategies: Sequence[str], out_dir: Path, overrides: Sequence[str] = (), timeout: float | None = None
) -> list[dict[str, Any]]:
    """Fit the recipe ``config`` once per strategy (one process tree each); one record per run.

    A record holds the strategy, exit status, wall time (process start to exit, imports and
    process launch included), the log file, and the run's :class:`RunSummary` (``None`` if the
    run failed before writing it).
    """
    records = []
    for i, strategy in enumerate(strategies, start=1):
        run_dir = out_dir / "runs" / strategy
        run_dir.mkdir(parents=True, exist_ok=True)
        summary_path = run_dir / "summary.json"
        summary_path.unlink(missing_ok=True)
        log = run_dir / "log.txt"
        print(f"[{i}/{len(strategies)}] {strategy}: fitting (log: {log})", flush=True)
        start = time.perf_counter()
        returncode = _run(fit_command(config, strategy, run_dir, overrides), log, timeout)
        wall = time.perf_counter() - start
        summary = json.loads(summary_path.read_text()) if summary_path.is_file() else None
        if returncode != 0 or summary is None:
            tail = "".join(log.read_text(errors="replace").splitlines(keepends=True)[-15:])
            print(f"[{i}/{len(strategies)}] {strategy}: failed (exit status {returncode}); end of its log:\n{tail}")
        records.append(
            {
                "strategy": strategy,
                "returncode": returncode,
                "ok": returncode == 0 and summary is not None,
                "wall_seconds": wall,
                "log": str(log),
                "summary": summary,
            }
        )
    return records


#: Columns of ``results.csv`` (and of the printed table, with the units spelled out there).
CSV_COLUMNS = (
    "strategy",
    "ok",
    "val_acc",
    "val_loss",
    "bytes_sent_per_step",
    "dense_bytes_per_step",
    "compression_ratio",
    "bytes_source",
    "compressed_steps",
    "exchange_steps",
    "global_step",
    "fit_seconds",
    "wall_seconds",
)


def result_rows(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One flat row per run with the :data:`CSV_COLUMNS` (``None`` where a failed run has no value)."""
    rows = []
    for record in records:
        summary = record["summary"] or {}
        row = {column: summary.get(column) for column in CSV_COLUMNS}
        row.update(strategy=record["strategy"], ok=record["ok"], wall_seconds=record["wall_seconds"])
        rows.append(row)
    return rows


#: Strategies ``compare`` treats as the dense baseline, in order of preference.
DENSE_BASELINES = ("ddp", "ddp_gradcomp_dense")


def comparison_table(rows: Sequence[dict[str, Any]], title: str) -> Any:
    """The rich table ``gradcomp compare`` prints.

    When a dense baseline (:data:`DENSE_BASELINES`) ran, every other run also shows what a user
    judges it by: its accuracy against the baseline's (points), the bytes it saved over the run, and
    its fit time as a multiple of the baseline's (on this machine's links, not a slow one).
    """
    from rich.table import Table

    ok = {row["strategy"]: row for row in rows if row["ok"]}
    baseline = next((ok[name] for name in DENSE_BASELINES if name in ok), None)
    table = Table(title=title)
    columns = ["strategy", "val_acc", "val_loss", "sent B/step", "dense B/step", "ratio", "fit s", "wall s"]
    if baseline is not None:
        columns += [f"acc vs {baseline['strategy']}", "MB saved", f"fit s x {baseline['strategy']}"]
    for column in columns:
        table.add_column(column, justify="left" if column == "strategy" else "right")

    def fmt(value: Any, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    for row in rows:
        if not row["ok"]:
            cells = [row["strategy"], "failed", "", "", "", "", "", fmt(row["wall_seconds"], ".1f")]
            table.add_row(*cells, *([""] * (len(columns) - len(cells))))
            continue
        sent = fmt(row["bytes_sent_per_step"], ",.0f")
        if row["bytes_source"] == BYTES_FROM_PARAMETERS:
            sent += " *"
        ratio = row["compression_ratio"]
        cells = [
            row["strategy"],
            fmt(row["val_acc"], ".4f"),
            fmt(row["val_loss"], ".4f"),
            sent,
            fmt(row["dense_bytes_per_step"], ",.0f"),
            "-" if ratio is None else f"{ratio:.1f}x",
            fmt(row["fit_seconds"], ".1f"),
            fmt(row["wall_seconds"], ".1f"),
        ]
        if baseline is not None:
            cells += _against_baseline(row, baseline) if row is not baseline else ["-", "-", "-"]
        table.add_row(*cells)
    if any(row["ok"] and row["bytes_source"] == BYTES_FROM_PARAMETERS for row in rows):
        table.caption = (
            "* plain DDP: bytes of the gradients it allreduces (trainable parameters), not counted by a hook"
        )
    return table


def _against_baseline(row: dict[str, Any], baseline: dict[str, Any]) -> list[str]:
    """Accuracy difference (points), megabytes saved over the run, fit time as a multiple of the baseline's."""
    accuracy = (
        f"{100 * (row['val_acc'] - baseline['val_acc']):+.2f} pt"
        if row["val_acc"] is not None and baseline["val_acc"] is not None
        else "-"
    )
    sent, dense, steps = row["bytes_sent_per_step"], row["dense_bytes_per_step"], row["exchange_steps"]
    saved = f"{(dense - sent) * steps / 1e6:,.1f}" if None not in (sent, dense, steps) else "-"
    fit, base_fit = row["fit_seconds"], baseline["fit_seconds"]
    time = f"{fit / base_fit:.2f}" if fit and base_fit else "-"
    return [accuracy, saved, time]


def plot_curves(records: Sequence[dict[str, Any]], path: Path, title: str, accuracy: str = "val_acc") -> list[dict]:
    """Plot each run's validation accuracy against the optimizer step into the PNG ``path``.

    Uses matplotlib's object API (no pyplot state, no display needed). Returns one entry per
    curve drawn: strategy, line colour and number of points.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(7.0, 4.5), dpi=120)
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    curves = []
    for i, record in enumerate(r for r in records if r["ok"]):
        points = [p for p in record["summary"]["curve"] if p.get(accuracy) is not None]
        if not points:
            continue
        color = _COLORS[i % len(_COLORS)]
        axes.plot(
            [p["step"] for p in points],
            [p[accuracy] for p in points],
            color=color,
            linestyle=_LINESTYLES[i % len(_LINESTYLES)],
            marker="o",
            markersize=3,
            linewidth=2,
            label=record["strategy"],
        )
        curves.append({"strategy": record["strategy"], "color": color, "points": len(points)})
    axes.set_xlabel("optimizer step")
    axes.set_ylabel(accuracy)
    axes.set_title(title)
    axes.grid(alpha=0.3)
    if curves:
        axes.legend()
    figure.tight_layout()
    figure.savefig(path)
    return curves


def compare_main(argv: Sequence[str]) -> int:
    """``gradcomp compare``: see :func:`run_comparison`; exit status 1 if any run failed."""
    parser = argparse.ArgumentParser(
        prog=f"{PROG} compare",
        description="Fit one recipe once per strategy and compare accuracy, loss, bytes per step and time.",
        epilog=(
            "Any other --key=value option is passed on to every `gradcomp fit` (e.g. --trainer.max_steps=100).\n"
            f"'{RECIPE_STRATEGY}' in --strategies keeps the recipe's own strategy; 'ddp' is Lightning's DDP,\n"
            "whose bytes per step are the gradients it allreduces (the trainable parameters' bytes).\n\n"
            + registry_help().split("\n\ncompressors")[0]
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    parser.add_argument("-c", "--config", required=True, type=Path, help="the recipe (YAML)")
    parser.add_argument(
        "--strategies", required=True, help=f"comma-separated strategy names, e.g. ddp,ddp_topk ('{RECIPE_STRATEGY}')"
    )
    parser.add_argument(
        "--out", type=Path, default=None, help="output directory (default: gradcomp_compare/<recipe name>)"
    )
    parser.add_argument("--timeout", type=float, default=None, help="seconds allowed per run (default: no limit)")
    args, overrides = parser.parse_known_args(list(argv))
    try:
        strategies = parse_strategies(args.strategies)
    except ValueError as err:
        parser.error(str(err))
    if not args.config.is_file():
        parser.error(f"--config: no recipe at {args.config}")
    if args.timeout is not None and not args.timeout > 0:
        parser.error(f"--timeout must be > 0 seconds, got {args.timeout}")
    strays = [o for o in overrides if o.startswith("-") and not o.startswith("--")]
    if strays:
        parser.error(f"unrecognized arguments: {' '.join(strays)}")
    out_dir = args.out or Path("gradcomp_compare") / args.config.stem
    out_dir.mkdir(parents=True, exist_ok=True)

    records = run_comparison(args.config.resolve(), strategies, out_dir, overrides, args.timeout)
    rows = result_rows(records)
    title = f"{args.config.name}: {len(strategies)} strategies"
    with (out_dir / "results.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    plot: dict[str, Any] = {"file": None, "curves": []}
    try:
        plot["curves"] = plot_curves(records, out_dir / "accuracy.png", title)
        plot["file"] = str(out_dir / "accuracy.png")
    except ImportError:
        print(f"{PROG} compare: matplotlib is not installed, no plot (pip install 'lightning-gradcomp[plot]')")
    report = {
        "config": str(args.config),
        "strategies": strategies,
        "overrides": list(overrides),
        "rows": rows,
        "runs": records,
        "plot": plot,
    }
    (out_dir / "results.json").write_text(json.dumps(report, indent=2))

    from rich.console import Console

    console = Console()
    if not console.is_terminal:  # a log file or a pipe: do not wrap the table at 80 columns
        console = Console(width=160)
    console.print(comparison_table(rows, title))
    names = ["results.csv", "results.json", *(["accuracy.png"] if plot["file"] else [])]
    print(f"wrote {', '.join(str(out_dir / name) for name in names)}")
    return 0 if all(record["ok"] for record in records) else 1
