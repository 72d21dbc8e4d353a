"""Codec kernels built ahead of time: compiled by AOTInductor in a child process, loaded here as shared libraries.

Compiling a kernel with ``torch.compile`` in the training process loads inductor's code generator, lowering and
scheduler into it, and they stay resident: 73-82 MiB on the CPU whatever the tensors' size (the docs' speed page). On
the CPU the kernels are therefore exported (``torch.export``, static shapes) and compiled by AOTInductor in a child
process, one package per kernel and argument layout, kept in a private cache directory; the training process only
loads the packages (torch's own C++ loader) and calls them, with less Python between call and kernel than a compiled
function's guards.

A package is keyed by the kernel, its arguments' layout (each tensor's shape, strides and dtype; every other argument,
a constant baked into the kernel), the library's ``core`` sources, torch's version, the CPU (its model and feature
flags: the code is built for the machine's own instruction set), the thread count the loops are written for and any
``TORCHINDUCTOR_*`` setting. Each package is built once under a file lock of its own, so that ranks sharing a machine
build it once. The cache holds compiled code, so it is made private to the user; it is refused where its directory,
or one above it, may be written by another user (``ValueError``), and a package file that is not this user's alone is
never loaded.

The directory: ``GRADCOMP_KERNEL_CACHE``, else ``$XDG_CACHE_HOME/lightning_gradcomp/kernels`` (``~/.cache/...``).
``GRADCOMP_KERNEL_BUILD_TIMEOUT`` (seconds, default 900) bounds one build.
"""

from __future__ import annotations

import atexit
import fcntl
import functools
import grp
import hashlib
import itertools
import json
import os
import platform
import pwd
import select
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.utils import _pytree

__all__ = ["AheadUnsupported", "BuildFailed", "Package", "cache_dir", "describe", "load", "package_key"]

_CORE = Path(__file__).resolve().parent
_CONSTANTS = (bool, int, float, str, type(None))
#: Kernels of this package alone are built (the child imports them by name).
LIBRARY = "lightning_gradcomp."


class AheadUnsupported(Exception):
    """A call no package can stand for (an argument that is neither a tensor nor a constant, tensors that overlap in
    memory, a kernel the child process cannot import): it runs eagerly instead."""


class BuildFailed(RuntimeError):
    """The child process could not build a package (no C++ compiler, an export or compiler error, a build past its
    time), or a package would not load."""


def cache_dir() -> Path:
    """Where packages are kept: ``GRADCOMP_KERNEL_CACHE``, else the user's cache directory."""
    configured = os.environ.get("GRADCOMP_KERNEL_CACHE")
    if configured:
        return Path(configured)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "lightning_gradcomp" / "kernels"


def _private_group(gid: int) -> bool:
    """Whether group ``gid`` is this user's own (a user private group: named as the user, no other members)."""
    try:
        group = grp.getgrgid(gid)
        return not group.gr_mem and group.gr_name == pwd.getpwuid(os.geteuid()).pw_name
    except KeyError:
        return False


def _writable_by_others(info: os.stat_result) -> bool:
    """Whether another user may change what a directory above the cache holds: owned by someone else (but root), or
    writable by others without the sticky bit (``/tmp`` has it: there only an entry's owner can rename it), or by a
    group other than the user's own."""
    if info.st_uid not in (os.geteuid(), 0):
        return True
    if info.st_mode & stat.S_ISVTX:
        return False
    return bool(info.st_mode & stat.S_IWOTH) or (bool(info.st_mode & stat.S_IWGRP) and not _private_group(info.st_gid))


