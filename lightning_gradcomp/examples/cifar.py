"""CIFAR-10 from the python pickle batches in a directory the user gives; no download.

The dataset's authors distribute ``cifar-10-python.tar.gz``; unpacked, it holds
``cifar-10-batches-py/`` with ``data_batch_1`` .. ``data_batch_5`` (50,000 training images) and
``test_batch`` (10,000), each a pickled dict with ``b"data"`` (a ``(N, 3072)`` uint8 array, the
red, green and blue 32x32 planes of each image in turn) and ``b"labels"`` (N ints in 0..9).

Training batches get the usual augmentation (He et al., 2016): a random 32x32 crop of the image
zero-padded by 4 pixels on each side and a horizontal flip with probability 1/2, both applied to
whole batches at once in the loader's collate function; then every image is normalised with the
per-channel mean and standard deviation of the training set.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from torch import Tensor
from torch.utils.data import DataLoader, TensorDataset

from lightning_gradcomp.core.validation import check_bool, check_int
from lightning_gradcomp.examples.datafiles import CorruptDataError, MissingDataError

CIFAR10_TRAIN_FILES = tuple(f"data_batch_{i}" for i in range(1, 6))
CIFAR10_TEST_FILE = "test_batch"
CIFAR10_FILES = (*CIFAR10_TRAIN_FILES, CIFAR10_TEST_FILE)
#: Per-channel mean and standard deviation of the 50,000 training images, in [0, 1] units.
CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2470, 0.2435, 0.2616)
_FORMAT = "a pickled dict with b'data' (N x 3072 uint8) and b'labels' (N ints in 0..9), as in cifar-10-python.tar.gz"
# What a CIFAR batch pickle may reference: numpy's array reconstruction, nothing else (a pickle can
# otherwise run arbitrary code). The original files name numpy.core; numpy >= 2 writes numpy._core;
# Python 3 writes bytes at pickle protocol 2 through _codecs.encode.
_ALLOWED_GLOBALS = {
    ("numpy.core.multiarray", "_reconstruct"),
    ("numpy._core.multiarray", "_reconstruct"),
    ("numpy", "ndarray"),
    ("numpy", "dtype"),
    ("_codecs", "encode"),
}


class _ArrayUnpickler(pickle.Unpickler):
    """Unpickles numpy arrays, lists, dicts and scalars only."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in _ALLOWED_GLOBALS:
            raise pickle.UnpicklingError(f"refusing to load {module}.{name} from a dataset file")
        if module == "numpy.core.multiarray":  # the original files' name for numpy._core.multiarray
            module = "numpy._core.multiarray" if hasattr(np, "_core") else module
        return super().find_class(module, name)


def read_cifar_batch(path: str | Path) -> tuple[Tensor, Tensor]:
    """One CIFAR-10 batch file as uint8 images ``(N, 3, 32, 32)`` and int64 labels ``(N,)``.

    Raises :class:`CorruptDataError` (a ``ValueError``) naming the file when it is not a CIFAR-10
    python batch. Only numpy arrays are unpickled: a file that asks for anything else is refused.
    """
    path = Path(path)
    try:
        batch = _ArrayUnpickler(io.BytesIO(path.read_bytes()), encoding="bytes").load()
    except Exception as err:  # unpickling reports truncation and garbage with many exception types
        raise CorruptDataError("CIFAR-10", path, f"cannot unpickle: {type(err).__name__}: {err}", _FORMAT) from None
    if not isinstance(batch, dict):
        raise CorruptDataError("CIFAR-10", path, f"holds a {type(batch).__name__}", _FORMAT)
    data = batch.get(b"data", batch.get("data"))
    labels = batch.get(b"labels", batch.get("labels"))
    if not isinstance(data, np.ndarray) or labels is None:
        raise CorruptDataError("CIFAR-10", path, f"keys {sorted(map(str, batch))}", _FORMAT)
    if data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3 * 32 * 32:
        raise CorruptDataError("CIFAR-10", path, f"data of {data.dtype} and shape {data.shape}", _FORMAT)
    labels_tensor = torch.as_tensor(np.asarray(labels, dtype=np.int64))
    if labels_tensor.shape != (data.shape[0],) or bool(((labels_tensor < 0) | (labels_tensor > 9)).any()):
        raise CorruptDataError("CIFAR-10", path, f"{labels_tensor.numel()} labels for {data.shape[0]} images", _FORMAT)
    images = torch.from_numpy(np.ascontiguousarray(data)).reshape(-1, 3, 32, 32)
    return images, labels_tensor


def cifar10_dir(data_dir: str | Path) -> Path:
    """The directory holding the batch files: ``data_dir`` itself or its ``cifar-10-batches-py``.

    Raises :class:`MissingDataError` naming the directory and the missing files.
    """
    data_dir = Path(data_dir)
    for candidate in (data_dir, data_dir / "cifar-10-batches-py"):
        if all((candidate / name).is_file() for name in CIFAR10_FILES):
            return candidate
    missing = [name for name in CIFAR10_FILES if not (data_dir / name).is_file()]
    raise MissingDataError("CIFAR-10", data_dir, CIFAR10_FILES, missing)


