"""MNIST from the standard IDX files in a directory the user gives (gzipped or not); no download."""

from __future__ import annotations

import gzip
import zlib
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_gradcomp.core.validation import check_choice, check_int
from lightning_gradcomp.examples.datafiles import CorruptDataError, MissingDataError

#: File stems of each split, as distributed by the dataset's authors (``.gz`` or uncompressed).
MNIST_FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "t10k": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}
MEAN, STD = 0.1307, 0.3081
_IDX_DTYPES = {0x08: torch.uint8}


def read_idx(path: str | Path) -> torch.Tensor:
    """Read an IDX file (``.gz`` or raw) into a uint8 tensor of the dimensions its header gives.

    Raises :class:`CorruptDataError` (a ``ValueError``) naming the file when it is not a complete
    IDX file of unsigned bytes.
    """
    path = Path(path)
    expected = "an IDX file of unsigned bytes (magic 0x0000 08 NDIM, big-endian dimensions, then the data)"
    try:
        raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    except (OSError, EOFError, zlib.error) as err:
        raise CorruptDataError("MNIST", path, f"cannot decompress: {err}", expected) from None
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in _IDX_DTYPES:
        raise CorruptDataError("MNIST", path, f"header {raw[:4].hex() or 'empty'}", expected)
    ndim = raw[3]
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise CorruptDataError("MNIST", path, f"{len(raw)} bytes, shorter than its {header}-byte header", expected)
    dims = [int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim)]
    size = header + int(torch.Size(dims).numel())
    if len(raw) != size:
        raise CorruptDataError("MNIST", path, f"header says {dims} ({size} bytes), file has {len(raw)}", expected)
    return torch.frombuffer(bytearray(raw[header:]), dtype=torch.uint8).reshape(dims)


def _candidates(stem: str) -> tuple[str, ...]:
    dotted = stem.replace("-idx", ".idx")  # some mirrors name the files t10k-images.idx3-ubyte
    return (stem, stem + ".gz", dotted, dotted + ".gz")


def mnist_files(data_dir: str | Path, split: str) -> tuple[Path, Path]:
    """Paths of the ``split``'s image and label files in ``data_dir``, or :class:`MissingDataError`."""
    check_choice("split", split, sorted(MNIST_FILES))
    data_dir = Path(data_dir)
    found: list[Path] = []
    missing: list[str] = []
    for stem in MNIST_FILES[split]:
        path = next((data_dir / name for name in _candidates(stem) if (data_dir / name).is_file()), None)
        if path is None:
            missing.append(f"{stem}[.gz]")
        else:
            found.append(path)
    if missing:
        raise MissingDataError("MNIST", data_dir, [f"{stem}[.gz]" for stem in MNIST_FILES[split]], missing)
    return found[0], found[1]


def load_mnist(data_dir: str | Path, split: str) -> TensorDataset:
    """The ``split`` ("train" or "t10k") as normalised float images (N, 1, 28, 28) and int64 labels."""
    images_path, labels_path = mnist_files(data_dir, split)
    images, labels = read_idx(images_path), read_idx(labels_path)
    if images.dim() != 3 or tuple(images.shape[1:]) != (28, 28):
        raise CorruptDataError("MNIST", images_path, f"images of shape {tuple(images.shape)}", "(N, 28, 28) images")
    if labels.dim() != 1 or labels.shape[0] != images.shape[0] or bool((labels > 9).any()):
        raise CorruptDataError(
            "MNIST", labels_path, f"labels of shape {tuple(labels.shape)}", f"{images.shape[0]} labels in 0..9"
        )
    x = (images.float().div_(255.0).sub_(MEAN).div_(STD)).unsqueeze(1)
    return TensorDataset(x, labels.long())


class MNISTDataModule(pl.LightningDataModule):
    """MNIST from IDX files in ``data_dir``; checks at construction that the files it needs are there.

    Args:
        data_dir: directory with the IDX files (``train-*`` and/or ``t10k-*``, ``.gz`` or not).
        batch_size: per-process batch size.
        train_split: split to train on (``"train"``, or ``"t10k"`` when only the test set is at hand).
        holdout: when > 0, validate on the last ``holdout`` images of ``train_split`` and train on the
            rest; when 0, validate on the ``"t10k"`` split.
        num_workers: data loader worker processes (0 loads in the training process).
    """

    def __init__(
        self, data_dir: str, batch_size: int = 64, train_split: str = "train", holdout: int = 0, num_workers: int = 0
    ) -> None:
        super().__init__()
        check_choice("train_split", train_split, sorted(MNIST_FILES))
        self.batch_size = check_int("batch_size", batch_size, 1)
        self.holdout = check_int("holdout", holdout, 0)
        self.num_workers = check_int("num_workers", num_workers, 0)
        self.data_dir, self.train_split = data_dir, train_split
        self._check_files()  # fail now, before processes are launched, if a file is missing
        self.train_set: TensorDataset | None = None
        self.val_set: TensorDataset | None = None

    def _check_files(self) -> None:
        splits = [self.train_split] if self.holdout or self.train_split == "t10k" else [self.train_split, "t10k"]
        expected, missing = [], []
        for split in splits:
            expected += [f"{stem}[.gz]" for stem in MNIST_FILES[split]]
            try:
                mnist_files(self.data_dir, split)
            except MissingDataError as err:
                missing += err.missing
        if missing:
            raise MissingDataError("MNIST", self.data_dir, expected, missing)

    def setup(self, stage: str | None = None) -> None:
        """Read the files (every stage uses the validation split; ``fit`` the training split as well)."""
        data = load_mnist(self.data_dir, self.train_split)
        if self.holdout:
            if self.holdout >= len(data):
                raise ValueError(
                    f"holdout must be smaller than the {len(data)} images of {self.train_split!r}, got {self.holdout}"
                )
            cut = len(data) - self.holdout
            self.train_set = TensorDataset(*(t[:cut] for t in data.tensors))
            self.val_set = TensorDataset(*(t[cut:] for t in data.tensors))
        else:
            self.train_set, self.val_set = data, load_mnist(self.data_dir, "t10k")

    def train_dataloader(self) -> DataLoader:
        assert self.train_set is not None
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True, num_workers=self.num_workers)

    def val_dataloader(self) -> DataLoader:
        assert self.val_set is not None
        return DataLoader(self.val_set, batch_size=500, num_workers=self.num_workers)

    def test_dataloader(self) -> DataLoader:
        """The validation split (``t10k``, or the holdout when ``holdout > 0``)."""
        return self.val_dataloader()
