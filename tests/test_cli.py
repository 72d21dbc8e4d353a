"""The ``gradcomp`` command: help lists what is registered; the README's demo runs on 2 CPU processes."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from lightning_gradcomp.cli import main


def test_help_lists_registered_strategies_and_compressors(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 0
    out = capsys.readouterr().out
    assert "ddp_topk" in out and "ddp_gradcomp_dense" in out and "compressors: none, topk" in out


def test_bad_demo_arguments_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["demo", "--density", "0"])
    assert "--density: density must be a number in (0, 1], got 0.0" in capsys.readouterr().err


def test_demo_trains_on_two_processes_and_reports_the_saving() -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run(
        [sys.executable, "-m", "lightning_gradcomp.cli", "demo", "--steps", "40", "--density", "0.01"],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    row = re.search(r"│\s+([\d.]+) │\s+([\d,]+) │\s+([\d,]+) │\s+([\d.]+)x │", done.stdout)
    assert row, done.stdout
    accuracy, sent, dense, ratio = row.groups()
    assert 0.0 < float(accuracy) <= 1.0
    assert int(sent.replace(",", "")) * 20 < int(dense.replace(",", ""))
    assert float(ratio) > 20
