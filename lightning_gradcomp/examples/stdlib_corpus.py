"""Real text that ships with every Python: the standard library's own source, as bytes for a byte-level language model.

The corpus is every ``.py`` file below ``sysconfig.get_paths()["stdlib"]``, sorted by path, outside any folder named
``test``, ``tests`` or ``site-packages`` (the test suite, and packages installed into that Python, are not the
library's own code). A fixed share of the files, drawn once with a seeded generator, is held out for validation; the
files are joined with a NUL byte between them (a byte source files do not use). Nothing is downloaded, and every
result can name exactly what it trained on: :attr:`StdlibCorpus.summary` records the Python version, the files and
bytes of each split and the SHA-256 of every byte read, in order.
"""

from __future__ import annotations

import hashlib
import platform
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

from lightning_gradcomp.core.validation import check_int, check_number

__all__ = ["CorpusError", "StdlibCorpus", "StdlibTextDataModule", "corpus_files", "read_stdlib_corpus", "windows"]

#: Folders whose files are not the standard library's own code.
EXCLUDED_FOLDERS = frozenset({"test", "tests", "site-packages"})
#: The byte between two files.
SEPARATOR = b"\x00"


class CorpusError(ValueError):
    """The corpus folder holds no source file, or a file in it cannot be read."""


@dataclass(frozen=True)
class StdlibCorpus:
    """The training and validation bytes (uint8 tensors) and what they are (:attr:`summary`)."""

    train: Tensor
    validation: Tensor
    summary: dict[str, Any] = field(default_factory=dict)


def corpus_files(root: str | Path) -> list[Path]:
    """The ``.py`` files below ``root``, sorted by their path relative to it, outside :data:`EXCLUDED_FOLDERS`."""
    root = Path(root)
    if not root.is_dir():
        raise CorpusError(f"the corpus folder {root} does not exist or is not a folder")
    found = [p for p in root.rglob("*.py") if not EXCLUDED_FOLDERS & set(p.relative_to(root).parts[:-1])]
    files = sorted(found, key=lambda p: p.relative_to(root).as_posix())
    if not files:
        raise CorpusError(
            f"the corpus folder {root} holds no Python source file outside {sorted(EXCLUDED_FOLDERS)}: give the "
            "standard library's folder (sysconfig.get_paths()['stdlib'])"
        )
    return files


def read_stdlib_corpus(root: str | Path | None = None, validation_share: float = 0.05, seed: int = 0) -> StdlibCorpus:
    """The corpus below ``root`` (default: this Python's standard library), ``validation_share`` of its files
    (at least one) held out for validation, drawn with ``seed``.

    Raises :class:`CorpusError` naming the folder when it holds no source file, or the file that cannot be read.
    """
    check_number("validation_share", validation_share, 0, 1, open_min=True, open_max=True)
    check_int("seed", seed, 0)
    root = Path(root) if root is not None else Path(sysconfig.get_paths()["stdlib"])
    files = corpus_files(root)
    if len(files) < 2:
        raise CorpusError(f"the corpus folder {root} holds one source file; training and validation need two")
    held = max(1, round(validation_share * len(files)))
    order = torch.randperm(len(files), generator=torch.Generator().manual_seed(seed)).tolist()
    validation_files = set(order[:held])
    digest = hashlib.sha256()
    parts: dict[bool, list[bytes]] = {True: [], False: []}
    for i, path in enumerate(files):
        try:
            text = path.read_bytes()
        except OSError as err:
            raise CorpusError(f"the corpus file {path} cannot be read: {type(err).__name__}: {err}") from None
        digest.update(text)
        parts[i in validation_files].append(text)
    train, validation = (SEPARATOR.join(parts[held_out]) for held_out in (False, True))
    summary = {
        "source": "the CPython standard library's .py files",
        "python": platform.python_version(),
        "implementation": platform.python_implementation(),
        "root": str(root),
        "excluded_folders": sorted(EXCLUDED_FOLDERS),
        "files": len(files),
        "train_files": len(files) - held,
        "validation_files": held,
        "bytes": sum(map(len, parts[False])) + sum(map(len, parts[True])),
        "train_bytes": len(train),
        "validation_bytes": len(validation),
        "sha256": digest.hexdigest(),
        "validation_share": validation_share,
        "seed": seed,
    }
    return StdlibCorpus(_bytes_tensor(train), _bytes_tensor(validation), summary)


def _bytes_tensor(data: bytes) -> Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.zeros(0, dtype=torch.uint8)


def windows(tokens: Tensor, context: int) -> Tensor:
    """``tokens`` cut into consecutive, non-overlapping windows of ``context + 1`` bytes (``[n, context + 1]``, uint8):
    a model reads the first ``context`` and predicts the last ``context``."""
    check_int("context", context, 1)
    count = (tokens.numel() - 1) // (context + 1)
    return tokens[: count * (context + 1)].view(count, context + 1)


class _Windows(Dataset):
    def __init__(self, data: Tensor) -> None:
        self.data = data

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        window = self.data[index].long()
        return window[:-1], window[1:]


class StdlibTextDataModule(pl.LightningDataModule):
    """The corpus as windows of ``context`` bytes and the next byte of each: training windows shuffled (Lightning gives
    each rank its share), the first ``validation_windows`` validation windows for the validation loss.

    Args:
        context: bytes a model reads (its positions).
        batch_size: windows per rank per step.
        validation_windows: validation windows scored at each validation (``None``: all of them).
        root, validation_share, seed: :func:`read_stdlib_corpus`'s.
    """

    def __init__(
        self,
        context: int = 128,
        batch_size: int = 16,
        validation_windows: int | None = 512,
        root: str | None = None,
        validation_share: float = 0.05,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.context = check_int("context", context, 1)
        self.batch_size = check_int("batch_size", batch_size, 1)
        if validation_windows is not None:
            check_int("validation_windows", validation_windows, 1)
        self.validation_windows = validation_windows
        self.root, self.validation_share, self.seed = root, validation_share, seed
        self.corpus: StdlibCorpus | None = None

    def setup(self, stage: str) -> None:
        if self.corpus is None:
            self.corpus = read_stdlib_corpus(self.root, self.validation_share, self.seed)

    def train_dataloader(self) -> DataLoader:
        assert self.corpus is not None
        return DataLoader(_Windows(windows(self.corpus.train, self.context)), batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        assert self.corpus is not None
        held = windows(self.corpus.validation, self.context)[: self.validation_windows]
        return DataLoader(_Windows(held), batch_size=self.batch_size)
