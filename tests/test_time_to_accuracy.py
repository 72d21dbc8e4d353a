"""benchmarks/time_to_accuracy.py: steps to a target times a link's seconds per step, on a tiny real run."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import time_to_accuracy as tta  # noqa: E402
from paired import paired_difference, t975, verdict  # noqa: E402


def _curves(runs: dict) -> dict:
    return {"model": "lenet", "batch": 32, "ranks": 4, "steps": 600, "seeds": [0, 1], "runs": runs}


def _network(per_step: dict[str, float]) -> dict:
    rows = [{"method": m, "seconds_per_step": s} for m, s in per_step.items()]
    return {"model": "lenet", "batch": 32, "ranks": 4, "rates": {"100mbit": rows}}


def test_steps_to_target_is_the_first_evaluated_step_at_or_above_it() -> None:
    curve = [(10, 50.0), (20, 80.0), (30, 79.0), (40, 90.0)]
    assert tta.steps_to_target(curve, 80.0) == 20
    assert tta.steps_to_target(curve, 85.0) == 40
    assert tta.steps_to_target(curve, 95.0) is None


def test_time_to_target_multiplies_steps_by_the_links_seconds_per_step() -> None:
    curves = _curves({
        "dense": {"0": {"curve": [(10, 60.0), (20, 90.0)]}, "1": {"curve": [(10, 91.0), (20, 92.0)]}},
        "ddp_topk": {"0": {"curve": [(10, 70.0), (20, 85.0), (30, 95.0)]}, "1": {"curve": [(10, 90.0)]}},
        "ddp_diana": {"0": {"curve": [(10, 95.0)]}, "1": {"curve": [(10, 10.0)]}},
        "not measured": {"0": {"curve": [(10, 95.0)]}},
    })  # fmt: skip
    network = _network({"dense": 0.5, "ddp_topk": 0.1, "ddp_diana": 0.2})
    table = tta.time_to_target(curves, network, "100mbit", {"0": 90.0, "1": 90.0})
    assert set(table) == {"dense", "ddp_topk", "ddp_diana"}
    assert table["dense"]["steps"] == {"0": 20, "1": 10}
    assert table["dense"]["seconds"] == {"0": 10.0, "1": 5.0}
    assert table["dense"]["mean_seconds"] == 7.5
    assert table["ddp_topk"]["steps"] == {"0": 30, "1": 10}
    assert table["ddp_topk"]["mean_seconds"] == pytest.approx(2.0)
    assert table["ddp_topk"]["speedup_vs_dense"] == pytest.approx(3.75)
    # a seed that never reaches the target: no mean, no speed-up (a mean over the lucky seeds would flatter)
    assert table["ddp_diana"]["reached"] == 1
    assert table["ddp_diana"]["mean_seconds"] is None and table["ddp_diana"]["speedup_vs_dense"] is None


def test_combining_different_settings_is_refused() -> None:
    with pytest.raises(ValueError, match="batch is 32 in the curves and 64 in the network results"):
        tta.check_same_setting(_curves({}), {**_network({}), "batch": 64})


def test_paired_difference_and_its_interval() -> None:
    method, base = {0: 98.0, 1: 97.0, 2: 97.5}, {0: 98.5, 1: 97.0, 2: 98.5, 3: 99.0}
    mean, half, n = paired_difference(method, base)
    # differences -0.5, 0.0, -1.0: mean -0.5, sd 0.5, t(0.975, 2) = 4.303
    assert n == 3 and mean == pytest.approx(-0.5)
    assert half == pytest.approx(4.303 * 0.5 / math.sqrt(3))
    assert t975(30) == 2.042 and t975(31) == 1.96
    assert paired_difference({0: 1.0}, {0: 2.0}) == (-1.0, math.inf, 1)
    assert verdict(-0.2, 0.25, 0.5) == "within"
    assert verdict(-1.0, 0.25, 0.5) == "loses"
    assert verdict(-0.4, 0.25, 0.5) == "undecided"


def test_a_tiny_run_reports_the_steps_and_seconds_its_curves_imply(tmp_path: Path, mnist_dir: Path) -> None:
    curves_path, out, png = tmp_path / "curves.json", tmp_path / "report.json", tmp_path / "tta.png"
    train = ["train", "--model", "lenet", "--methods", "dense,ddp_topk", "--seeds", "0", "--ranks", "2", "--steps",
             "30", "--eval-every", "10", "--data-dir", str(mnist_dir), "--json", str(curves_path)]  # fmt: skip
    assert tta.main(train) == 0
    curves = json.loads(curves_path.read_text())
    assert set(curves["runs"]) == {"dense", "ddp_topk"}
    dense_curve = curves["runs"]["dense"]["0"]["curve"]
    assert [step for step, _ in dense_curve] == [10, 20, 30]
    assert curves["runs"]["dense"]["0"]["final"] == dense_curve[-1][1] > 30.0  # it learned something in 30 steps
    assert (
        curves["runs"]["ddp_topk"]["0"]["bytes_sent_per_step"] < curves["runs"]["ddp_topk"]["0"]["dense_bytes_per_step"]
    )

    network = {**_network({"dense": 0.5, "ddp_topk": 0.125}), "ranks": 2}
    (tmp_path / "network.json").write_text(json.dumps(network))
    topk_curve = curves["runs"]["ddp_topk"]["0"]["curve"]
    # reached by dense at its first evaluation, and by Top-k somewhere (accuracies lie on a 0.05 grid:
    # 0.01 below keeps the float arithmetic of dense_final - below from deciding)
    target = min(min(acc for _, acc in dense_curve), max(acc for _, acc in topk_curve)) - 0.01
    below = round(dense_curve[-1][1] - target, 6)
    assert tta.main(["report", "--curves", str(curves_path), "--network", str(tmp_path / "network.json"),
                     "--below", str(below), "--final-window", "0",
                     "--json", str(out), "--png", str(png)]) == 0  # fmt: skip
    result = json.loads(out.read_text())
    (key,) = result["links"]["100mbit"]
    assert float(key) == below  # the target of seed 0: dense's final accuracy with seed 0 minus below
    rows = result["links"]["100mbit"][key]
    assert rows["dense"]["steps"] == {"0": 10} and rows["dense"]["mean_seconds"] == 5.0
    topk_steps = next(step for step, acc in topk_curve if acc >= target)
    assert rows["ddp_topk"]["steps"] == {"0": topk_steps}
    assert rows["ddp_topk"]["mean_seconds"] == topk_steps * 0.125
    assert rows["ddp_topk"]["speedup_vs_dense"] == pytest.approx(5.0 / (topk_steps * 0.125))
    assert result["parity"]["ddp_topk"]["difference"] == pytest.approx(
        curves["runs"]["ddp_topk"]["0"]["final"] - curves["runs"]["dense"]["0"]["final"]
    )
    assert png.stat().st_size > 10_000


def test_a_density_warmup_is_counted_at_its_own_measured_pace() -> None:
    steady = {"seconds_per_step": 0.1}
    warm = {"seconds_per_step": 0.1, "density_warmup_steps": 9, "warmup_seconds_per_step": 0.3}
    assert tta.elapsed_seconds(steady, 50) == pytest.approx(5.0)
    assert tta.elapsed_seconds(warm, 4) == pytest.approx(4 * 0.3)  # inside the dense step + warm-up
    assert tta.elapsed_seconds(warm, 50) == pytest.approx(10 * 0.3 + 40 * 0.1)
    # ATOMO's preset: 100 dense steps first, no density warm-up
    dense_first = {"seconds_per_step": 0.1, "dense_steps": 100, "warmup_seconds_per_step": 0.4}
    assert tta.elapsed_seconds(dense_first, 150) == pytest.approx(100 * 0.4 + 50 * 0.1)


def test_accordion_steps_take_their_regimes_time() -> None:
    """The run's phases say which steps were critical (compressed less, or dense): those at their own pace."""
    row = {"seconds_per_step": 0.1, "critical_seconds_per_step": 0.5}
    phases = [["warmup", False, None, 1, 900.0], ["critical", True, 0.01, 99, 90.0], ["relaxed", True, 0.001, 50, 9.0],
              ["critical", True, 0.01, 50, 90.0], ["relaxed", True, 0.001, 400, 9.0]]  # fmt: skip
    assert tta.elapsed_seconds(row, 60, phases) == pytest.approx(0.1 + 59 * 0.5)
    assert tta.elapsed_seconds(row, 250, phases) == pytest.approx(0.1 + 99 * 0.5 + 50 * 0.1 + 50 * 0.5 + 50 * 0.1)
    assert tta.elapsed_seconds(row, 700, phases) == pytest.approx(0.1 + 149 * 0.5 + 550 * 0.1)  # past the run: relaxed
    assert tta.elapsed_seconds({"seconds_per_step": 0.1}, 60, phases) == pytest.approx(6.0)  # no regimes timed


