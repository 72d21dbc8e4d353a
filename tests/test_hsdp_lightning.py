"""Compressed HSDP under Lightning (:class:`~lightning_gradcomp.GradCompHSDPStrategy`,
:class:`~lightning_gradcomp.GradCompHSDPFabricStrategy`), 4 gloo processes as 2 replicas x 2 shards: the dense
exchange is FSDP2's own HSDP fed the same batches, bit for bit; Top-k with error feedback keeps every replica alike
after every step with fewer bytes, one record per optimizer step (gradient accumulation exchanges once); units made in
``configure_model`` are used as they are; a run stopped at a checkpoint and resumed ends where the straight run does
(weights, optimizer, each rank's memory), under the Trainer and under Fabric; bad arguments are ``ValueError``\\s
naming them."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.fabric import Fabric
from lightning.pytorch.callbacks import ModelCheckpoint
from models import quiet_trainer
from ranks import run_ranks
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_gradcomp import (
    HSDP_PRESETS,
    CompressionMonitor,
    GradCompHSDPFabricStrategy,
    GradCompHSDPStrategy,
)
from lightning_gradcomp.core.checkpoint import shard_path
from lightning_gradcomp.hsdp.sharding import shard_model

EPOCH = 4  # optimizer steps per epoch on each rank
UNITS = ["blocks.0", "blocks.1", "head", "stem"]


def _data(world_size: int, batches: int = EPOCH) -> TensorDataset:
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(16 * batches * world_size, 8, generator=generator)
    return TensorDataset(x, x[:, :2] * 2 + 0.1 * torch.randn(len(x), 2, generator=generator))


class Blocks(nn.Module):
    """A stem, two blocks in a ``ModuleList`` (the default units) and a head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.stem = nn.Linear(8, 32)
        self.blocks = nn.ModuleList([nn.Linear(32, 32) for _ in range(2)])
        self.head = nn.Linear(32, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.stem(x))
        for block in self.blocks:
            h = torch.tanh(block(h))
        return self.head(h)


class BlocksModule(pl.LightningModule):
    """:class:`Blocks`' layers held by the LightningModule itself; it keeps the batches it trained on."""

    def __init__(self, shard_in_configure_model: bool = False) -> None:
        super().__init__()
        model = Blocks()
        self.stem, self.blocks, self.head = model.stem, model.blocks, model.head
        self.shard_in_configure_model = shard_in_configure_model
        self.batches: list[tuple[torch.Tensor, torch.Tensor]] = []

    def configure_model(self) -> None:
        if self.shard_in_configure_model:
            from torch.distributed.fsdp import fully_shard

            for unit in (*self.blocks, self.stem, self.head):
                fully_shard(unit, mesh=self.device_mesh["shard"])

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        self.batches.append((x.clone(), y.clone()))
        return nn.functional.mse_loss(Blocks.forward(self, x), y)  # type: ignore[arg-type]

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def _full(module: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.full_tensor().detach().clone() for name, p in module.named_parameters()}


class FullWeights(pl.Callback):
    """The full weights after every optimizer step (every rank gathers them)."""

    def __init__(self) -> None:
        self.after: list[dict[str, torch.Tensor]] = []

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self.after.append(_full(pl_module))


def _fit(strategy: GradCompHSDPStrategy, module: BlocksModule, steps: int, **kwargs: Any) -> dict[str, Any]:
    pl.seed_everything(0, verbose=False)
    weights = FullWeights()
    callbacks = [weights, *kwargs.pop("callbacks", [])]
    accumulate = kwargs.pop("accumulate_grad_batches", 1)
    trainer = quiet_trainer(strategy, 4, steps, callbacks, precision=kwargs.pop("precision", "32-true"))
    trainer.accumulate_grad_batches = accumulate
    trainer.fit(module, DataLoader(_data(4, EPOCH * accumulate), batch_size=16), **kwargs)
    exchange = strategy.replica_exchange
    assert exchange is not None
    return {
        "after": weights.after,
        "units": exchange.units,
        "history": [(s.step, s.bytes_sent, s.dense_bytes, s.collectives, sorted(s.layers)) for s in exchange.history],
        "memory": {k: v.clone() for k, v in exchange.memory.state_dict().items()},
        "numel": sum(s.numel for s in exchange.history),
    }


