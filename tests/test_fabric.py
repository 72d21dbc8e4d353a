"""Lightning Fabric with the named strategies, and ``make_hook`` for plain torch DDP: real ranks over gloo."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from ranks import EveryRank, free_port, run_cases
from torch import nn

from lightning_gradcomp import NAMED_STRATEGIES, GradCompFabricStrategy, GradCompStrategy, make_hook

PRESETS = ("ddp_topk", "ddp_gtopk", "ddp_terngrad")
RESUMED = ("ddp_topk", "ddp_terngrad")  # error feedback; random draws
STEPS, SAVE_AT = 6, 3


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(16, 32, generator=g), torch.randint(0, 10, (16,), generator=g)


def _fabric(strategy: Any, world_size: int, init_seed: int = 0):
    import lightning as L

    fabric = L.Fabric(accelerator="cpu", devices=world_size, strategy=strategy)
    fabric.launch()
    model = _model(init_seed)
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    return fabric, model, optimizer


def _train(fabric, model, optimizer, rank: int, steps: range) -> None:
    for step in steps:
        x, y = _batch(rank, step)
        optimizer.zero_grad()
        fabric.backward(nn.functional.cross_entropy(model(x), y))
        optimizer.step()


def _weights(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()


def _small_buckets(name: str) -> GradCompFabricStrategy:
    """The preset with DDP buckets of ~5 KB: several buckets, laid out anew after the first step."""
    return GradCompFabricStrategy(**NAMED_STRATEGIES[name][1], bucket_cap_mb=0.005)


def _preset(name: str):
    def case(rank: int, world_size: int) -> dict[str, Any]:
        fabric, model, optimizer = _fabric(name, world_size)
        _train(fabric, model, optimizer, rank, range(STEPS))
        last = fabric.strategy.gradcomp_hook.last_step
        return {
            "strategy": type(fabric.strategy).__name__,
            "comm_hook": model._forward_module._get_ddp_logging_data().get("comm_hook"),
            "weights": _weights(model),
            "compressed": last.compressed,
            "bytes_sent": last.bytes_sent,
            "dense_bytes": last.dense_bytes,
        }

    return case


def _identity_and_plain_ddp(rank: int, world_size: int) -> dict[str, Any]:
    from lightning.fabric.strategies import DDPStrategy

    # the same buckets for both: gloo's ring sums each chunk starting from another rank, so where a
    # bucket's chunks begin decides the order of the 3-rank sums
    fabric, model, optimizer = _fabric(DDPStrategy(bucket_cap_mb=0.005), world_size)
    _train(fabric, model, optimizer, rank, range(STEPS))
    plain = _weights(model)
    out: dict[str, Any] = {"ddp": plain}
    # without memory: the hook's shortcut to DDP's own allreduce; with error feedback: the full pipeline
    for label, memory in (("identity", "none"), ("pipeline", "ef")):
        identity = GradCompFabricStrategy(
            compressor="none", memory=memory, aggregator="allreduce", warmup_steps=0, bucket_cap_mb=0.005
        )
        fabric, model, optimizer = _fabric(identity, world_size)
        _train(fabric, model, optimizer, rank, range(STEPS))
        history = identity.gradcomp_hook.history
        out[label] = {
            "weights": _weights(model),
            "comm_hook": model._forward_module._get_ddp_logging_data().get("comm_hook"),
            "steps": len(history),
            "compressed_steps": sum(s.compressed for s in history),
        }
    return out


def _refusals(rank: int, world_size: int) -> dict[str, str | None]:
    """A second model on one strategy; make_hook on ranks given different densities."""
    out: dict[str, str | None] = {}
    fabric, _, _ = _fabric("ddp_topk", world_size)
    try:
        fabric.setup(_model(1), torch.optim.SGD(_model(1).parameters(), lr=0.1))
        out["second model"] = None
    except RuntimeError as err:
        out["second model"] = str(err)
    try:
        make_hook(torch.nn.parallel.DistributedDataParallel(_model(0)), "ddp_topk", density=0.01 * (rank + 1))
        out["disagreeing make_hook"] = None
    except ValueError as err:
        out["disagreeing make_hook"] = str(err)
    return out


def _resume(name: str):
    def case(rank: int, world_size: int) -> dict[str, Any]:
        folder = Path(os.environ["GRADCOMP_TEST_TMP"])
        fabric, model, optimizer = _fabric(_small_buckets(name), world_size)
        _train(fabric, model, optimizer, rank, range(STEPS))
        straight = _weights(model)
        fabric, model, optimizer = _fabric(_small_buckets(name), world_size)
        _train(fabric, model, optimizer, rank, range(SAVE_AT))
        path = folder / f"{name}-{world_size}.ckpt"
        fabric.save(path, {"model": model, "optimizer": optimizer, "step": SAVE_AT})
        # a fresh run from other initial weights: everything it continues from comes from the checkpoint
        fabric, model, optimizer = _fabric(_small_buckets(name), world_size, init_seed=7)
        state = {"model": model, "optimizer": optimizer, "step": 0}
        remainder = fabric.load(path, state)
        _train(fabric, model, optimizer, rank, range(state["step"], STEPS))
        return {
            "straight": straight,
            "resumed": _weights(model),
            "step": state["step"],
            "remainder": sorted(remainder),
            "shard": (folder / f"{path.name}.gradcomp" / f"rank{rank:05d}-of-{world_size:05d}.pt").is_file(),
        }

    return case


def every_case(rank: int, world_size: int) -> dict[str, Any]:
    """Every case, on every rank: the named presets by name, identity against plain DDP, refusals, resume."""
    cases = {name: _preset(name) for name in PRESETS}
    cases |= {"identity and ddp": _identity_and_plain_ddp, "refusals": _refusals}
    cases |= {f"resume {name}": _resume(name) for name in RESUMED}
    return run_cases(rank, world_size, cases)


@pytest.fixture(scope="module", autouse=True)
def _shared_tmp(tmp_path_factory: pytest.TempPathFactory):
    """A folder every rank of the launches sees (the checkpoints of the resume cases), for this module only."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("GRADCOMP_TEST_TMP", str(tmp_path_factory.mktemp("fabric")))
        yield


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("name", PRESETS)
def test_fabric_runs_the_named_strategy_through_our_hook_ranks_identical_bytes_below_dense(
    world_size: int, name: str, every_rank: EveryRank
) -> None:
    ranks = every_rank(world_size, name)
    assert {r["strategy"] for r in ranks} == {"GradCompFabricStrategy"}
    assert {r["comm_hook"] for r in ranks} == {"gradcomp_comm_hook"}
    assert all(r["compressed"] for r in ranks)
    for other in ranks[1:]:
        assert torch.equal(other["weights"], ranks[0]["weights"])
    assert all(0 < r["bytes_sent"] < r["dense_bytes"] for r in ranks)