def load_cifar10(data_dir: str | Path, split: str) -> tuple[Tensor, Tensor]:
    """The ``split`` (``"train"``: the five data batches, or ``"test"``) as uint8 images and int64 labels."""
    if split not in ("train", "test"):
        raise ValueError(f"split must be one of ['test', 'train'], got {split!r}")
    root = cifar10_dir(data_dir)
    names = CIFAR10_TRAIN_FILES if split == "train" else (CIFAR10_TEST_FILE,)
    parts = [read_cifar_batch(root / name) for name in names]
    return torch.cat([images for images, _ in parts]), torch.cat([labels for _, labels in parts])


def random_crop_flip(images: Tensor, padding: int = 4, generator: torch.Generator | None = None) -> Tensor:
    """Random crops of the zero-padded ``images`` ``(B, C, H, W)`` at their size, each flipped with probability 1/2.

    A loop of slices: about 2 ms for 128 CIFAR images on one CPU thread, 30x faster than one
    gather with advanced indexing.
    """
    b, _, h, w = images.shape
    padded = torch.nn.functional.pad(images, (padding, padding, padding, padding))
    offsets = torch.randint(0, 2 * padding + 1, (b, 2), generator=generator).tolist()
    flips = (torch.rand(b, generator=generator) < 0.5).tolist()
    out = torch.empty_like(images)
    for i, ((dy, dx), flip) in enumerate(zip(offsets, flips, strict=True)):
        crop = padded[i, :, dy : dy + h, dx : dx + w]
        out[i] = crop.flip(-1) if flip else crop
    return out


class CIFARBatch:
    """Collate function: stacks uint8 images, augments them when ``augment``, normalises to float32."""

    def __init__(self, augment: bool, mean: tuple[float, ...] = CIFAR10_MEAN, std: tuple[float, ...] = CIFAR10_STD):
        self.augment = augment
        self.mean = torch.tensor(mean).view(1, -1, 1, 1)
        self.std = torch.tensor(std).view(1, -1, 1, 1)

    def __call__(self, samples: list[tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor]:
        images = torch.stack([image for image, _ in samples])
        labels = torch.stack([label for _, label in samples])
        if self.augment:
            images = random_crop_flip(images)
        return (images.float().div_(255.0) - self.mean) / self.std, labels


class CIFAR10DataModule(pl.LightningDataModule):
    """CIFAR-10 from the python batches in ``data_dir``: train on the five data batches, validate on ``test_batch``.

    The files are checked at construction (before any process is launched) and read in ``setup``.

    Args:
        data_dir: directory with ``data_batch_1`` .. ``data_batch_5`` and ``test_batch`` (or the
            directory that holds the unpacked ``cifar-10-batches-py``).
        batch_size: per-process training batch size.
        augment: random crop (padding 4) and horizontal flip of training images.
        num_workers: data loader worker processes (0 loads in the training process).
        val_batch_size: per-process validation batch size.
    """

    def __init__(
        self,
        data_dir: str,
        batch_size: int = 128,
        augment: bool = True,
        num_workers: int = 0,
        val_batch_size: int = 500,
    ) -> None:
        super().__init__()
        check_bool("augment", augment)
        self.batch_size = check_int("batch_size", batch_size, 1)
        self.val_batch_size = check_int("val_batch_size", val_batch_size, 1)
        self.num_workers = check_int("num_workers", num_workers, 0)
        self.data_dir, self.augment = data_dir, augment
        cifar10_dir(data_dir)  # fail now, before processes are launched, if a file is missing
        self.train_set: TensorDataset | None = None
        self.val_set: TensorDataset | None = None

    def setup(self, stage: str | None = None) -> None:
        """Read ``test_batch`` for every stage, and the five training batches for ``fit``."""
        if stage in (None, "fit"):
            self.train_set = TensorDataset(*load_cifar10(self.data_dir, "train"))
        self.val_set = TensorDataset(*load_cifar10(self.data_dir, "test"))

    def train_dataloader(self) -> DataLoader:
        assert self.train_set is not None
        return DataLoader(
            self.train_set,
            batch_size=self.batch_size,
            shuffle=True,
            drop_last=True,
            num_workers=self.num_workers,
            collate_fn=CIFARBatch(augment=self.augment),
        )

    def val_dataloader(self) -> DataLoader:
        assert self.val_set is not None
        return DataLoader(
            self.val_set, batch_size=self.val_batch_size, num_workers=self.num_workers, collate_fn=CIFARBatch(False)
        )

    def test_dataloader(self) -> DataLoader:
        """``test_batch``, as for validation (CIFAR-10 has no separate validation split)."""
        return self.val_dataloader()
