"""The models the benchmarks train, by name, with the shape of one input image."""

from __future__ import annotations

#: ``name -> (description, input shape)``.
MODELS: dict[str, tuple[str, tuple[int, ...]]] = {
    "mlp": ("MLP on 3x32x32 inputs, 3072-W-W-10 (1.84M parameters at width 512)", (3, 32, 32)),
    "lenet": ("LeNet-5 on 1x28x28 MNIST images (61,706 parameters)", (1, 28, 28)),
    "mnist-mlp": ("MLP on 1x28x28 MNIST images, 784-1024-1024-10 (1.86M parameters)", (1, 28, 28)),
}


def build_model(name: str, width: int = 512):
    """A fresh model ``name`` (``width`` sizes the ``mlp``), initialised from torch's current seed."""
    from torch import nn

    def mlp(inputs: int, width: int) -> nn.Module:
        return nn.Sequential(
            nn.Flatten(), nn.Linear(inputs, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10)
        )

    if name == "mlp":
        return mlp(3072, width)
    if name == "lenet":
        from lightning_gradcomp.examples.models import LeNet5

        return LeNet5()
    if name == "mnist-mlp":
        return mlp(784, 1024)
    raise KeyError(f"unknown model {name!r}; choose from {list(MODELS)}")
