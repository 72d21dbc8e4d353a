"""Models as users bring them, under Top-k + error feedback, TernGrad, PowerSGD and DIANA, on 2 ranks.

Hugging Face's ResNet (BatchNorm, built from a config, random weights), a bfloat16 model with float32 norms, a
model compiled with ``torch.compile`` (Lightning's own route: the compiled module given to ``fit``), and a model
with parameters that sit out steps (``find_unused_parameters=True``). Each case trains ``2 N`` steps three ways,
as tests/test_resume.py does: straight; ``N`` steps checkpointed; resumed from that checkpoint in fresh processes.
Every case, every method: ranks hold identical weights after every step; the loss falls; every step after the
first sends fewer bytes than DDP would; the resumed run ends with the straight run's weights and memory, bit for
bit. DDP's buckets are small (several; rebuilt after the first step, except under find_unused_parameters), as
in a real model.
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from models import SitsOut, quiet_trainer, teacher_task
from ranks import run_ranks
from torch import nn
from torch.utils.data import DataLoader

from lightning_gradcomp import GradCompStrategy

N = 4
PRESETS = ("ddp_topk", "ddp_terngrad", "ddp_powersgd", "ddp_diana")
CASES = ("hf-resnet", "bf16-norms", "compiled", "sits-out")
SIDE = 12  # images of 1 x 12 x 12 for the ResNet


class HuggingFaceResNet(pl.LightningModule):
    """transformers' ResNet for image classification from a config: BatchNorm in every stage, random weights."""

    def __init__(self) -> None:
        super().__init__()
        import transformers

        config = transformers.ResNetConfig(
            num_channels=1, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], num_labels=4, layer_type="basic"
        )
        self.model = transformers.ResNetForImageClassification(config)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return self.model(pixel_values=x.view(-1, 1, SIDE, SIDE), labels=y).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)