def _private_dir() -> Path:
    """:func:`cache_dir`, created private to this user (each missing level ``0700``; an existing one of the user's
    made ``0700``); ``ValueError`` if it is another user's, or a directory above it may be written by another user
    (its packages are code this process runs)."""
    path = cache_dir()
    real = path.absolute().resolve()  # through any link, to the directories that hold the packages

    def refuse(level: Path, info: os.stat_result) -> ValueError:
        return ValueError(
            f"GRADCOMP_KERNEL_CACHE: the kernel cache {str(path)!r} is not private to this user ({str(level)!r}: "
            f"owner uid {info.st_uid}, mode {stat.filemode(info.st_mode)}): its packages are code this process runs; "
            "set GRADCOMP_KERNEL_CACHE to a directory only you can write to"
        )

    for level in real.parents:  # checked before anything is made below them
        if level.exists() and _writable_by_others(info := level.stat()):
            raise refuse(level, info)
    for level in reversed([p for p in [real, *real.parents] if not p.exists()]):
        level.mkdir(mode=0o700, exist_ok=True)
    info = real.stat()
    if info.st_uid != os.geteuid():
        raise refuse(real, info)
    if info.st_mode & 0o077:
        real.chmod(0o700)  # the user's own: made private (each package file is checked apart)
    return real


def _own_file(path: Path) -> bool:
    """Whether ``path`` is a regular file of this user's alone: not a link, one name, no one else may write it."""
    try:
        info = path.lstat()
    except FileNotFoundError:
        return False
    alone = info.st_nlink == 1 and info.st_uid == os.geteuid() and not info.st_mode & 0o022
    return stat.S_ISREG(info.st_mode) and alone


def describe(args: tuple[Any, ...]) -> tuple[Any, list[Tensor]]:
    """The layout of ``args`` as nested tuples, hashable and JSON-able (tensors as ``("tensor", shape, strides,
    dtype)``, lists and tuples recursively, constants as ``("constant", value)``) and the tensors in order;
    :class:`AheadUnsupported` for anything else, and for tensors whose memory overlaps, another's or their own (a
    package assumes them apart)."""
    tensors: list[Tensor] = []

    def walk(value: Any) -> Any:
        if isinstance(value, Tensor):
            if value.device.type != "cpu" or value.requires_grad:
                raise AheadUnsupported("only CPU tensors without gradients")
            if torch._debug_has_internal_overlap(value):  # 1: elements that share memory (expanded), 2: cannot tell
                raise AheadUnsupported("a tensor whose elements overlap in memory")
            tensors.append(value)
            return ("tensor", tuple(value.shape), value.stride(), str(value.dtype).removeprefix("torch."))
        if isinstance(value, (list, tuple)):
            return ("list" if isinstance(value, list) else "tuple", tuple(walk(v) for v in value))
        if isinstance(value, _CONSTANTS):
            return ("constant", value)
        raise AheadUnsupported(f"an argument of type {type(value).__name__}")

    layout = tuple(walk(a) for a in args)
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
    """The argument :func:`describe` described by ``layout``, its tensors taken in order from ``tensors``."""
    kind, value = layout[0], layout[1] if len(layout) > 1 else None
    if kind == "tensor":
        return next(tensors)
    if kind == "constant":
        return value
    items = [rebuild(item, tensors) for item in value]
    return items if kind == "list" else tuple(items)


@functools.cache
def sources_digest() -> str:
    """A digest of the library's ``core`` sources, read once a process: a changed kernel, or anything it calls,
    builds anew (the child checks that it imported the same sources)."""
    sha = hashlib.sha256()
    for path in sorted(_CORE.rglob("*.py")):
        sha.update(str(path.relative_to(_CORE)).encode())
        sha.update(path.read_bytes())
    return sha.hexdigest()