@pytest.mark.parametrize("world_size", [2, 3])
def test_the_identity_compressor_gives_fabrics_plain_ddp_weights_bit_for_bit(
    world_size: int, every_rank: EveryRank
) -> None:
    for result in every_rank(world_size, "identity and ddp"):
        shortcut, pipeline = result["identity"], result["pipeline"]
        for ours in (shortcut, pipeline):
            assert ours["comm_hook"] == "gradcomp_comm_hook" and ours["steps"] == STEPS  # through our hook
        # without memory, DDP's own allreduce of the same buckets (the shortcut): bit for bit at any world size
        assert shortcut["compressed_steps"] == 0 and torch.equal(shortcut["weights"], result["ddp"])
        # with error feedback, every step through the pipeline (catches: one that loses or mis-scales a unit);
        # a sum of two in any order is exact, gloo's ring adds three in an order set by where a unit's chunks begin
        assert pipeline["compressed_steps"] == STEPS
        if world_size == 2:
            assert torch.equal(pipeline["weights"], result["ddp"])
        else:
            torch.testing.assert_close(pipeline["weights"], result["ddp"], rtol=0, atol=1e-7)


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("name", RESUMED)
def test_fabric_save_load_continue_equals_straight_through(world_size: int, name: str, every_rank: EveryRank) -> None:
    for case in every_rank(world_size, f"resume {name}"):
        assert case["step"] == SAVE_AT
        assert case["shard"]
        assert case["remainder"] == []  # the manifest is the strategy's, not handed back to the loop
        assert torch.equal(case["resumed"], case["straight"])


BAD_ARGUMENTS = [  # (arguments, the argument the error must name)
    ({"memory": "bogus"}, "memory"),
    ({"aggregator": "ring"}, "aggregator"),
    ({"granularity": "tensor"}, "granularity"),
    ({"warmup_steps": -1}, "warmup_steps"),
    ({"density": 1.5}, "density"),
    ({"compressor": "topk", "memory": "diana"}, "memory='diana'"),
    ({"hierarchy": "rack"}, "hierarchy"),
    ({"unit_cap_mb": 0}, "unit_cap_mb"),
]


@pytest.mark.parametrize(("arguments", "named"), BAD_ARGUMENTS, ids=[named for _, named in BAD_ARGUMENTS])
def test_fabric_strategy_and_make_hook_refuse_bad_input_as_the_trainer_strategy_does(
    arguments: dict, named: str
) -> None:
    with pytest.raises(ValueError) as trainer:
        GradCompStrategy(**arguments)
    with pytest.raises(ValueError) as fabric:
        GradCompFabricStrategy(**arguments)
    with pytest.raises(ValueError) as plain:
        make_hook(nn.Linear(4, 2), **arguments)
    assert str(fabric.value) == str(trainer.value) == str(plain.value)
    assert named in str(trainer.value)


