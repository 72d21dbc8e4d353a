"""Every recipe parses and trains a few steps on 2 CPU ranks, on small files in the real formats written here.

All runnable recipes train in one pair of spawned ranks (imports paid once, about 1-2 s per
recipe after that), each through :func:`lightning_gradcomp.cli.run_cli`, the code path of
``gradcomp fit``. A recipe whose compressor, memory, aggregator or strategy argument is not
registered yet is skipped with the missing names; it runs as soon as they are registered.
"""

from __future__ import annotations

import inspect
import math
import os
import traceback
from pathlib import Path
from typing import Any

import pytest
import yaml
from datasets import write_cifar10, write_mnist
from lightning.pytorch.strategies import StrategyRegistry
from ranks import run_ranks

from lightning_gradcomp.cli import main, run_cli
from lightning_gradcomp.comm import AGGREGATORS
from lightning_gradcomp.compressors import COMPRESSORS
from lightning_gradcomp.examples.summary import RunSummary
from lightning_gradcomp.memory import MEMORIES
from lightning_gradcomp.strategy import GradCompStrategy

RECIPES_DIR = Path(__file__).resolve().parents[1] / "recipes"
RECIPES = sorted(RECIPES_DIR.glob("*.yaml"))
STEPS = 3  # one dense warm-up step, then two compressed ones

# Cheap and identical for every recipe: 2 CPU ranks, 3 training batches, 1 validation batch.
COMMON = [
    "--trainer.accelerator=cpu",
    "--trainer.devices=2",
    "--trainer.max_epochs=1",
    "--trainer.max_steps=-1",
    f"--trainer.limit_train_batches={STEPS}",
    "--trainer.limit_val_batches=1",
    "--trainer.num_sanity_val_steps=0",
    "--trainer.logger=false",
    "--trainer.enable_checkpointing=false",
    "--trainer.enable_progress_bar=false",
    "--trainer.enable_model_summary=false",
    "--summary.print_table=false",
]
# AlexNet's 4096-wide classifier makes a unit test slow (a 4096x4096 SVD per step for ATOMO is
# about 45 s on one CPU thread); a 256-wide one keeps the recipe's structure.
MODEL_OVERRIDES = {"AlexNet": ["--model.init_args.model.init_args.hidden=256"]}


def _load(recipe: Path) -> dict[str, Any]:
    return yaml.safe_load(recipe.read_text())


def unregistered(config: dict[str, Any]) -> list[str]:
    """Names a recipe's strategy needs that this checkout does not register (yet)."""
    strategy = config["trainer"]["strategy"]
    if isinstance(strategy, str):
        return [] if strategy in StrategyRegistry else [f"strategy {strategy!r}"]
    init = strategy.get("init_args", {})
    accepted = inspect.signature(GradCompStrategy.__init__).parameters
    missing = [f"GradCompStrategy argument {key!r}" for key in init if key not in accepted]
    for key, registry, extra in (
        ("compressor", COMPRESSORS, ()),
        ("memory", MEMORIES, ()),
        ("aggregator", AGGREGATORS, ("auto",)),
    ):
        if key in init and init[key] not in registry and init[key] not in extra:
            missing.append(f"{key} {init[key]!r} (registered: {sorted(registry)})")
    return missing


def _skip_reason(recipe: Path) -> str | None:
    missing = unregistered(_load(recipe))
    return f"{recipe.name} needs {', '.join(missing)}, not registered yet" if missing else None


def _overrides(recipe: Path, data: dict[str, Path], out: Path) -> list[str]:
    config = _load(recipe)
    args = ["fit", "--config", str(recipe), *COMMON, f"--trainer.default_root_dir={out / recipe.stem}"]
    data_class = config["data"]["class_path"].rpartition(".")[2]
    if data_class == "CIFAR10DataModule":
        args += [f"--data.init_args.data_dir={data['cifar']}", "--data.init_args.batch_size=8"]
        args += ["--data.init_args.num_workers=0", "--data.init_args.val_batch_size=16"]
    elif data_class == "MNISTDataModule":
        args += [f"--data.init_args.data_dir={data['mnist']}", "--data.init_args.batch_size=8"]
    network = config["model"].get("init_args", {}).get("model", {}).get("class_path", "").rpartition(".")[2]
    return args + MODEL_OVERRIDES.get(network, [])


def _fit_recipes(rank: int, world_size: int, jobs: list[tuple[str, list[str]]]) -> dict[str, dict[str, Any]]:
    """In each rank: run every ``gradcomp`` job in turn; what each run did, or its traceback."""
    results: dict[str, dict[str, Any]] = {}
    for name, args in jobs:
        try:
            trainer = run_cli(args).trainer
            hook = getattr(trainer.strategy, "gradcomp_hook", None)
            summary = next(c for c in trainer.callbacks if isinstance(c, RunSummary)).summary
            results[name] = {
                "ok": True,
                "strategy": type(trainer.strategy).__name__,
                "compressor": type(trainer.strategy.compressor).__name__,
                "global_step": trainer.global_step,
                "compressed_steps": sum(s.compressed for s in hook.history) if hook else 0,
                "summary": summary,
                "metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
            }
        except BaseException:
            results[name] = {"ok": False, "error": traceback.format_exc()}
    return results


