"""Example networks (LeNet-5, CIFAR ResNet-20 and ResNet-18, CIFAR AlexNet) and a LightningModule that trains them.

The networks are the ones the compression papers report on: LeNet-5 on MNIST
(TernGrad), ResNet-20 on CIFAR-10 (gTop-k, Gaussian_k), ResNet-18 on CIFAR-10 (ATOMO), AlexNet
(TernGrad, gTop-k), here in its usual 32x32 adaptation. They differ in what a compressor meets:
many small convolutions (ResNet-20: 0.27 M parameters), large convolutions (ResNet-18: 11 M),
or most of the weight in two fully connected layers (AlexNet: 23 M, 90 % in the classifier).
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from torch import nn
from torchmetrics import MeanMetric

from lightning_gradcomp.core.validation import check_int, check_number


class LeNet5(nn.Module):
    """LeNet-5 for 28x28 single-channel images (LeCun et al., 1998): 61,706 parameters."""

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        check_int("num_classes", num_classes, 2)
        self.features = nn.Sequential(
            nn.Conv2d(1, 6, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(6, 16, 5), nn.ReLU(), nn.MaxPool2d(2),
        )  # fmt: skip
        self.classifier = nn.Sequential(
            nn.Flatten(), nn.Linear(400, 120), nn.ReLU(), nn.Linear(120, 84), nn.ReLU(), nn.Linear(84, num_classes),
        )  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


class _Subsample(nn.Module):
    """Parameter-free shortcut of He et al. (2016), option A: stride-2 subsampling, zero channels appended."""

    def __init__(self, extra_channels: int) -> None:
        super().__init__()
        self.extra_channels = extra_channels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x[:, :, ::2, ::2]
        return nn.functional.pad(x, (0, 0, 0, 0, 0, self.extra_channels))


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with batch norm and a residual connection.

    Args:
        in_channels: channels coming in.
        channels: channels going out (and inside the block).
        stride: stride of the first convolution (2 halves the resolution).
        shortcut: ``"A"`` (parameter-free subsampling and zero channels, the CIFAR ResNets of the
            paper) or ``"B"`` (a strided 1x1 convolution with batch norm) when the shape changes.
    """

    def __init__(self, in_channels: int, channels: int, stride: int = 1, shortcut: str = "B") -> None:
        super().__init__()
        if shortcut not in ("A", "B"):
            raise ValueError(f"shortcut must be one of ['A', 'B'], got {shortcut!r}")
        self.conv1 = nn.Conv2d(in_channels, channels, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_channels != channels:
            if shortcut == "A":
                self.shortcut = _Subsample(channels - in_channels)
            else:
                self.shortcut = nn.Sequential(
                    nn.Conv2d(in_channels, channels, 1, stride=stride, bias=False), nn.BatchNorm2d(channels)
                )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return torch.relu(out + self.shortcut(x))


class CifarResNet(nn.Module):
    """The ResNets for 32x32 images of He et al. (2016), Sec. 4.2: depth ``6n + 2``.

    A 3x3 convolution to 16 channels, three stages of ``n`` basic blocks with 16, 32 and 64
    channels (the second and third start with stride 2), global average pooling and a linear
    classifier; shortcuts of option A (parameter-free), as in the paper.

    Args:
        depth: 20, 32, 44, 56, 110, ... (``(depth - 2) % 6 == 0``).
        num_classes: outputs of the classifier.
    """

    def __init__(self, depth: int = 20, num_classes: int = 10) -> None:
        super().__init__()
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 8 or (depth - 2) % 6:
            raise ValueError(f"depth must be an integer 6n + 2 >= 8 (20, 32, 44, 56, 110, ...), got {depth!r}")
        check_int("num_classes", num_classes, 2)
        n = (depth - 2) // 6
        self.conv = nn.Conv2d(3, 16, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(16)
        blocks: list[nn.Module] = []
        in_channels = 16
        for stage, channels in enumerate((16, 32, 64)):
            for i in range(n):
                stride = 2 if stage > 0 and i == 0 else 1
                blocks.append(BasicBlock(in_channels, channels, stride, shortcut="A"))
                in_channels = channels
        self.blocks = nn.Sequential(*blocks)
        self.fc = nn.Linear(64, num_classes)
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.blocks(torch.relu(self.bn(self.conv(x))))
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))


class ResNet20(CifarResNet):
    """ResNet-20 for CIFAR (He et al., 2016): 269,722 parameters with 10 classes (the paper: 0.27 M)."""

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__(depth=20, num_classes=num_classes)


class ResNet18(nn.Module):
    """ResNet-18 adapted to 32x32 images: 11,173,962 parameters with 10 classes.

    The ImageNet network's four stages of two basic blocks (64, 128, 256, 512 channels, option B
    shortcuts), with a 3x3 stride-1 first convolution and no max pooling, so that 32x32 inputs
    keep a 4x4 map in the last stage: the variant the ATOMO authors trained on CIFAR-10.
    """

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        check_int("num_classes", num_classes, 2)
        self.conv = nn.Conv2d(3, 64, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(64)
        blocks: list[nn.Module] = []
        in_channels = 64
        for stage, channels in enumerate((64, 128, 256, 512)):
            for i in range(2):
                blocks.append(BasicBlock(in_channels, channels, 2 if stage > 0 and i == 0 else 1, shortcut="B"))
                in_channels = channels
        self.blocks = nn.Sequential(*blocks)
        self.fc = nn.Linear(512, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.blocks(torch.relu(self.bn(self.conv(x))))
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))


