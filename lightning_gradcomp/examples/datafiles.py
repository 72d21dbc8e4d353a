"""Errors of the example datamodules, which read standard dataset files from a directory the user gives.

Nothing is downloaded at run time, so a wrong path is the most common failure: these errors name
the directory and the files that were expected there, and the ``gradcomp`` command prints them
without a traceback.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path


class MissingDataError(FileNotFoundError):
    """A data directory, or a file expected in it, does not exist."""

    def __init__(self, dataset: str, data_dir: str | Path, expected: Sequence[str], missing: Sequence[str]) -> None:
        self.dataset, self.data_dir = dataset, Path(data_dir)
        self.expected, self.missing = tuple(expected), tuple(missing)
        shown = str(self.data_dir) if self.data_dir.is_absolute() else f"{self.data_dir} (= {self.data_dir.resolve()})"
        if not self.data_dir.is_dir():
            where = f"directory {shown} does not exist"
        elif set(self.missing) >= set(self.expected):
            where = f"none of the expected files is in {shown}"
        else:
            where = f"{', '.join(self.missing)} not found in {shown}"
        super().__init__(
            f"{dataset} data: {where}; expected the files {', '.join(self.expected)} there "
            "(nothing is downloaded: fetch the dataset yourself and point data_dir at it)"
        )


class CorruptDataError(ValueError):
    """A data file exists but does not hold what its format promises (truncated, wrong file, wrong shape)."""

    def __init__(self, dataset: str, path: str | Path, problem: str, expected: str) -> None:
        self.dataset, self.path = dataset, Path(path)
        super().__init__(
            f"{dataset} data: {self.path} is corrupt or not a {dataset} file ({problem}); expected {expected}"
        )