def _native_reference(batches: list[tuple[torch.Tensor, torch.Tensor]]) -> list[dict[str, torch.Tensor]]:
    """FSDP2's own HSDP (units sharded over the 2-D mesh) in a plain loop, fed the batches the Trainer fed."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = Blocks()
    shard_model(model, mesh, shard_root=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    after = []
    for x, y in batches:
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        after.append(_full(model))
    return after


def _trainer_runs(rank: int, world_size: int) -> dict[str, Any]:
    dense_module = BlocksModule()
    dense = _fit(GradCompHSDPStrategy(**HSDP_PRESETS["hsdp_dense"][1], replicate_size=2), dense_module, EPOCH)
    topk = _fit(GradCompHSDPStrategy(**HSDP_PRESETS["hsdp_topk"][1], replicate_size=2), BlocksModule(), EPOCH)
    monitor = CompressionMonitor(every_n_steps=2, print_summary=False)
    accumulated = _fit(
        GradCompHSDPStrategy(density=0.1, replicate_size=2),
        BlocksModule(shard_in_configure_model=True),
        EPOCH,
        accumulate_grad_batches=2,
        callbacks=[monitor],
    )
    summary = monitor.summary[-1]
    bf16 = _fit(GradCompHSDPStrategy(density=0.1, replicate_size=2), BlocksModule(), 2, precision="bf16-true")
    return {
        "bf16": bf16,
        "dense": dense,
        "native": _native_reference(dense_module.batches),
        "topk": topk,
        "accumulated": accumulated,
        "monitor": (summary.steps, summary.bytes_sent, summary.dense_bytes),
        "first_batch": dense_module.batches[0][0],
    }


def test_the_trainer_strategy_is_fsdp2s_own_hsdp_dense_and_keeps_replicas_alike_compressed() -> None:
    """Also catches: units the strategy shards reducing their gradients in bf16 under ``bf16-true`` (no float32
    reduce policy: the residual would lose small values)."""
    ranks = run_ranks(_trainer_runs, 4, init=False)
    for one, other in itertools.combinations(ranks, 2):  # every rank trains on its own share of the data
        assert not torch.equal(one["first_batch"], other["first_batch"])
    for rank, result in enumerate(ranks):
        shard = rank % 2  # ranks laid out node by node: the shard index is the local rank
        assert result["dense"]["units"] == sorted(f"{unit}#shard{shard}" for unit in UNITS)
        for step in range(EPOCH):
            for name, value in result["native"][step].items():
                # two replicas: a sum of two in any order is exact, and both pre-divide by 2 (a power of two)
                assert torch.equal(result["dense"]["after"][step][name], value), (rank, step, name)
                assert torch.equal(result["topk"]["after"][step][name], ranks[0]["topk"]["after"][step][name])
        assert not torch.equal(result["topk"]["after"][-1]["stem.weight"], result["dense"]["after"][-1]["stem.weight"])
        for run in ("dense", "topk", "accumulated"):
            history = result[run]["history"]
            assert [s[0] for s in history] == list(range(EPOCH))  # one record per optimizer step, accumulation too
            assert all(calls == len(UNITS) and layers == result[run]["units"] for *_, calls, layers in history)
        dense_bytes = {s[2] for s in result["dense"]["history"]}
        assert {s[1] for s in result["dense"]["history"]} == dense_bytes  # the dense exchange sends the shards
        assert all(0 < sent < dense / 4 for _, sent, dense, *_ in result["topk"]["history"])
        # the monitor's figures per optimizer step, all ranks together: the records' own
        steps, sent, dense = result["monitor"]
        assert steps == EPOCH
        total = sum(s[1] for r in ranks for s in r["accumulated"]["history"])
        assert sent == pytest.approx(total / EPOCH, rel=1e-12)
        assert dense == pytest.approx(4 * dense_bytes.pop(), rel=1e-12)
        # bf16-true: bf16 weights, but every shard the exchange got (and each residual kept for it) in float32
        bf16 = result["bf16"]
        assert {value.dtype for value in bf16["after"][-1].values()} == {torch.bfloat16}
        assert sum(s[2] for s in bf16["history"]) == 4 * bf16["numel"] > 0
        assert {value.dtype for value in bf16["memory"].values()} == {torch.float32}


ARGUMENTS = {"compressor": "randomk", "compressor_kwargs": {"scaled": False}, "density": 0.2, "memory": "ef"}


def _stopped(rank: int, world_size: int, out: str) -> dict[str, Any]:
    checkpoint = ModelCheckpoint(dirpath=out, filename="half", every_n_train_steps=EPOCH, save_top_k=-1)
    straight = _fit(GradCompHSDPStrategy(**ARGUMENTS, replicate_size=2), BlocksModule(), 2 * EPOCH)
    _fit(GradCompHSDPStrategy(**ARGUMENTS, replicate_size=2), BlocksModule(), EPOCH, callbacks=[checkpoint])
    return {"straight": straight, "shard": Path(shard_path(Path(out) / "half.ckpt", rank, world_size)).is_file()}


def _resumed(rank: int, world_size: int, out: str) -> dict[str, Any]:
    strategy = GradCompHSDPStrategy(**ARGUMENTS, replicate_size=2)
    resumed = _fit(strategy, BlocksModule(), 2 * EPOCH, ckpt_path=str(Path(out) / "half.ckpt"))
    refused = []
    for other in ({**ARGUMENTS, "memory": "none", "replicate_size": 2}, {**ARGUMENTS, "replicate_size": 4}):
        try:
            _fit(GradCompHSDPStrategy(**other), BlocksModule(), 2 * EPOCH, ckpt_path=str(Path(out) / "half.ckpt"))
        except ValueError as error:
            refused.append(str(error))
    return {"resumed": resumed, "refused": refused}


def test_the_trainer_resumes_each_ranks_exchange_state_exactly(tmp_path: Path) -> None:
    first = run_ranks(_stopped, 4, str(tmp_path), init=False)
    again = run_ranks(_resumed, 4, str(tmp_path), init=False)
    for rank in range(4):
        straight, resumed = first[rank]["straight"], again[rank]["resumed"]
        assert first[rank]["shard"]
        assert [s[0] for s in resumed["history"]] == list(range(EPOCH, 2 * EPOCH))  # the step counts came back
        for name, value in straight["after"][-1].items():
            assert torch.equal(value, resumed["after"][-1][name]), (rank, name)
        for name, value in straight["memory"].items():
            assert torch.equal(value, resumed["memory"][name]), (rank, name)
        other_memory, other_mesh = again[rank]["refused"]
        assert "holds the HSDP exchange state of memory 'ef' and compressor 'randomk'" in other_memory
        assert "of a (replicate, shard) mesh (2, 2), but this run's is (4, 1)" in other_mesh


def _fabric_loop(rank: int, folder: str, steps: range, load: bool, save_at: int | None) -> dict[str, Any]:
    strategy = GradCompHSDPFabricStrategy(**ARGUMENTS, replicate_size=2)
    fabric = Fabric(accelerator="cpu", devices=4, strategy=strategy)
    fabric.launch()
    model = fabric.setup_module(Blocks())
    optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    state = {"model": model, "optimizer": optimizer}
    if load:
        fabric.load(Path(folder) / "fabric", state)
    data = _data(4, 4 * EPOCH)
    for step in steps:
        for micro in range(2):  # two micro-batches a step: the first without exchanging
            index = (2 * step + micro) * 64 + 16 * rank
            x, y = data[index : index + 16]
            with fabric.no_backward_sync(model, enabled=micro == 0):
                fabric.backward(nn.functional.mse_loss(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
        if save_at is not None and step + 1 == save_at:
            fabric.save(Path(folder) / "fabric", state)
    assert strategy.replica_exchange is not None
    return {
        "weights": _full(model.module),
        "steps": [s.step for s in strategy.replica_exchange.history],
        "calls": {s.collectives for s in strategy.replica_exchange.history},
    }


def _fabric_runs(rank: int, world_size: int, folder: str) -> dict[str, Any]:
    straight = _fabric_loop(rank, folder, range(2 * EPOCH), load=False, save_at=EPOCH)
    resumed = _fabric_loop(rank, folder, range(EPOCH, 2 * EPOCH), load=True, save_at=None)
    return {"straight": straight, "resumed": resumed}


def test_fabric_accumulates_without_exchanging_and_resumes_exactly(tmp_path: Path) -> None:
    for rank in run_ranks(_fabric_runs, 4, str(tmp_path), init=False):
        assert rank["straight"]["steps"] == list(range(2 * EPOCH))  # one exchange per step, not per micro-batch
        assert rank["straight"]["calls"] == {3}  # the blocks, then the root (stem and head) under Fabric
        assert rank["resumed"]["steps"] == list(range(EPOCH, 2 * EPOCH))
        for name, value in rank["straight"]["weights"].items():
            assert torch.equal(value, rank["resumed"]["weights"][name]), name


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"replicate_size": 0}, "replicate_size must be an integer >= 1"),
        ({"replicate_size": "two"}, "replicate_size must be an integer >= 1"),
        ({"unit_modules": [3]}, "unit_modules must be None or a non-empty list"),
        ({"unit_modules": []}, "unit_modules must be None or a non-empty list"),
        ({"reshard_after_forward": "yes"}, "reshard_after_forward"),
        ({"compressor": "powersgd", "aggregator": "allreduce"}, "needs each tensor's own shape"),
        ({"compressor": "topk", "memory": "diana"}, "memory='diana' needs a compressor that is unbiased"),
        ({"compressor": "qsgd", "aggregator": "gtopk"}, "aggregator='gtopk' merges sparse payloads"),
        ({"min_compress_numel": -1}, "min_compress_numel"),
    ],
)
@pytest.mark.parametrize("strategy", [GradCompHSDPStrategy, GradCompHSDPFabricStrategy])
def test_bad_arguments_are_value_errors_naming_them(strategy: type, arguments: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        strategy(**arguments)


def test_a_replicate_size_that_does_not_divide_the_world_is_refused_before_any_mesh_is_built() -> None:
    for strategy in (GradCompHSDPStrategy, GradCompHSDPFabricStrategy):
        with pytest.raises(ValueError, match="replicate_size=3 must divide the world size 4"):
            strategy(replicate_size=3).build_mesh("cpu", 4, 1)


def test_a_lightning_module_holding_parameters_itself_is_refused_before_anything_is_sharded() -> None:
    module = BlocksModule()
    module.scale = nn.Parameter(torch.ones(1))
    with pytest.raises(ValueError, match=r"holds parameters \['scale'\] itself"):
        shard_model(module, None, shard_root=False)  # type: ignore[arg-type]


def test_the_presets_are_registered_with_the_trainer_and_fabric() -> None:
    from lightning.fabric.strategies import STRATEGY_REGISTRY
    from lightning.pytorch.strategies import StrategyRegistry

    for name, (_, arguments) in HSDP_PRESETS.items():
        assert StrategyRegistry[name]["strategy"] is GradCompHSDPStrategy
        assert StrategyRegistry[name]["init_params"] == arguments
        assert STRATEGY_REGISTRY[name]["strategy"] is GradCompHSDPFabricStrategy
    assert StrategyRegistry["hsdp_gradcomp"]["strategy"] is GradCompHSDPStrategy


def test_the_blocks_are_the_module_lists_elements_or_the_classes_named() -> None:
    from lightning_gradcomp.hsdp.sharding import check_unit_modules, is_unit

    block, stem = nn.Linear(2, 2), nn.Conv2d(1, 1, 1)
    assert is_unit(block, None, in_module_list=True) and not is_unit(stem, None, in_module_list=False)
    for named in (["Linear"], [nn.Linear], "Linear"):
        units = check_unit_modules(named)
        assert is_unit(block, units, in_module_list=False) and not is_unit(stem, units, in_module_list=True)


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight


class _Experts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.experts = nn.ModuleList([nn.Linear(4, 4) for _ in range(2)])


def test_the_plan_takes_outer_blocks_and_refuses_tied_weights_across_units_and_unknown_unit_classes() -> None:
    from lightning_gradcomp.hsdp.sharding import check_tied, plan_units

    model = nn.Module()
    model.layers = nn.ModuleList([_Experts() for _ in range(2)])
    model.head = nn.Linear(4, 2)
    assert [name for name, _ in plan_units(model, None, shard_root=True)] == ["layers.1", "layers.0", ""]
    assert [name for name, _ in plan_units(model, None, shard_root=False)] == ["layers.1", "layers.0", "head"]
    with pytest.raises(ValueError, match=r"unit_modules \['Block'\] match no block"):
        plan_units(model, ("Block",), shard_root=True)
    tied = pl.LightningModule()
    tied.net = _Tied()
    plan = plan_units(tied, None, shard_root=False)
    assert [name for name, _ in plan] == ["net"]
    check_tied(tied, plan)  # one unit holds both: fine
    block = nn.Linear(4, 4)
    reused = nn.Module()
    reused.layers = nn.ModuleList([block, block])  # one block at every depth: one unit, called twice
    reused.head = nn.Linear(4, 2)
    plan = plan_units(reused, None, shard_root=True)
    assert [name for name, _ in plan] == ["layers.0", ""]
    check_tied(reused, plan)
    nested = plan_units(model, ("_Experts", nn.Linear), shard_root=True)  # named blocks nest: innermost first
    assert [name for name, _ in nested][:3] == ["head", "layers.1.experts.1", "layers.1.experts.0"]
    assert [name for name, _ in nested][-3:] == ["layers.0.experts.0", "layers.0", ""]
    extra = pl.LightningModule()
    extra.net, extra.scales = nn.Linear(2, 2), nn.ParameterList([nn.Parameter(torch.ones(2))])
    with pytest.raises(ValueError, match=r"scales \(ParameterList\) holds parameters without a forward"):
        plan_units(extra, None, shard_root=False)
    loose = pl.LightningModule()
    loose.embed, loose.head = nn.Embedding(10, 4), nn.Linear(4, 10, bias=False)
    loose.head.weight = loose.embed.weight
    with pytest.raises(ValueError, match=r"embed.weight \(in \['embed', 'head'\]\)\"\] would be held by two FSDP"):
        shard_model(loose, None, shard_root=False)  # type: ignore[arg-type]
    assert loose.head.weight is loose.embed.weight  # refused before anything was sharded


def test_precisions_lightning_refuses_for_model_parallel_are_refused_by_name_too() -> None:
    from lightning.pytorch.plugins.precision import MixedPrecision

    strategy = GradCompHSDPStrategy()
    strategy.precision_plugin = MixedPrecision("16-mixed", "cpu")
    with pytest.raises(ValueError, match=r"does not support precision='16-mixed'"):
        strategy.setup_environment()
