"""Every recipe parses, builds its strategy and trains a few steps on 2 CPU ranks, on small files in the real formats
written here.

All recipes train in one pair of spawned ranks (imports paid once, about 1-2 s per recipe after that),
each through :func:`lightning_gradcomp.cli.run_cli`, the code path of ``gradcomp fit``; every rank's
outcome is asserted. Nothing is skipped: a recipe with a misspelt or unknown strategy argument fails.
"""

from __future__ import annotations

import math
import os
import traceback
from pathlib import Path
from typing import Any

import pytest
import yaml
from datasets import write_cifar10, write_mnist
from ranks import run_ranks

from lightning_gradcomp.cli import main, run_cli
from lightning_gradcomp.core.compressors import COMPRESSORS
from lightning_gradcomp.ddp.strategy import GradCompStrategy
from lightning_gradcomp.diloco import GradCompDiLoCoStrategy
from lightning_gradcomp.examples.summary import RunSummary

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
    if _is_diloco(config):  # one synchronisation within the recipe's few steps
        args.append(f"--trainer.strategy.init_args.sync_every={STEPS}")
    return args + MODEL_OVERRIDES.get(network, [])


def _is_diloco(config: dict[str, Any]) -> bool:
    return config["trainer"]["strategy"]["class_path"] == "lightning_gradcomp.GradCompDiLoCoStrategy"


def _fit_recipes(rank: int, world_size: int, jobs: list[tuple[str, list[str]]]) -> dict[str, dict[str, Any]]:
    """In each rank: run every ``gradcomp`` job in turn; what each run did, or its traceback."""
    results: dict[str, dict[str, Any]] = {}
    for name, args in jobs:
        try:
            trainer = run_cli(args).trainer
            hook = getattr(trainer.strategy, "gradcomp_hook", None) or getattr(trainer.strategy, "outer_sync", None)
            summary = next(c for c in trainer.callbacks if isinstance(c, RunSummary)).summary
            exchange = getattr(hook, "exchange", None)
            compressor = exchange.compressor if exchange is not None else getattr(trainer.strategy, "compressor", None)
            results[name] = {
                "ok": True,
                "strategy": type(trainer.strategy).__name__,
                "compressor": type(compressor).__name__,
                "global_step": trainer.global_step,
                "compressed_steps": sum(s.compressed for s in hook.history) if hook else 0,
                "summary": summary,
                "metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
            }
        except BaseException:
            results[name] = {"ok": False, "error": traceback.format_exc()}
    return results


@pytest.fixture(scope="module")
def recipe_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    """Every run's outcome on each rank, by run name."""
    root = tmp_path_factory.mktemp("recipes")
    data = {"cifar": write_cifar10(root / "cifar-10-batches-py"), "mnist": write_mnist(root / "mnist")}
    jobs = [(r.stem, _overrides(r, data, root)) for r in RECIPES if r.stem != "quickstart"]
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
    ranks = run_ranks(_fit_recipes, 2, jobs, init=True, timeout=600)
    return {name: [rank[name] for rank in ranks] for name in ranks[0]}


def _on_every_rank(recipe_runs: dict[str, list[dict[str, Any]]], name: str) -> dict[str, Any]:
    """Rank 0's outcome of run ``name`` once every rank's is asserted ok (catches: a failure on rank 1 alone)."""
    for rank, result in enumerate(recipe_runs[name]):
        assert result["ok"], f"{name} failed on rank {rank}:\n{result.get('error')}"
    return recipe_runs[name][0]


def test_recipes_exist() -> None:
    names = {r.stem for r in RECIPES}
    methods = ("terngrad", "topk", "gaussiank", "gtopk", "diana", "atomo")
    expected = {f"{model}_cifar10_{m}" for model in ("resnet20", "alexnet") for m in methods}
    assert expected | {"quickstart", "lenet_mnist_topk", "lenet_mnist_terngrad"} <= names


def _parse_and_build(
    recipe: Path, capsys: pytest.CaptureFixture[str]
) -> tuple[dict[str, Any], GradCompStrategy | GradCompDiLoCoStrategy]:
    """The recipe's config as ``gradcomp fit --print_config`` checks it against the classes (stopping before anything
    is built), and the strategy built from it."""
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(recipe), "--print_config"])
    printed = capsys.readouterr()
    assert exit_info.value.code in (0, None), printed.err
    config = yaml.safe_load(printed.out)
    cls = GradCompDiLoCoStrategy if _is_diloco(config) else GradCompStrategy
    return config, cls(**config["trainer"]["strategy"]["init_args"])