def test_pytorchs_powersgd_started_as_documented_is_dense_for_a_tenth_of_the_run() -> None:
    network = _network({"dense": 0.5, "powersgd": 0.1})
    row = tta.measurements(network, "100mbit", 600)["powersgd:start-10pct"]
    assert tta.elapsed_seconds(row, 50) == pytest.approx(50 * 0.5)
    assert tta.elapsed_seconds(row, 100) == pytest.approx(60 * 0.5 + 40 * 0.1)


def test_each_seeds_target_is_set_by_its_own_dense_run() -> None:
    curves = _curves({"dense": {"0": {"curve": [(10, 90.0), (20, 98.0)]}, "1": {"curve": [(10, 99.0), (20, 97.0)]}}})
    assert tta.dense_targets(curves, 0.5) == {"0": 97.5, "1": 96.5}
    assert tta.dense_targets(curves, 0.5, window=20) == {"0": 93.5, "1": 97.5}


def test_final_accuracy_is_the_mean_over_the_last_steps() -> None:
    curve = [(20, 90.0), (40, 97.0), (60, 99.0), (80, 98.0)]
    assert tta.final_accuracy(curve, 0) == 98.0  # the last evaluation only
    assert tta.final_accuracy(curve, 20) == 98.0  # steps 61..80
    assert tta.final_accuracy(curve, 40) == 98.5  # steps 41..80: 60 and 80
    assert tta.final_accuracy(curve, 1000) == 96.0
    curves = _curves({"dense": {"0": {"curve": curve}}, "ddp_topk": {"0": {"curve": [(20, 80.0), (80, 97.0)]}}})
    assert tta.parity(curves, 0.5, window=40)["ddp_topk"]["difference"] == pytest.approx(97.0 - 98.5)


