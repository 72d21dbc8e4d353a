"""Codec kernels built ahead of time: compiled by AOTInductor in a child process, loaded here as shared libraries.

Compiling a kernel with ``torch.compile`` in the training process loads the compiler into it: its modules and graphs
stay resident, 73-82 MiB on the CPU whatever the tensors' size (the docs' speed page). On the CPU the kernels are
therefore exported (``torch.export``, static shapes) and compiled by AOTInductor in a child process, one package per
kernel and argument layout, kept in a private cache directory; the training process only loads the packages (torch's
own C++ loader: no compiler module is imported) and calls them, with less Python between call and kernel than a
compiled function's guards.

A package is keyed by the kernel, its arguments' layout (each tensor's shape, strides and dtype; every other argument,
a constant baked into the kernel), the library's ``core`` sources, torch's version and the CPU's vector ISA. Builds run
one at a time under a file lock, so that ranks sharing a machine build each package once. The cache holds compiled
code, so it is made private to the user and refused where anyone else may write to it.

The directory: ``GRADCOMP_KERNEL_CACHE``, else ``$XDG_CACHE_HOME/lightning_gradcomp/kernels`` (``~/.cache/...``).
"""

from __future__ import annotations

import atexit
import fcntl
import hashlib
import itertools
import json
import os
import stat
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.utils import _pytree

__all__ = ["AheadUnsupported", "BuildFailed", "cache_dir", "describe", "load", "package_key"]

_PACKAGE_ROOT = Path(__file__).resolve().parents[2]  # the directory that holds lightning_gradcomp
_CORE = Path(__file__).resolve().parent
_CONSTANTS = (bool, int, float, str, type(None))


class AheadUnsupported(Exception):
    """Arguments a package cannot stand for (a type that is neither a tensor nor a constant, tensors that share
    memory): the call runs eagerly instead."""


class BuildFailed(RuntimeError):
    """The child process could not build a package (no C++ compiler, an export or compiler error): its message ends
    with the child's last lines."""


def cache_dir() -> Path:
    """Where packages are kept: ``GRADCOMP_KERNEL_CACHE``, else the user's cache directory."""
    configured = os.environ.get("GRADCOMP_KERNEL_CACHE")
    if configured:
        return Path(configured)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "lightning_gradcomp" / "kernels"


def _private_dir() -> Path:
    """:func:`cache_dir`, created private to this user; refused if another user owns it or may write to it (its
    packages are code this process runs)."""
    path = cache_dir()
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = path.stat()
    if info.st_uid != os.getuid() or info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise BuildFailed(
            f"kernel cache {str(path)!r} is not private to this user (owner uid {info.st_uid}, mode "
            f"{stat.filemode(info.st_mode)}): its packages would be code others can change; "
            "set GRADCOMP_KERNEL_CACHE to a directory of your own"
        )
    return path


def describe(args: tuple[Any, ...]) -> tuple[Any, list[Tensor]]:
    """The layout of ``args`` as JSON-able data (tensors as ``["tensor", shape, strides, dtype]``, lists and tuples
    recursively, constants as ``["constant", value]``) and the tensors in order; :class:`AheadUnsupported` for
    anything else or for tensors whose memory overlaps (a package assumes its arguments apart)."""
    tensors: list[Tensor] = []

    def walk(value: Any) -> Any:
        if isinstance(value, Tensor):
            if value.device.type != "cpu" or value.requires_grad:
                raise AheadUnsupported("only CPU tensors without gradients")
            tensors.append(value)
            return ["tensor", list(value.shape), list(value.stride()), str(value.dtype).removeprefix("torch.")]
        if isinstance(value, (list, tuple)):
            return ["list" if isinstance(value, list) else "tuple", [walk(v) for v in value]]
        if isinstance(value, _CONSTANTS):
            return ["constant", value]
        raise AheadUnsupported(f"an argument of type {type(value).__name__}")

    layout = [walk(a) for a in args]
    spans = sorted(_span(t) for t in tensors if t.numel())
    if any(later[0] < earlier[1] for earlier, later in itertools.pairwise(spans)):
        raise AheadUnsupported("tensors that overlap in memory")
    return layout, tensors


def _span(t: Tensor) -> tuple[int, int]:
    """The bytes ``t`` may touch: from its first element's address to past its last one's (a payload's scale and codes
    are views of one wire buffer, apart)."""
    last = sum((size - 1) * step for size, step in zip(t.shape, t.stride(), strict=True))
    return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()


def rebuild(layout: Any, tensors: Iterator[Tensor]) -> Any:
    """The arguments :func:`describe` described, its tensors taken in order from ``tensors``."""
    kind, value = layout[0], layout[1] if len(layout) > 1 else None
    if kind == "tensor":
        return next(tensors)
    if kind == "constant":
        return value
    items = [rebuild(item, tensors) for item in value]
    return items if kind == "list" else tuple(items)