class Bf16WithNorms(pl.LightningModule):
    """Linear layers in bfloat16, LayerNorms in float32 (a bf16 model that keeps its norms in full precision)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            [nn.Linear(32, 64), nn.LayerNorm(64), nn.Linear(64, 64), nn.LayerNorm(64), nn.Linear(64, 4)]
        )
        for layer in self.layers:
            if isinstance(layer, nn.Linear):
                layer.to(torch.bfloat16)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        for layer in self.layers:
            x = layer(x.to(layer.weight.dtype))
            x = torch.relu(x) if isinstance(layer, nn.LayerNorm) else x
        return nn.functional.cross_entropy(x.float(), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Compiled(Bf16WithNorms):
    """An MLP in float32 of 2.1 MB, given to the Trainer compiled (``aot_eager``: no C++ compiler needed). Dynamo
    splits the graph at DDP's buckets and needs them no smaller than DDP's first, of 1 MiB: several buckets need
    a model this size."""

    def __init__(self) -> None:
        pl.LightningModule.__init__(self)
        self.layers = nn.ModuleList(
            [nn.Linear(32, 512), nn.LayerNorm(512), nn.Linear(512, 512), nn.Linear(512, 512), nn.Linear(512, 4)]
        )


def _module(case: str) -> pl.LightningModule | torch.nn.Module:
    if case == "hf-resnet":
        return HuggingFaceResNet()
    if case == "bf16-norms":
        return Bf16WithNorms()
    if case == "compiled":
        return torch.compile(Compiled(), backend="aot_eager")
    return SitsOut()


def _strategy(case: str, preset: str) -> GradCompStrategy:
    options: dict[str, Any] = {"density": 0.05} if preset == "ddp_topk" else {}
    if case == "sits-out":
        options["find_unused_parameters"] = True
    return GradCompStrategy.from_preset(
        preset,
        warmup_steps=1,
        adaptive="none",  # compress from the second step (PowerSGD's critical regimes would be dense)
        min_compress_numel=100,
        bucket_cap_mb=1.0 if case == "compiled" else 0.002,
        timeout=timedelta(seconds=60),
        **options,
    )


class Record(pl.Callback):
    def __init__(self) -> None:
        self.weights: list[dict[str, torch.Tensor]] = []
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, outputs, batch, batch_idx) -> None:
        # the parameters; BatchNorm's running statistics differ across ranks between steps, as under plain DDP,
        # which broadcasts rank 0's at the next forward pass
        self.weights.append({k: v.detach().clone() for k, v in module.named_parameters()})
        self.losses.append(float(outputs["loss"]))


def _fit(case: str, preset: str, world_size: int, steps: int, **kwargs: Any) -> dict:
    pl.seed_everything(0, verbose=False)
    module = _module(case)
    strategy = _strategy(case, preset)
    record = Record()
    trainer = quiet_trainer(strategy, world_size, steps, [record, *kwargs.pop("callbacks", [])])
    features = SIDE * SIDE if case == "hf-resnet" else 32
    data = DataLoader(teacher_task(n=16 * N * world_size, features=features), batch_size=16)
    trainer.fit(module, data, **kwargs)
    hook = strategy.gradcomp_hook
    return {
        "weights": record.weights,
        "losses": record.losses,
        "state": {k: v.clone() for k, v in module.state_dict().items()},
        "memory": {k: v.clone() for k, v in strategy.memory.state_dict().items()},
        "bytes": [(s.bytes_sent, s.dense_bytes) for s in hook.history],
        "buckets": [s.buckets for s in hook.history],
    }


def _straight_and_stopped(rank: int, world_size: int, out: str) -> dict:
    results = {}
    for case in CASES:
        if case == "hf-resnet" and not _has_transformers():
            continue
        for preset in PRESETS:
            path = Path(out) / case / preset
            checkpoint = ModelCheckpoint(dirpath=path, filename="half", every_n_train_steps=N, save_top_k=-1)
            results[case, preset] = {
                "straight": _fit(case, preset, world_size, 2 * N),
                "stopped": _fit(case, preset, world_size, N, callbacks=[checkpoint]),
            }
    return results


def _resumed(rank: int, world_size: int, out: str) -> dict:
    return {
        (case, preset): _fit(case, preset, world_size, 2 * N, ckpt_path=str(Path(out) / case / preset / "half.ckpt"))
        for case in CASES
        for preset in PRESETS
        if case != "hf-resnet" or _has_transformers()
    }


def _has_transformers() -> bool:
    try:
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict], list[dict]]:
    out = str(tmp_path_factory.mktemp("cases"))
    first = run_ranks(_straight_and_stopped, 2, out, init=False, timeout=600)
    return first, run_ranks(_resumed, 2, out, init=False, timeout=600)


@pytest.mark.parametrize("case", CASES)
def test_each_case_trains_alike_on_every_rank_sends_less_and_resumes_exactly(
    runs: tuple[list[dict], list[dict]], case: str
) -> None:
    if case == "hf-resnet":
        pytest.importorskip("transformers")
    first, resumed = runs
    for preset in PRESETS:
        label = f"{case}, {preset}"
        straight = first[0][case, preset]["straight"]
        for step, weights in enumerate(straight["weights"]):
            other = first[1][case, preset]["straight"]["weights"][step]
            for name, value in weights.items():
                assert torch.equal(value, other[name]), f"{label}: step {step}, {name}"
        assert sum(straight["losses"][-N:]) < sum(straight["losses"][:N]), (label, straight["losses"])
        assert straight["buckets"][N] > 1, label  # several buckets (rebuilt after step 1, unless DDP finds unused)
        for step, (sent, dense) in enumerate(straight["bytes"][1:], start=1):
            assert sent < dense, f"{label}: step {step} sent {sent} of {dense}"
        for rank in range(2):
            straight, again = first[rank][case, preset]["straight"], resumed[rank][case, preset]
            assert straight["memory"].keys() == again["memory"].keys(), label
            assert bool(straight["memory"]) == (preset != "ddp_terngrad"), label
            for name, value in straight["memory"].items():
                assert torch.equal(value, again["memory"][name]), f"{label}, rank {rank}: memory {name}"
            for name, value in straight["state"].items():  # parameters and buffers
                assert torch.equal(value, again["state"][name]), f"{label}, rank {rank}: {name}"


class SparseEmbedding(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 4)
        self.tokens = nn.EmbeddingBag(10, 4, sparse=True)


SPARSE_REFUSAL = (
    "parameter 'tokens.weight' gets sparse gradients (EmbeddingBag(sparse=True)); a DDP communication hook "
    "exchanges dense buckets only, so it cannot be compressed: build it with sparse=False (its gradient is then "
    "dense and compressed like any other), or freeze it"
)


def _make_hook_refuses(rank: int, world_size: int) -> str:
    from lightning_gradcomp import make_hook

    model = SparseEmbedding()
    try:
        make_hook(model, "ddp_topk")
    except ValueError as error:
        message = str(error)
    model.tokens.requires_grad_(False)  # frozen: nothing to exchange, nothing to refuse
    make_hook(model, "ddp_topk")
    return message


def test_a_parameter_with_sparse_gradients_is_refused_at_setup_by_name() -> None:
    assert run_ranks(_make_hook_refuses, 1) == [SPARSE_REFUSAL]


def _across_a_plan_change(rank: int, world_size: int, out: str) -> dict:
    from models import ShuffledClassifier, fit

    def strategy(keep: bool) -> GradCompStrategy:
        return GradCompStrategy.from_preset(
            "ddp_topk", keep_last_layer_dense=keep, density=0.05, min_compress_numel=100, adaptive="none"
        )

    checkpoint = ModelCheckpoint(dirpath=out, filename="half", every_n_train_steps=N, save_top_k=-1)
    before = strategy(keep=False)  # the head, registered first, compressed: it has a residual
    fit(before, world_size, N, callbacks=[checkpoint], samples=N * 16 * world_size, model_class=ShuffledClassifier)
    after = strategy(keep=True)
    model, _ = fit(
        after,
        world_size,
        N + 1,
        ckpt_path=str(Path(out) / "half.ckpt"),
        samples=(N + 1) * 16 * world_size,
        model_class=ShuffledClassifier,
    )
    return {
        "saved": before.memory.residual("head.weight").clone(),
        "resumed": after.memory.residual("head.weight").clone(),
        "dense": [n for unit in after.gradcomp_hook.units if not unit.compressed for n in unit.names],
        "weights": {k: v.detach().clone() for k, v in model.state_dict().items()},
    }


def test_a_residual_of_a_parameter_now_kept_dense_goes_with_the_first_resumed_step(tmp_path: Path) -> None:
    first, second = run_ranks(_across_a_plan_change, 2, str(tmp_path), init=False, timeout=300)
    assert "head.weight" in first["dense"]
    for rank in (first, second):
        assert rank["saved"].abs().sum() > 0  # owed when the checkpoint was written
        assert torch.equal(rank["resumed"], torch.zeros_like(rank["resumed"]))  # sent with the dense head
    for name, value in first["weights"].items():
        assert torch.equal(value, second["weights"][name]), name
