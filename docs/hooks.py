"""MkDocs hook: the plots the benchmark commands commit under ``benchmarks/results/`` become part of the site as
``results/<name>.png``, so pages show the figures the commands drew (none is copied by hand into ``docs/``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks"


def on_files(files: Files, config: Any) -> Files:
    """Add every committed benchmark plot to the site's files."""
    for plot in sorted((RESULTS / "results").glob("*.png")):
        files.append(File(f"results/{plot.name}", str(RESULTS), config["site_dir"], config["use_directory_urls"]))
    return files
