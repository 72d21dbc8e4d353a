"""A deterministic built-in task: labels from a fixed random linear teacher, no download needed."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def teacher_dataset(n: int, features: int, classes: int, seed: int) -> TensorDataset:
    """``n`` inputs from N(0, 1) labelled by argmax of a random linear map drawn from ``seed``.

    The teacher is drawn from ``seed`` alone, so train and test sets built with different ``n``
    from the same seed share it; inputs for a test set come from ``seed + 1``.
    """
    teacher = torch.randn(features, classes, generator=torch.Generator().manual_seed(seed))
    x = torch.randn(n, features, generator=torch.Generator().manual_seed(seed + n))
    return TensorDataset(x, (x @ teacher).argmax(dim=1))


class TeacherDataModule(pl.LightningDataModule):
    """Train/validation splits of :func:`teacher_dataset` (different inputs, same teacher)."""

    def __init__(
        self,
        features: int = 64,
        classes: int = 10,
        train_size: int = 8192,
        val_size: int = 2048,
        batch_size: int = 32,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.features, self.classes, self.batch_size = features, classes, batch_size
        self.train_size, self.val_size, self.seed = train_size, val_size, seed

    def train_dataloader(self) -> DataLoader:
        data = teacher_dataset(self.train_size, self.features, self.classes, self.seed)
        return DataLoader(data, batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        data = teacher_dataset(self.val_size, self.features, self.classes, self.seed)
        return DataLoader(data, batch_size=256)


class MLPClassifier(pl.LightningModule):
    """Two-layer perceptron with SGD + momentum; logs ``val_acc``."""

    def __init__(self, features: int = 64, hidden: int = 512, classes: int = 10, lr: float = 0.05) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(features, hidden), nn.ReLU(), nn.Linear(hidden, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        self.log("val_acc", (self(x).argmax(dim=1) == y).float().mean(), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)