_digest: str | None = None


def _sources_digest() -> str:
    """A digest of the library's ``core`` sources, read once: a changed kernel, or anything it calls, builds anew."""
    global _digest
    if _digest is None:
        sha = hashlib.sha256()
        for path in sorted(_CORE.rglob("*.py")):
            sha.update(str(path.relative_to(_CORE)).encode())
            sha.update(path.read_bytes())
        _digest = sha.hexdigest()
    return _digest


def package_key(kernel: str, layout: Any) -> str:
    """The cache key of ``kernel`` (``module:name``) called with arguments of ``layout``."""
    identity = {
        "kernel": kernel,
        "layout": layout,
        "torch": torch.__version__,
        "isa": torch.backends.cpu.get_cpu_capability(),
        "sources": _sources_digest(),
    }
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:32]


class _Builder:
    """The child process that builds packages (``python -m lightning_gradcomp.core.ahead_builder``), started at the
    first build and kept for the next ones: the compiler's imports are paid once a run."""

    def __init__(self) -> None:
        self._process: subprocess.Popen[str] | None = None
        self._owner = os.getpid()
        self._lock = threading.Lock()

    def build(self, request: dict[str, Any], log: Path) -> None:
        with self._lock:
            for attempt in range(2):  # a child that died (killed, out of memory) is started once more
                process = self._started(log)
                try:
                    assert process.stdin is not None and process.stdout is not None
                    process.stdin.write(json.dumps(request) + "\n")
                    process.stdin.flush()
                    reply = process.stdout.readline()
                except (BrokenPipeError, OSError):
                    reply = ""
                if reply:
                    answer = json.loads(reply)
                    if not answer["ok"]:
                        raise BuildFailed(f"building {request['kernel']}: {answer['error']}")
                    return
                self.close()
                if attempt:
                    tail = log.read_text(errors="replace").splitlines()[-5:] if log.exists() else []
                    raise BuildFailed(f"the kernel builder exited while building {request['kernel']}: {tail}")

    def _started(self, log: Path) -> subprocess.Popen[str]:
        if self._owner != os.getpid():  # a forked process (a data loader's worker): the parent's child is not its own
            self._process, self._owner = None, os.getpid()
        if self._process is None or self._process.poll() is not None:
            env = dict(os.environ)
            env["PYTHONPATH"] = os.pathsep.join([str(_PACKAGE_ROOT), *filter(None, [env.get("PYTHONPATH")])])
            env.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")  # no pool of compile workers for one kernel
            with open(log, "a") as errors:
                self._process = subprocess.Popen(
                    [sys.executable, "-m", "lightning_gradcomp.core.ahead_builder"],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=errors,
                    text=True,
                    env=env,
                )
        return self._process

    def close(self) -> None:
        process, self._process = self._process, None
        if process is not None and self._owner == os.getpid() and process.poll() is None:
            assert process.stdin is not None
            process.stdin.close()
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()


_builder = _Builder()
atexit.register(_builder.close)


class Package:
    """A loaded package: called with the kernel's arguments, returns what the kernel returns (its in-place outputs
    written where the arguments point)."""

    def __init__(self, path: Path, outputs: str) -> None:
        self._runner = torch._C._aoti.AOTIModelPackageLoader(str(path), "model", False, 1, -1)
        self._outputs = _pytree.treespec_loads(outputs)

    def __call__(self, tensors: list[Tensor]) -> Any:
        return _pytree.tree_unflatten(self._runner.run(tensors), self._outputs)


def load(kernel: Callable[..., Any], layout: Any) -> Package:
    """The package of ``kernel`` (a module-level function of this library) for arguments of ``layout``: from the
    cache, else built by the child process first (:class:`BuildFailed` if it cannot be)."""
    name = f"{kernel.__module__}:{kernel.__name__}"
    key = package_key(name, layout)
    directory = _private_dir()
    path, outputs = directory / f"{key}.pt2", directory / f"{key}.json"
    with open(directory / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another rank building the same package: wait, then load it
        for attempt in range(2):  # a package that does not load (truncated, say) is built once more
            if not (path.exists() and outputs.exists()):
                _builder.build({"kernel": name, "layout": layout, "path": str(path)}, directory / "builder.log")
            try:
                return Package(path, outputs.read_text())
            except Exception as error:
                path.unlink(missing_ok=True)
                outputs.unlink(missing_ok=True)
                if attempt:
                    raise BuildFailed(f"loading the package of {name}: {type(error).__name__}: {error}") from error
    raise AssertionError("unreachable")