@pytest.fixture(scope="module")
def recipe_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    root = tmp_path_factory.mktemp("recipes")
    data = {"cifar": write_cifar10(root / "cifar-10-batches-py"), "mnist": write_mnist(root / "mnist")}
    jobs = [(r.stem, _overrides(r, data, root)) for r in RECIPES if r.stem != "quickstart" and not _skip_reason(r)]
    quickstart = ["--config", str(RECIPES_DIR / "quickstart.yaml"), "--summary.print_table=false"]
    quickstart_dir = root / "quickstart"
    jobs.append(
        (
            "quickstart:fit",
            [
                "fit", *quickstart, "--trainer.max_steps=20", "--trainer.val_check_interval=10",
                "--trainer.enable_checkpointing=true", f"--trainer.default_root_dir={quickstart_dir}",
            ],
        )
    )  # fmt: skip
    # Lightning names the checkpoint after the epoch and step it was written at, in default_root_dir
    # (no logger): the validation at step 20 saves it.
    checkpoint = quickstart_dir / "checkpoints" / "epoch=0-step=20.ckpt"
    validate = ["validate", *quickstart, f"--ckpt_path={checkpoint}", f"--trainer.default_root_dir={root / 'validate'}"]
    jobs.append(("quickstart:validate", validate))
    resnet = RECIPES_DIR / "resnet20_cifar10_topk.yaml"
    test = _overrides(resnet, data, root / "test")
    jobs.append(("resnet20:test", ["test", *test[1:], "--trainer.limit_test_batches=1"]))
    os.environ["OMP_NUM_THREADS"] = "1"
    return run_ranks(_fit_recipes, 2, jobs, init=True, timeout=600)[0]


def test_recipes_exist() -> None:
    names = {r.stem for r in RECIPES}
    methods = ("terngrad", "topk", "gaussiank", "gtopk", "diana", "atomo")
    expected = {f"{model}_cifar10_{m}" for model in ("resnet20", "alexnet") for m in methods}
    assert expected | {"quickstart", "lenet_mnist_topk", "lenet_mnist_terngrad"} <= names


@pytest.mark.parametrize("recipe", RECIPES, ids=[r.stem for r in RECIPES])
def test_recipe_parses(recipe: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Keys and types check out against the classes (print_config stops before anything is built)."""
    reason = _skip_reason(recipe)
    if reason and "argument" in reason:
        pytest.skip(reason)
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(recipe), "--print_config"])
    assert exit_info.value.code in (0, None)
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["trainer"]["strategy"]["class_path"] == "lightning_gradcomp.GradCompStrategy"
    assert printed["seed_everything"] == 0


@pytest.mark.parametrize("recipe", [r for r in RECIPES if r.stem != "quickstart"], ids=lambda r: r.stem)
def test_recipe_trains_on_two_ranks(recipe: Path, recipe_runs: dict[str, dict[str, Any]]) -> None:
    reason = _skip_reason(recipe)
    if reason:
        pytest.skip(reason)
    result = recipe_runs[recipe.stem]
    assert result["ok"], result.get("error")
    config = _load(recipe)["trainer"]["strategy"]["init_args"]
    assert result["strategy"] == "GradCompStrategy"
    assert result["compressor"] == COMPRESSORS[config["compressor"]].__name__
    assert result["global_step"] == STEPS
    assert result["compressed_steps"] == STEPS - config.get("warmup_steps", 1)
    summary = result["summary"]
    assert summary["bytes_source"] == "hook" and summary["exchange_steps"] == STEPS
    assert 0.0 <= summary["val_acc"] <= 1.0 and math.isfinite(summary["val_loss"])
    assert summary["compression_ratio"] > 1.0, summary
    assert len(summary["curve"]) == 1 and summary["curve"][0]["step"] == STEPS


def test_quickstart_fits_and_validates_its_checkpoint(recipe_runs: dict[str, dict[str, Any]]) -> None:
    fit, validate = recipe_runs["quickstart:fit"], recipe_runs.get("quickstart:validate")
    assert fit["ok"], fit.get("error")
    assert fit["global_step"] == 20 and fit["compressed_steps"] == 19
    assert [p["step"] for p in fit["summary"]["curve"]] == [10, 20]
    assert fit["summary"]["compression_ratio"] > 4.5  # 1 dense step + 19 at about 6x (logits layer dense)
    assert validate is not None and validate["ok"], validate and validate.get("error")
    # the checkpoint holds the weights the last validation of fit saw
    assert validate["metrics"]["val_acc"] == pytest.approx(fit["summary"]["val_acc"], abs=1e-6)


def test_test_subcommand_evaluates_the_test_split(recipe_runs: dict[str, dict[str, Any]]) -> None:
    result = recipe_runs["resnet20:test"]
    assert result["ok"], result.get("error")
    assert {"test_acc", "test_loss"} <= set(result["metrics"]) and result["global_step"] == 0