@pytest.mark.parametrize("recipe", RECIPES, ids=[r.stem for r in RECIPES])
def test_recipe_parses_and_builds_its_strategy(recipe: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config, strategy = _parse_and_build(recipe, capsys)
    assert config["seed_everything"] == 0
    init_args = config["trainer"]["strategy"]["init_args"]
    if isinstance(strategy, GradCompDiLoCoStrategy):
        assert strategy.exchange_arguments["compressor"] == init_args["compressor"]
        return
    assert config["trainer"]["strategy"]["class_path"] == "lightning_gradcomp.GradCompStrategy"
    assert type(strategy.compressor) is COMPRESSORS[init_args["compressor"]]


def test_a_recipe_with_a_misspelt_strategy_argument_fails(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Catches: a recipe test that skips what it cannot run (a misspelt argument, an unknown compressor)."""
    config = _load(RECIPES_DIR / "lenet_mnist_topk.yaml")
    broken = tmp_path / "broken.yaml"
    config["trainer"]["strategy"]["init_args"]["densty"] = 0.01
    broken.write_text(yaml.safe_dump(config))
    with pytest.raises(AssertionError, match=r"Option 'densty' is not accepted \(did you mean 'density'\?\)"):
        _parse_and_build(broken, capsys)
    del config["trainer"]["strategy"]["init_args"]["densty"]
    config["trainer"]["strategy"]["init_args"]["compressor"] = "topq"  # a string, as the signature says: it parses
    broken.write_text(yaml.safe_dump(config))
    with pytest.raises(ValueError, match=r"compressor must be one of \[.*\] or a Compressor instance, got 'topq'"):
        _parse_and_build(broken, capsys)


def test_the_strategy_refuses_an_argument_that_is_neither_a_setting_nor_ddps() -> None:
    """Outside the CLI (which checks the signature), ``**kwargs`` would carry a misspelt setting into DDP."""
    message = r"GradCompStrategy got unknown arguments \['densty'\]: .* \('densty': did you mean 'density'\?\)"
    with pytest.raises(ValueError, match=message):
        GradCompStrategy(densty=0.01)
    GradCompStrategy(find_unused_parameters=True, bucket_cap_mb=1)  # DDP's own keywords pass


@pytest.mark.parametrize("recipe", [r for r in RECIPES if r.stem != "quickstart"], ids=lambda r: r.stem)
def test_recipe_trains_on_two_ranks(recipe: Path, recipe_runs: dict[str, list[dict[str, Any]]]) -> None:
    result = _on_every_rank(recipe_runs, recipe.stem)
    config = _load(recipe)["trainer"]["strategy"]["init_args"]
    diloco = _is_diloco(_load(recipe))
    assert result["strategy"] == ("GradCompDiLoCoStrategy" if diloco else "GradCompStrategy")
    expected = COMPRESSORS[config["compressor"]].__name__
    assert result["compressor"] == ("TwoBitValues" if config.get("wire_precision") == "2bit" else expected)
    assert result["global_step"] == STEPS
    # DiLoCo: one synchronisation (sync_every=STEPS) compressed; DDP: every step after the dense warm-up
    assert result["compressed_steps"] == (1 if diloco else STEPS - config.get("warmup_steps", 1))
    summary = result["summary"]
    assert summary["bytes_source"] == "hook" and summary["exchange_steps"] == STEPS
    assert 0.0 <= summary["val_acc"] <= 1.0 and math.isfinite(summary["val_loss"])
    assert summary["compression_ratio"] > 1.0, summary
    assert len(summary["curve"]) == 1 and summary["curve"][0]["step"] == STEPS


def test_quickstart_fits_and_validates_its_checkpoint(recipe_runs: dict[str, list[dict[str, Any]]]) -> None:
    fit, validate = _on_every_rank(recipe_runs, "quickstart:fit"), _on_every_rank(recipe_runs, "quickstart:validate")
    assert fit["global_step"] == 20 and fit["compressed_steps"] == 19
    assert [p["step"] for p in fit["summary"]["curve"]] == [10, 20]
    assert fit["summary"]["compression_ratio"] > 4.5  # 1 dense step + 19 at about 6x (logits layer dense)
    # the checkpoint holds the weights the last validation of fit saw
    assert validate["metrics"]["val_acc"] == pytest.approx(fit["summary"]["val_acc"], abs=1e-6)


def test_test_subcommand_evaluates_the_test_split(recipe_runs: dict[str, list[dict[str, Any]]]) -> None:
    result = _on_every_rank(recipe_runs, "resnet20:test")
    assert {"test_acc", "test_loss"} <= set(result["metrics"]) and result["global_step"] == 0