class AlexNet(nn.Module):
    """AlexNet adapted to 32x32 images: five convolutions, three fully connected layers.

    Convolutions of 64, 192, 384, 256 and 256 channels (the first 3x3 with stride 2, three 2x2 max
    pools) leave a 256x2x2 map; the classifier is dropout, ``1024 -> hidden``, dropout,
    ``hidden -> hidden``, ``hidden -> num_classes``. With ``hidden=4096``, 23.3 M parameters,
    21 M of them in the two large fully connected layers, as in the ImageNet network.

    Args:
        num_classes: outputs of the classifier.
        hidden: width of the two hidden fully connected layers.
        dropout: dropout probability before each of them.
    """

    def __init__(self, num_classes: int = 10, hidden: int = 4096, dropout: float = 0.5) -> None:
        super().__init__()
        check_int("num_classes", num_classes, 2)
        check_int("hidden", hidden, 1)
        check_number("dropout", dropout, 0, 1, open_max=True)
        self.features = nn.Sequential(
            nn.Conv2d(3, 64, 3, stride=2, padding=1), nn.ReLU(inplace=True), nn.MaxPool2d(2),
            nn.Conv2d(64, 192, 3, padding=1), nn.ReLU(inplace=True), nn.MaxPool2d(2),
            nn.Conv2d(192, 384, 3, padding=1), nn.ReLU(inplace=True),
            nn.Conv2d(384, 256, 3, padding=1), nn.ReLU(inplace=True),
            nn.Conv2d(256, 256, 3, padding=1), nn.ReLU(inplace=True), nn.MaxPool2d(2),
        )  # fmt: skip
        self.classifier = nn.Sequential(
            nn.Flatten(),
            nn.Dropout(dropout), nn.Linear(256 * 2 * 2, hidden), nn.ReLU(inplace=True),
            nn.Dropout(dropout), nn.Linear(hidden, hidden), nn.ReLU(inplace=True),
            nn.Linear(hidden, num_classes),
        )  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


class ImageClassifier(pl.LightningModule):
    """Cross-entropy training of ``model`` with SGD + momentum; logs ``train_loss``, ``val_loss``, ``val_acc``.

    ``gradcomp test`` logs ``test_loss`` and ``test_acc`` on the datamodule's test split.

    Momentum and weight decay belong to the optimizer, after the gradients were aggregated, as in
    the compression papers' runs.

    Args:
        model: the network (any ``nn.Module`` mapping a batch of inputs to class logits).
        lr: learning rate (per process batch; scale it yourself with the number of processes).
        momentum: SGD momentum in [0, 1).
        weight_decay: L2 penalty, >= 0.
        nesterov: Nesterov momentum.
        lr_milestones: epochs at which the learning rate is multiplied by ``lr_gamma`` (none: constant).
        lr_gamma: the factor at each milestone, in (0, 1].
    """

    def __init__(
        self,
        model: nn.Module,
        lr: float = 0.05,
        momentum: float = 0.9,
        weight_decay: float = 0.0,
        nesterov: bool = False,
        lr_milestones: list[int] | None = None,
        lr_gamma: float = 0.1,
    ) -> None:
        super().__init__()
        if not isinstance(model, nn.Module):
            raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        check_number("lr", lr, 0, open_min=True)
        check_number("momentum", momentum, 0, 1, open_max=True)
        check_number("weight_decay", weight_decay, 0)
        if nesterov and momentum == 0:
            raise ValueError("nesterov=True needs momentum > 0, got momentum=0")
        milestones = list(lr_milestones or [])
        if any(isinstance(m, bool) or not isinstance(m, int) or m < 1 for m in milestones) or milestones != sorted(
            set(milestones)
        ):
            raise ValueError(f"lr_milestones must be increasing epochs >= 1, got {lr_milestones!r}")
        check_number("lr_gamma", lr_gamma, 0, 1, open_min=True)
        self.save_hyperparameters(ignore=["model"])
        self.model = model
        # per-sample means over every rank's batches: exact accuracy, whatever the batch sizes
        self.accuracy = nn.ModuleDict({"val": MeanMetric(), "test": MeanMetric()})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        return loss

    def _evaluate(self, batch: tuple[torch.Tensor, torch.Tensor], prefix: str) -> None:
        x, y = batch
        logits = self(x)
        self.log(f"{prefix}_loss", nn.functional.cross_entropy(logits, y), sync_dist=True)
        self.accuracy[prefix].update((logits.argmax(dim=1) == y).float())
        self.log(f"{prefix}_acc", self.accuracy[prefix])

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self._evaluate(batch, "val")

    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self._evaluate(batch, "test")

    def configure_optimizers(self) -> torch.optim.Optimizer | dict:
        hp = self.hparams
        optimizer = torch.optim.SGD(
            self.parameters(), lr=hp.lr, momentum=hp.momentum, weight_decay=hp.weight_decay, nesterov=hp.nesterov
        )
        if not hp.lr_milestones:
            return optimizer
        scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=hp.lr_milestones, gamma=hp.lr_gamma)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "epoch"}}