@functools.cache
def cpu_identity() -> str:
    """The CPU's model and feature flags (Linux's ``/proc/cpuinfo``; else the platform's name), read once."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    wanted = [line for line in lines if line.split(":")[0].strip() in ("model name", "flags", "Features")]
    return "\n".join(sorted(set(wanted))) or f"{platform.machine()} {platform.processor()}"


def package_key(kernel: str, layout: Any, threads: int) -> str:
    """The cache key of ``kernel`` (``module:name``) called with arguments of ``layout`` by loops for ``threads``."""
    identity = {
        "kernel": kernel,
        "layout": layout,
        "threads": threads,
        "torch": torch.__version__,
        "isa": torch.backends.cpu.get_cpu_capability(),
        "cpu": cpu_identity(),
        "inductor": sorted((k, v) for k, v in os.environ.items() if k.startswith("TORCHINDUCTOR_")),
        "sources": sources_digest(),
    }
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:32]


def _build_timeout() -> float:
    value = os.environ.get("GRADCOMP_KERNEL_BUILD_TIMEOUT", "900")
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise ValueError(f"GRADCOMP_KERNEL_BUILD_TIMEOUT must be a positive number of seconds, got {value!r}")
    return seconds


#: What the child runs: this process's import path (so that it imports the same library and torch, never a directory
#: it happens to start in), then the builder.
_CHILD = "import json, sys; sys.path[:] = json.loads(sys.argv[1]); from {module} import main; main()"


class _Builder:
    """The child process that builds packages (:mod:`~lightning_gradcomp.core.ahead_builder`), started at the first
    build and kept for the next ones: the compiler's imports are paid once a run."""

    def __init__(self) -> None:
        self._process: subprocess.Popen[str] | None = None
        self._directory: Path | None = None  # the cache the child compiles in (its compiler cache, its TMPDIR)
        self._owner = os.getpid()
        self._lock = threading.Lock()
        self._requests = itertools.count()

    def build(self, request: dict[str, Any], directory: Path) -> None:
        """Send ``request`` and wait for its answer; :class:`BuildFailed` for a failed build, a child that exited or
        answered out of turn, or a build past ``GRADCOMP_KERNEL_BUILD_TIMEOUT``. On anything but a clean answer the
        child is stopped, so that no later request reads this one's reply."""
        timeout = _build_timeout()
        with self._lock:
            for attempt in range(2):  # a child that died (killed, out of memory) is started once more
                process = self._started(directory)
                ticket = next(self._requests)
                try:
                    answer = self._exchange(process, {**request, "ticket": ticket}, timeout)
                except BaseException:
                    self.close(kill=True)
                    raise
                if answer is None:
                    self.close(kill=True)
                    if attempt:
                        log = directory / "builder.log"
                        tail = log.read_text(errors="replace").splitlines()[-5:] if log.exists() else []
                        raise BuildFailed(f"the kernel builder exited while building {request['kernel']}: {tail}")
                    continue
                if answer.get("ticket") != ticket or "ok" not in answer:
                    self.close(kill=True)
                    raise BuildFailed(f"the kernel builder answered out of turn: {answer!r}")
                if not answer["ok"]:
                    raise BuildFailed(f"building {request['kernel']}: {answer.get('error')}")
                return

    @staticmethod
    def _exchange(process: subprocess.Popen[str], request: dict[str, Any], timeout: float) -> dict[str, Any] | None:
        """One request and its answer; ``None`` if the child is gone."""
        assert process.stdin is not None and process.stdout is not None
        try:
            process.stdin.write(json.dumps(request) + "\n")
            process.stdin.flush()
        except OSError:
            return None
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise BuildFailed(f"building {request['kernel']} took more than {timeout:g} s")
            ready, _, _ = select.select([process.stdout], [], [], left)
            if ready:
                break
        line = process.stdout.readline()
        if not line:
            return None
        try:
            return json.loads(line)
        except json.JSONDecodeError:
            raise BuildFailed(f"the kernel builder answered {line[:200]!r}") from None

    def _started(self, directory: Path) -> subprocess.Popen[str]:
        if self._owner != os.getpid():  # a forked process (a data loader's worker): the parent's child is not its own
            self._forget()
        if self._process is not None and self._directory != directory:  # another cache: a child that compiles in it
            self.close()
        if self._process is None or self._process.poll() is not None:
            self._directory = directory
            env = dict(os.environ)
            # the child's own compiler cache and temporary directory, inside the checked directory: no one else can
            # change what it builds from (inductor keeps its precompiled headers, code that goes into every package,
            # in the temporary directory's ``torchinductor_<user>``, whatever its cache directory is)
            env["TORCHINDUCTOR_CACHE_DIR"] = str(directory / "inductor")
            temporary = directory / "tmp"
            temporary.mkdir(mode=0o700, exist_ok=True)
            env["TMPDIR"] = str(temporary)
            env.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")  # no pool of compile workers for one kernel
            fd = os.open(directory / "builder.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "a") as errors:
                self._process = subprocess.Popen(
                    [
                        sys.executable,
                        "-c",
                        _CHILD.format(module=f"{LIBRARY}core.ahead_builder"),
                        json.dumps([p or os.getcwd() for p in sys.path]),
                    ],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=errors,
                    text=True,
                    env=env,
                )
        return self._process

    def _forget(self) -> None:
        """After a fork: the child, the lock and the pipes are the parent's (their copies here close with them)."""
        self._process, self._owner, self._lock = None, os.getpid(), threading.Lock()

    def close(self, kill: bool = False) -> None:
        """Stop the child: told to quit (it exits once a build in progress ends; a forked process holding a copy of
        its input cannot keep it waiting), or killed; its pipes closed."""
        process, self._process = self._process, None
        if process is None or self._owner != os.getpid():
            return
        if process.poll() is None:
            if not kill:
                try:
                    assert process.stdin is not None
                    process.stdin.write(json.dumps({"quit": True}) + "\n")
                    process.stdin.flush()
                except OSError:
                    kill = True
            if kill:
                process.kill()
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        for stream in (process.stdin, process.stdout):
            try:
                if stream is not None:
                    stream.close()
            except OSError:
                pass


_builder = _Builder()
atexit.register(_builder.close)
os.register_at_fork(after_in_child=lambda: _builder._forget())


class Package:
    """A loaded package: called with the kernel's tensors, returns what the kernel returns (its in-place outputs
    written where the arguments point); its output structure is the package's own."""

    def __init__(self, path: Path) -> None:
        self._runner = torch._C._aoti.AOTIModelPackageLoader(str(path), "model", False, 1, -1)
        self._outputs = _pytree.treespec_loads(self._runner.get_call_spec()[1])

    def __call__(self, tensors: list[Tensor]) -> Any:
        """The kernel's result for ``tensors`` (in :func:`describe`'s order)."""
        return _pytree.tree_unflatten(self._runner.run(tensors), self._outputs)


def load(kernel: Callable[..., Any], layout: Any) -> Package:
    """The package of ``kernel`` (a module-level function of this library) for arguments of ``layout``, with loops for
    this process's thread count: from the cache, else built by the child process first (:class:`BuildFailed` if it
    cannot be)."""
    name = f"{kernel.__module__}:{kernel.__name__}"
    threads = torch.get_num_threads()
    key = package_key(name, layout, threads)
    directory = _private_dir()
    path = directory / f"{key}.pt2"
    lock = os.open(directory / f"{key}.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another rank building the same package: wait, then load it
        for attempt in range(2):  # a package that does not load (truncated, say) is built once more
            if not _own_file(path):
                path.unlink(missing_ok=True)
                request = {"kernel": name, "layout": layout, "path": str(path), "threads": threads}
                _builder.build({**request, "sources": sources_digest(), "torch": torch.__version__}, directory)
            if not _own_file(path):
                raise BuildFailed(f"the package of {name} at {str(path)!r} is not this user's file alone")
            try:
                return Package(path)
            except Exception as error:
                path.unlink(missing_ok=True)
                if attempt:
                    raise BuildFailed(f"loading the package of {name}: {type(error).__name__}: {error}") from error
    finally:
        os.close(lock)
    raise AssertionError("unreachable")
