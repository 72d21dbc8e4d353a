"""A deterministic built-in task: labels from a fixed random linear teacher, no download needed."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics import MeanMetric

from lightning_gradcomp.core.validation import check_int, check_number


def teacher_dataset(n: int, features: int, classes: int, seed: int) -> TensorDataset:
    """``n`` inputs from N(0, 1) labelled by argmax of a random linear map drawn from ``seed``.

    The teacher is drawn from ``seed`` alone, so train and test sets built with different ``n``
    from the same seed share it; inputs for a test set come from ``seed + 1``.
    """
    teacher = torch.randn(features, classes, generator=torch.Generator().manual_seed(seed))
    x = torch.randn(n, features, generator=torch.Generator().manual_seed(seed + n))
    return TensorDataset(x, (x @ teacher).argmax(dim=1))


class TeacherDataModule(pl.LightningDataModule):
    """Train/validation splits of :func:`teacher_dataset` (different inputs, same teacher).

    Args:
        features: input dimension.
        classes: number of classes (outputs of the teacher).
        train_size: training examples.
        val_size: validation examples.
        batch_size: per-process training batch size.
        seed: draws the teacher and the inputs.
    """

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
        for name, value, minimum in (
            ("features", features, 1),
            ("classes", classes, 2),
            ("train_size", train_size, 1),
            ("val_size", val_size, 1),
            ("batch_size", batch_size, 1),
            ("seed", seed, 0),
        ):
            check_int(name, value, minimum)
        self.features, self.classes, self.batch_size = features, classes, batch_size
        self.train_size, self.val_size, self.seed = train_size, val_size, seed

    def train_dataloader(self) -> DataLoader:
        data = teacher_dataset(self.train_size, self.features, self.classes, self.seed)
        return DataLoader(data, batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        data = teacher_dataset(self.val_size, self.features, self.classes, self.seed)
        return DataLoader(data, batch_size=256)


class MLPClassifier(pl.LightningModule):
    """Two-layer perceptron with SGD + momentum 0.9; logs ``train_loss``, ``val_loss`` and ``val_acc``.

    Args:
        features: input dimension.
        hidden: width of the hidden layer.
        classes: outputs.
        lr: learning rate, > 0.
    """

    def __init__(self, features: int = 64, hidden: int = 512, classes: int = 10, lr: float = 0.05) -> None:
        super().__init__()
        for name, value, minimum in (("features", features, 1), ("hidden", hidden, 1), ("classes", classes, 2)):
            check_int(name, value, minimum)
        check_number("lr", lr, 0, open_min=True)
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(features, hidden), nn.ReLU(), nn.Linear(hidden, classes))
        self.val_accuracy = MeanMetric()  # per-sample mean over every rank's batches

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        self.log("val_loss", nn.functional.cross_entropy(logits, y), sync_dist=True)
        self.val_accuracy.update((logits.argmax(dim=1) == y).float())
        self.log("val_acc", self.val_accuracy)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)