def test_load_curves_merges_files_and_refuses_two_different_curves_for_one_run(tmp_path: Path) -> None:
    setting = {"model": "lenet", "ranks": 4, "batch": 32, "lr": 0.05, "steps": 20, "eval_every": 10, "holdout": 2000}
    dense = {"curve": [[10, 90.0], [20, 95.0]]}
    first = tmp_path / "a.json"
    first.write_text(
        json.dumps({**setting, "runs": {"dense": {"0": dense}, "ddp_topk": {"0": {"curve": [[10, 91.0]]}}}})
    )
    second = tmp_path / "b.json"
    second.write_text(json.dumps({**setting, "runs": {"dense": {"0": dense, "1": dense}}}))
    merged = tta.load_curves([str(first), str(second)])
    assert merged["seeds"] == [0, 1] and set(merged["runs"]) == {"dense", "ddp_topk"}
    third = tmp_path / "c.json"
    third.write_text(json.dumps({**setting, "runs": {"dense": {"0": {"curve": [[10, 90.0], [20, 95.5]]}}}}))
    with pytest.raises(ValueError, match=r"dense seed 0 has different curves in .*c\.json"):
        tta.load_curves([str(first), str(third)])


def test_load_curves_refuses_runs_with_another_learning_rate_warm_up(tmp_path: Path) -> None:
    setting = {"model": "lenet", "ranks": 4, "batch": 32, "lr": 0.05, "steps": 20, "eval_every": 10, "holdout": 2000}
    dense = {"runs": {"dense": {"0": {"curve": [[10, 90.0], [20, 95.0]]}}}}
    before = tmp_path / "before.json"  # written before lr_warmup was recorded: no warm-up
    before.write_text(json.dumps({**setting, **dense}))
    none = tmp_path / "none.json"
    none.write_text(json.dumps({**setting, "lr_warmup": 0, "momentum": 0.9, **dense}))
    assert tta.load_curves([str(before), str(none)])["seeds"] == [0]
    warm = tmp_path / "warm.json"
    warm.write_text(json.dumps({**setting, "lr_warmup": 100, **dense}))
    with pytest.raises(ValueError, match=r"warm\.json has lr_warmup=100, .*before\.json None: not comparable"):
        tta.load_curves([str(before), str(warm)])
