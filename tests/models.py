"""A small classifier and a deterministic task for end-to-end tests."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def teacher_task(n: int = 1024, features: int = 32, classes: int = 4, seed: int = 0) -> TensorDataset:
    """Inputs from N(0, 1), labels from a fixed random linear teacher: learnable, deterministic."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, features, generator=gen)
    teacher = torch.randn(features, classes, generator=gen)
    return TensorDataset(x, (x @ teacher).argmax(dim=1))


class TinyClassifier(pl.LightningModule):
    """Two-layer MLP: weights of 2048 and 256 elements, biases of 64 and 4."""

    def __init__(self, features: int = 32, hidden: int = 64, classes: int = 4, lr: float = 0.1) -> None:
        super().__init__()
        self.lr = lr
        self.net = nn.Sequential(nn.Linear(features, hidden), nn.ReLU(), nn.Linear(hidden, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


class ShuffledClassifier(TinyClassifier):
    """Three layers registered in another order than backward reaches them (head, body, stem).

    DDP's initial bucket layout (one bucket in torch 2.13, parameters in reverse registration
    order) therefore differs from the one it rebuilds after the first step (gradient-ready order,
    capped by ``bucket_cap_mb``): the layout a resumed run starts from is not the one it left.
    Weights of 256, 4096 and 2048 elements; biases of 4, 64 and 64.
    """

    def __init__(self, features: int = 32, hidden: int = 64, classes: int = 4, lr: float = 0.1) -> None:
        pl.LightningModule.__init__(self)
        self.lr = lr
        self.head = nn.Linear(hidden, classes)
        self.body = nn.Linear(hidden, hidden)
        self.stem = nn.Linear(features, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.body(torch.relu(self.stem(x)))))


class SitsOut(pl.LightningModule):
    """A body and head used every step, an auxiliary head used on odd steps, a side branch on rank 0 every third."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(32, 64)
        self.head = nn.Linear(64, 4)
        self.aux = nn.Linear(64, 16)  # 16 classes of which the labels use 4: a matrix PowerSGD cannot send exactly
        self.side = nn.Linear(64, 16)

    def uses(self, step: int, rank: int) -> dict[str, bool]:
        return {"aux": step % 2 == 1, "side": rank == 0 and step % 3 == 0}

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        h = torch.relu(self.body(x))
        loss = nn.functional.cross_entropy(self.head(h), y)
        uses = self.uses(self.global_step, self.global_rank)
        for name in ("aux", "side"):
            if uses[name]:
                loss = loss + 0.5 * nn.functional.cross_entropy(getattr(self, name)(h), y)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def quiet_trainer(
    strategy: pl.strategies.Strategy | str,
    world_size: int,
    steps: int,
    callbacks: list[pl.Callback] | None = None,
    logger: pl.loggers.Logger | bool = False,
    **options: Any,
) -> pl.Trainer:
    """A CPU Trainer of ``steps`` steps on ``world_size`` devices that prints nothing, logs only to ``logger`` and
    checkpoints only when a ``ModelCheckpoint`` is among ``callbacks``; ``options`` go to the Trainer as they are
    (``precision``, ``plugins``)."""
    return pl.Trainer(
        accelerator="cpu",
        devices=world_size,
        strategy=strategy,
        max_steps=steps,
        logger=logger,
        enable_checkpointing=any(isinstance(c, pl.callbacks.ModelCheckpoint) for c in callbacks or []),
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
        **options,
    )


def fit(
    strategy: pl.strategies.Strategy | str,
    world_size: int,
    steps: int,
    seed: int = 0,
    callbacks: list[pl.Callback] | None = None,
    samples: int = 1024,
    ckpt_path: str | None = None,
    model_class: type[TinyClassifier] = TinyClassifier,
) -> tuple[TinyClassifier, pl.Trainer]:
    """Fit a fresh ``model_class`` (same init on every rank) for ``steps`` steps on CPU."""
    pl.seed_everything(seed, verbose=False)
    model = model_class()
    trainer = quiet_trainer(strategy, world_size, steps, callbacks)
    trainer.fit(model, DataLoader(teacher_task(n=samples), batch_size=16), ckpt_path=ckpt_path)
    return model, trainer
