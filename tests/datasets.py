"""Small dataset files in the real formats (CIFAR-10 python batches, MNIST IDX), written by the tests themselves."""

from __future__ import annotations

import gzip
import pickle
import struct
from pathlib import Path

import numpy as np

from lightning_gradcomp.examples.cifar import CIFAR10_FILES


def cifar_batch_bytes(images: np.ndarray, labels: list[int], name: str = "batch") -> bytes:
    """A CIFAR-10 batch pickle as the authors wrote it: protocol 2, bytes keys, numpy.core in the array's reduce."""
    batch = {
        b"batch_label": name.encode(),
        b"labels": labels,
        b"data": images.reshape(len(labels), 3 * 32 * 32),
        b"filenames": [f"{name}_{i}.png".encode() for i in range(len(labels))],
    }
    # numpy >= 2 names its array reconstructor numpy._core; the distributed files (numpy 1) say numpy.core
    return pickle.dumps(batch, protocol=2).replace(b"numpy._core.multiarray", b"numpy.core.multiarray")


def write_cifar10(directory: Path, per_file: int = 32, seed: int = 0) -> Path:
    """``data_batch_1..5`` and ``test_batch`` of ``per_file`` random images each; returns ``directory``."""
    rng = np.random.default_rng(seed)
    directory.mkdir(parents=True, exist_ok=True)
    for name in CIFAR10_FILES:
        images = rng.integers(0, 256, size=(per_file, 3, 32, 32), dtype=np.uint8)
        labels = [int(v) for v in rng.integers(0, 10, size=per_file)]
        (directory / name).write_bytes(cifar_batch_bytes(images, labels, name))
    return directory


def idx_bytes(array: np.ndarray) -> bytes:
    """An IDX file of unsigned bytes: magic ``00 00 08 ndim``, big-endian dimensions, the data."""
    header = bytes([0, 0, 0x08, array.ndim]) + b"".join(struct.pack(">I", d) for d in array.shape)
    return header + array.astype(np.uint8).tobytes()


def write_mnist(directory: Path, train: int = 64, test: int = 32, seed: int = 0, gzip_train: bool = True) -> Path:
    """MNIST-format IDX files (train gzipped, t10k raw by default) of random images; returns ``directory``."""
    rng = np.random.default_rng(seed)
    directory.mkdir(parents=True, exist_ok=True)
    for split, n, packed in (("train", train, gzip_train), ("t10k", test, False)):
        images = idx_bytes(rng.integers(0, 256, size=(n, 28, 28), dtype=np.uint8))
        labels = idx_bytes(rng.integers(0, 10, size=(n,), dtype=np.uint8))
        for kind, raw in (("images-idx3-ubyte", images), ("labels-idx1-ubyte", labels)):
            name = f"{split}-{kind}"
            if packed:
                (directory / f"{name}.gz").write_bytes(gzip.compress(raw))
            else:
                (directory / name).write_bytes(raw)
    return directory
