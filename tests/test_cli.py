"""The ``gradcomp`` command: help, short errors for bad recipes, ``compare`` on the quickstart, console script, demo.

Commands that train go through subprocesses (Lightning's DDP launcher re-runs the command line in
each rank); commands that must stop before training run in this process.
"""

from __future__ import annotations

import csv
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from lightning_gradcomp.cli import main
from lightning_gradcomp.cli.catalog import gradcomp_strategies
from lightning_gradcomp.cli.compare import compare_main
from lightning_gradcomp.core.compressors import COMPRESSORS

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "recipes" / "quickstart.yaml"
ENV = dict(os.environ, OMP_NUM_THREADS="1")


def _run(args: list[str], cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=ENV, cwd=cwd)


@pytest.mark.parametrize("argv", [["--help"], []], ids=["--help", "no-arguments"])
def test_help_lists_registered_strategies_and_compressors(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code in (0, None)
    out = capsys.readouterr().out
    presets = [name for name in gradcomp_strategies() if not name.endswith("_find_unused_parameters_true")]
    for name in ("fit", "validate", "compare", *presets, *COMPRESSORS):
        assert re.search(rf"\b{name}\b", out), f"{name!r} missing from gradcomp --help"
    # the presets' DDP variants, one line for all of them
    assert "<preset>_find_unused_parameters_true" in out and "ddp_topk_find_unused_parameters_true" not in out
    usage = out[out.index("usage:") :].splitlines()[0]
    assert "{fit,validate,test,predict,compare,demo,strategies}" in usage
    assert "ddp_topk" in out and "registered strategies" in out and "compressors" in out


def test_gradcomp_strategies_prints_every_registered_name_with_what_it_sends(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["strategies"]) == 0
    out = capsys.readouterr().out
    for name in gradcomp_strategies():
        if not name.endswith("_find_unused_parameters_true"):
            assert re.search(rf"\b{name}\b", out), f"{name!r} missing from gradcomp strategies"
    assert "<DDP preset>_find_unused_parameters_true" in out
    for front_end in ("DDP hook", "DiLoCo", "HSDP"):
        assert front_end in out
    assert re.search(r"ddp_diloco_qsgd\s*│\s*DiLoCo\s*│\s*4\.5 every 500 steps", out)


def _recipe(tmp_path: Path, old: str, new: str) -> Path:
    text = QUICKSTART.read_text()
    assert old in text
    path = tmp_path / "recipe.yaml"
    path.write_text(text.replace(old, new))
    return path


# Every case must fail before training: one process, one step, as a safety net if one did not.
SAFE = ["--trainer.devices=1", "--trainer.max_steps=1"]


@pytest.mark.parametrize(
    ("old", "new", "extra", "expected"),
    [
        ("  max_steps: 300", "  max_stepz: 300", [], "'trainer.max_stepz' (did you mean 'trainer.max_steps'"),
        ("      density: 0.01", "      densty: 0.01", [], "Option 'densty' is not accepted (did you mean 'density'?)"),
        (
            "      density: 0.01",
            "      density: 2.0",
            [],
            "trainer.strategy (lightning_gradcomp.GradCompStrategy): density must be a number in (0, 1], got 2.0",
        ),
        (
            "      compressor: topk",
            "      compressor: topq",
            [],
            "trainer.strategy (lightning_gradcomp.GradCompStrategy): compressor must be one of",
        ),
        ("    hidden: 512", "    hidden: many", [], 'Parser key "model"'),
        ("    lr: 0.05", "    lr: -1", [], "model (lightning_gradcomp.examples.teacher.MLPClassifier): lr must be"),
        ("", "", ["--trainer.strategy=ddp_nope"], "trainer: You selected an invalid strategy name"),
        ("", "", ["--trainer.max_steps=abc"], 'Parser key "trainer.max_steps"'),
    ],
    ids=[
        "typo-key",
        "typo-strategy-argument",
        "bad-density",
        "bad-compressor",
        "bad-type",
        "bad-lr",
        "bad-name",
        "abc",
    ],
)
def test_bad_recipes_give_a_short_error_naming_the_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], old: str, new: str, extra: list[str], expected: str
) -> None:
    recipe = _recipe(tmp_path, old, new) if old else QUICKSTART
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(recipe), *SAFE, *extra])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert expected in err, err
    assert "Traceback" not in err and len(err.splitlines()) <= 3, err


def test_a_missing_data_directory_names_the_path_and_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    recipe = ROOT / "recipes" / "resnet20_cifar10_topk.yaml"
    missing = tmp_path / "cifar"
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(recipe), f"--data.init_args.data_dir={missing}", *SAFE])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "Traceback" not in err
    assert f"data (lightning_gradcomp.examples.cifar.CIFAR10DataModule): CIFAR-10 data: directory {missing}" in err
    assert "data_batch_1, data_batch_2, data_batch_3, data_batch_4, data_batch_5, test_batch" in err


