"""MNIST from the standard IDX files in a directory the user gives (gzipped or not); no download."""

from __future__ import annotations

import gzip
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

#: File stems of each split, as distributed by the dataset's authors.
MNIST_FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "t10k": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}
MEAN, STD = 0.1307, 0.3081
_IDX_DTYPES = {0x08: torch.uint8}


def read_idx(path: str | Path) -> torch.Tensor:
    """Read an IDX file (``.gz`` or raw) into a uint8 tensor of the dimensions its header gives."""
    path = Path(path)
    raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in _IDX_DTYPES:
        raise ValueError(f"{path} is not an IDX file of unsigned bytes (header {raw[:4].hex()})")
    ndim = raw[3]
    header = 4 + 4 * ndim
    dims = [int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim)]
    expected = header + int(torch.Size(dims).numel())
    if len(raw) != expected:
        raise ValueError(f"{path} is corrupt: header says {dims} ({expected} bytes), file has {len(raw)}")
    return torch.frombuffer(bytearray(raw[header:]), dtype=torch.uint8).reshape(dims)


def _find(data_dir: Path, stem: str) -> Path:
    for name in (stem, stem + ".gz"):
        if (data_dir / name).is_file():
            return data_dir / name
    raise FileNotFoundError(f"MNIST file {stem} (or {stem}.gz) not found in {data_dir}")


def load_mnist(data_dir: str | Path, split: str) -> TensorDataset:
    """The ``split`` ("train" or "t10k") as normalised float images (N, 1, 28, 28) and int64 labels."""
    if split not in MNIST_FILES:
        raise ValueError(f"split must be one of {sorted(MNIST_FILES)}, got {split!r}")
    data_dir = Path(data_dir)
    if not data_dir.is_dir():
        raise FileNotFoundError(
            f"MNIST directory {data_dir} does not exist; expected the IDX files {list(MNIST_FILES[split])} in it"
        )
    images_stem, labels_stem = MNIST_FILES[split]
    images, labels = read_idx(_find(data_dir, images_stem)), read_idx(_find(data_dir, labels_stem))
    if images.dim() != 3 or labels.dim() != 1 or images.shape[0] != labels.shape[0]:
        raise ValueError(
            f"MNIST {split} files in {data_dir} disagree: images {tuple(images.shape)}, labels {tuple(labels.shape)}"
        )
    x = (images.float().div_(255.0).sub_(MEAN).div_(STD)).unsqueeze(1)
    return TensorDataset(x, labels.long())


class MNISTDataModule(pl.LightningDataModule):
    """MNIST from IDX files in ``data_dir``.

    Args:
        data_dir: directory with the IDX files (``train-*`` and/or ``t10k-*``, ``.gz`` or not).
        batch_size: per-process batch size.
        train_split: split to train on (``"train"``, or ``"t10k"`` when only the test set is at hand).
        holdout: when > 0, validate on the last ``holdout`` images of ``train_split`` and train on the
            rest; when 0, validate on the ``"t10k"`` split.
    """

    def __init__(self, data_dir: str, batch_size: int = 64, train_split: str = "train", holdout: int = 0) -> None:
        super().__init__()
        if train_split not in MNIST_FILES:
            raise ValueError(f"train_split must be one of {sorted(MNIST_FILES)}, got {train_split!r}")
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be an integer >= 1, got {batch_size!r}")
        if isinstance(holdout, bool) or not isinstance(holdout, int) or holdout < 0:
            raise ValueError(f"holdout must be an integer >= 0, got {holdout!r}")
        self.data_dir, self.batch_size, self.train_split, self.holdout = data_dir, batch_size, train_split, holdout
        self.train_set: TensorDataset | None = None
        self.val_set: TensorDataset | None = None

    def setup(self, stage: str | None = None) -> None:
        data = load_mnist(self.data_dir, self.train_split)
        if self.holdout:
            if self.holdout >= len(data):
                raise ValueError(f"holdout must be smaller than the {len(data)} images of {self.train_split!r}")
            cut = len(data) - self.holdout
            self.train_set = TensorDataset(*(t[:cut] for t in data.tensors))
            self.val_set = TensorDataset(*(t[cut:] for t in data.tensors))
        else:
            self.train_set, self.val_set = data, load_mnist(self.data_dir, "t10k")

    def train_dataloader(self) -> DataLoader:
        assert self.train_set is not None
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        assert self.val_set is not None
        return DataLoader(self.val_set, batch_size=500)