def test_fabric_and_make_hook_refuse_a_density_schedule_and_unknown_settings() -> None:
    with pytest.raises(ValueError, match=r"density_schedule=\[0.004, 0.001\] .* a Fabric loop has no epochs"):
        GradCompFabricStrategy(density_schedule=[0.004, 0.001])
    with pytest.raises(ValueError, match=r"density_schedule=\[0.004\] .* a plain torch loop has no epochs"):
        make_hook(nn.Linear(4, 2), density_schedule=[0.004])
    with pytest.raises(ValueError, match=r"unknown arguments \['densty'\]"):
        make_hook(nn.Linear(4, 2), densty=0.01)
    with pytest.raises(ValueError, match=r"preset must be one of .*'ddp_topk'.*, got 'ddp_top'"):
        make_hook(nn.Linear(4, 2), "ddp_top")


def test_importing_registers_every_named_strategy_with_fabric() -> None:
    from lightning.fabric.strategies import STRATEGY_REGISTRY

    for name in ("ddp_gradcomp", *NAMED_STRATEGIES):
        assert STRATEGY_REGISTRY[name]["strategy"] is GradCompFabricStrategy
        assert STRATEGY_REGISTRY[name]["init_params"] == NAMED_STRATEGIES.get(name, ("", {}))[1]


def _torchrun(args: list[str], timeout: float = 180) -> str:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
               str(free_port()), "-m", "lightning_gradcomp.examples.torchrun_train", *args]  # fmt: skip
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_the_torchrun_example_trains_reports_its_bytes_and_resumes_exactly(tmp_path: Path) -> None:
    output = _torchrun(["--steps", "40", "--checkpoint", str(tmp_path / "straight")])
    found = re.search(r"step 40, val_acc (\S+); bytes sent per step ([\d,]+) \(dense ([\d,]+)\)", output)
    assert found, output
    accuracy, sent, dense = float(found[1]), int(found[2].replace(",", "")), int(found[3].replace(",", ""))
    assert accuracy > 0.3  # 10 classes: chance is 0.1
    assert 0 < sent < dense
    _torchrun(["--steps", "20", "--checkpoint", str(tmp_path / "resumed")])
    _torchrun(["--steps", "20", "--checkpoint", str(tmp_path / "resumed")])
    for rank in range(2):
        straight = torch.load(tmp_path / "straight" / f"rank{rank:05d}-of-00002.pt", weights_only=True)
        resumed = torch.load(tmp_path / "resumed" / f"rank{rank:05d}-of-00002.pt", weights_only=True)
        assert resumed["step"] == straight["step"] == 40
        for key, tensor in straight["model"].items():
            assert torch.equal(resumed["model"][key], tensor), key
        assert resumed["hook"]["memory"].keys() == straight["hook"]["memory"].keys() != set()
        for key, tensor in straight["hook"]["memory"].items():
            assert torch.equal(resumed["hook"]["memory"][key], tensor), key


def test_the_fabric_example_trains_and_reports_its_bytes() -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1", MASTER_PORT=str(free_port()))
    command = [sys.executable, "-m", "lightning_gradcomp.examples.fabric_train", "--steps", "40"]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    found = re.search(r"ddp_topk: val_acc (\S+); bytes sent per step ([\d,]+) \(dense ([\d,]+)\)", done.stdout)
    assert found, done.stdout
    assert float(found[1]) > 0.3
    assert 0 < int(found[2].replace(",", "")) < int(found[3].replace(",", ""))


@pytest.mark.parametrize("world_size", [2, 3])
def test_fabric_refuses_a_second_model_and_make_hook_refuses_ranks_that_disagree(
    world_size: int, every_rank: EveryRank
) -> None:
    for result in every_rank(world_size, "refusals"):
        assert "one model" in result["second model"]
        assert result["disagreeing make_hook"].startswith("gradient compression settings differ across ranks; ")
        expected = "compressor: rank 0 has WirePrecision(TopKCompressor(density=0.01), 'bf16'), rank 1 has"
        assert expected in result["disagreeing make_hook"]
        assert "schedule: rank 0 has Accordion(density=0.01, critical_density=0.04" in result["disagreeing make_hook"]


def test_fabric_strategy_refuses_a_misspelt_argument_by_name() -> None:
    with pytest.raises(ValueError, match=r"unknown arguments \['densty'\].*'densty': did you mean 'density'\?"):
        GradCompFabricStrategy(densty=0.01)
    with pytest.raises(ValueError, match=r"on_world_size_change decides what the strategies do"):
        make_hook(nn.Linear(4, 2), on_world_size_change="reset")