@pytest.mark.parametrize(
    ("strategies", "expected"),
    [
        ("ddp,ddp_nope", "unknown strategy 'ddp_nope'; registered: ['ddp', "),
        ("ddp,ddp", "--strategies names ['ddp'] more than once"),
        (",", "--strategies must name at least one strategy"),
    ],
)
def test_compare_refuses_bad_strategy_lists(capsys: pytest.CaptureFixture[str], strategies: str, expected: str) -> None:
    with pytest.raises(SystemExit) as exit_info:
        compare_main(["--config", str(QUICKSTART), "--strategies", strategies])
    assert exit_info.value.code == 2
    assert expected in capsys.readouterr().err


def _pixels_of(image: np.ndarray, color: str) -> int:
    rgb = np.array([int(color[i : i + 2], 16) for i in (1, 3, 5)]) / 255.0
    return int((np.abs(image[..., :3] - rgb).max(axis=-1) < 0.02).sum())


def test_compare_on_the_quickstart_writes_table_csv_json_and_plot(tmp_path: Path) -> None:
    out = tmp_path / "compare"
    done = _run(
        [
            sys.executable, "-m", "lightning_gradcomp.cli", "compare", "--config", str(QUICKSTART),
            "--strategies", "ddp,ddp_topk", "--out", str(out),
            "--trainer.max_steps=40", "--trainer.val_check_interval=20",
        ],
        cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    ddp_row = re.search(r"│ ddp\s+│\s+([\d.]+) │\s+([\d.]+) │\s+([\d,]+) \* │\s+([\d,]+) │\s+1\.0x │", done.stdout)
    topk_row = re.search(
        r"│ ddp_topk\s+│\s+([\d.]+) │\s+([\d.]+) │\s+([\d,]+) │\s+([\d,]+) │\s+([\d.]+)x │", done.stdout
    )
    assert ddp_row and topk_row, done.stdout
    assert "plain DDP: bytes of the gradients it allreduces" in done.stdout

    with (out / "results.csv").open() as f:
        rows = {row["strategy"]: row for row in csv.DictReader(f)}
    assert set(rows) == {"ddp", "ddp_topk"}
    parameters = (64 * 512 + 512 + 512 * 10 + 10) * 4  # the quickstart MLP's gradients in bytes
    assert rows["ddp"]["bytes_source"] == "parameters" and float(rows["ddp"]["bytes_sent_per_step"]) == parameters
    assert rows["ddp_topk"]["bytes_source"] == "hook" and float(rows["ddp_topk"]["dense_bytes_per_step"]) == parameters
    # 39 compressed steps, all inside the preset's 200-step density warm-up, and the logits layer dense
    assert float(rows["ddp_topk"]["compression_ratio"]) > 2 and rows["ddp_topk"]["compressed_steps"] == "39"
    for row in rows.values():
        assert 0.0 < float(row["val_acc"]) <= 1.0 and float(row["wall_seconds"]) >= float(row["fit_seconds"]) > 0

    report = json.loads((out / "results.json").read_text())
    assert [r["strategy"] for r in report["runs"]] == ["ddp", "ddp_topk"]
    for run in report["runs"]:
        assert [p["step"] for p in run["summary"]["curve"]] == [20, 40]
        assert (Path(run["log"])).is_file()
    try:
        import matplotlib.image
    except ImportError:  # matplotlib is optional: then compare says so and writes no plot
        assert report["plot"] == {"file": None, "curves": []} and "matplotlib is not installed" in done.stdout
        return
    curves = report["plot"]["curves"]
    assert [c["strategy"] for c in curves] == ["ddp", "ddp_topk"] and all(c["points"] == 2 for c in curves)
    assert len({c["color"] for c in curves}) == 2
    image = matplotlib.image.imread(out / "accuracy.png")  # decodes the PNG
    assert image.ndim == 3 and image.shape[0] > 300 and image.shape[1] > 500
    for curve in curves:
        assert _pixels_of(image, curve["color"]) > 50, f"no {curve['color']} line for {curve['strategy']}"
    assert _pixels_of(image, "#2ca02c") == 0  # the third colour: no third curve


def test_console_script_fits_the_quickstart_on_two_processes(tmp_path: Path) -> None:
    script = Path(sys.executable).with_name("gradcomp")
    if not script.is_file():
        pytest.skip(f"the gradcomp console script is not installed next to {sys.executable}")
    summary = tmp_path / "summary.json"
    done = _run(
        [
            str(script), "fit", "--config", str(QUICKSTART), "--trainer.max_steps=10",
            "--trainer.val_check_interval=10", f"--summary.path={summary}",
        ],
        cwd=tmp_path,
    )  # fmt: skip
    assert (tmp_path / "runs" / "quickstart" / "config.yaml").is_file()  # the recipe's default_root_dir
    assert done.returncode == 0, done.stderr[-3000:]
    assert "GradCompStrategy on 2 process(es), 10 steps: TopKCompressor(density=0.01)" in done.stdout
    record = json.loads(summary.read_text())
    # one dense step, then nine at about 6x (the recipe keeps the logits layer dense): 10 / (1 + 9/6) = 4
    assert record["world_size"] == 2 and record["compressed_steps"] == 9 and record["compression_ratio"] > 3.5
    config = yaml.safe_load(QUICKSTART.read_text())
    assert config["trainer"]["devices"] == 2 and config["trainer"]["accelerator"] == "cpu"


def test_bad_demo_arguments_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    for argv, message in (
        (["--density", "0"], "--density must be a number in (0, 1], got 0.0"),
        (["--steps", "0"], "--steps must be an integer >= 1, got 0"),
        (["--devices", "-1"], "--devices must be an integer >= 1, got -1"),
    ):
        with pytest.raises(SystemExit):
            main(["demo", *argv])
        assert message in capsys.readouterr().err


def test_demo_trains_on_two_processes_and_reports_the_saving(tmp_path: Path) -> None:
    done = _run(
        [sys.executable, "-m", "lightning_gradcomp.cli", "demo", "--steps", "40", "--density", "0.01"], cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr[-3000:]
    row = re.search(r"│\s+([\d.]+) │\s+([\d,]+) │\s+([\d,]+) │\s+([\d.]+)x │", done.stdout)
    assert row, done.stdout
    accuracy, sent, dense, ratio = row.groups()
    assert 0.0 < float(accuracy) <= 1.0
    assert int(sent.replace(",", "")) * 20 < int(dense.replace(",", ""))
    assert float(ratio) > 20


def _row(strategy: str, acc: float | None, sent: float, fit: float, source: str = "hook", ok: bool = True) -> dict:
    return {"strategy": strategy, "ok": ok, "val_acc": acc, "val_loss": 0.5, "bytes_sent_per_step": sent,
            "dense_bytes_per_step": 1_000_000.0, "compression_ratio": 1_000_000.0 / sent, "bytes_source": source,
            "exchange_steps": 300, "fit_seconds": fit, "wall_seconds": fit + 5}  # fmt: skip


def test_compare_table_shows_each_run_against_the_dense_baseline() -> None:
    from rich.console import Console

    from lightning_gradcomp.cli.compare import comparison_table

    rows = [_row("ddp", 0.8765, 1_000_000.0, 4.0, source="parameters"), _row("ddp_topk", 0.8615, 20_000.0, 5.0),
            _row("ddp_atomo", None, 1.0, 0.0, ok=False)]  # fmt: skip
    console = Console(record=True, width=300)
    console.print(comparison_table(rows, "t"))
    text = console.export_text()
    topk = next(line for line in text.splitlines() if "ddp_topk" in line)
    # 86.15 - 87.65 points; (1,000,000 - 20,000) B x 300 steps = 294.0 MB; 5.0 / 4.0 s
    assert [c.strip() for c in topk.split("│")[-4:-1]] == ["-1.50 pt", "294.0", "1.25"]
    assert "acc vs ddp" in text and "fit s x ddp" in text
    assert "failed" in next(line for line in text.splitlines() if "ddp_atomo" in line)
    alone = Console(record=True, width=300)
    alone.print(comparison_table(rows[1:], "t"))  # no baseline ran: no comparison columns
    assert "acc vs" not in alone.export_text()


def test_fit_summary_shows_the_megabytes_a_compressed_run_saved() -> None:
    from rich.console import Console

    from lightning_gradcomp.examples.summary import summary_table

    summary = {"strategy": "GradCompStrategy", "world_size": 2, "global_step": 300, "compressor": "TopK",
               "val_acc": 0.9, "val_loss": 0.3, "bytes_sent_per_step": 31_000.0, "dense_bytes_per_step": 153_640.0,
               "compression_ratio": 4.96, "exchange_steps": 300, "bytes_source": "hook",
               "fit_seconds": 3.5}  # fmt: skip
    console = Console(record=True, width=200)
    console.print(summary_table(summary))
    text = console.export_text()
    row = next(line for line in text.splitlines() if "0.9000" in line)
    assert [c.strip() for c in row.split("│")][6] == "36.8"  # (153,640 - 31,000) B x 300 steps
    assert "gradcomp compare --strategies ddp,recipe" in text
