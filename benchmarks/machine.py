"""What a result was measured on: the CPU's model name (or the GPU's), its cores, torch, the date and the commit."""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
from pathlib import Path

import torch


def cpu_name() -> str:
    """The CPU's model name as the kernel reports it (``/proc/cpuinfo``), else what ``platform`` knows."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def commit() -> str | None:
    """The repository's commit, with ``+changes`` when the tree differs from it (``None`` outside a checkout)."""
    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root, capture_output=True)
    except OSError:
        return None
    if head.returncode:
        return None
    return head.stdout.strip() + ("+changes" if dirty.stdout.strip() else "")


def describe(device: str = "cpu") -> dict:
    """The machine of a result file: device name, CPU cores usable here, torch, today's date, the code's commit."""
    name = torch.cuda.get_device_name(0) if device == "cuda" and torch.cuda.is_available() else cpu_name()
    return {
        "device": name,
        "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "torch": torch.__version__,
        "measured": datetime.date.today().isoformat(),
        "commit": commit(),
    }
