"""Codec kernels fused by torch's compiler, or run eagerly: one setting chooses, eager is the fallback and the oracle.

A codec's per-element math (a sign packed 32 to a word, a stochastic level drawn from a counter hash and packed) is a
pure function over flat tensors. Run eagerly, each of its operations is a pass over memory with a temporary of the
input's size; ``torch.compile`` (inductor: C++/OpenMP loops on the CPU, Triton kernels on CUDA) fuses the chain into
one or two passes with no temporaries. :func:`fused` wraps such a function: called, it runs compiled or eager as
:func:`codec_mode` says, with static shapes (one specialisation per tensor size; DDP has few). On the CPU the compiled
form is built ahead of time in a child process and loaded (:mod:`~lightning_gradcomp.core.ahead`), so that the
compiler's modules never load into the training process; on CUDA it is ``torch.compile``'s.

Where the compiler cannot run (no C++ compiler, no Triton), the first call warns once and the kernels run eagerly
from then on; the result is the same function's. A kernel that meets more tensor sizes than :data:`RECOMPILE_LIMIT`
runs the further ones eagerly, with one warning. The eager function is the oracle the tests hold the compiled one
to: integer outputs (codes, packed bytes, selections) equal, floats within the rounding of a reordered sum.

The setting: :func:`set_codec_mode` or the environment variable ``GRADCOMP_CODECS``, one of

- ``"auto"`` (the default): compiled, on the CPU ahead of time (``"ahead"``), on CUDA by ``torch.compile``; where the
  compiler cannot run, eager after one warning;
- ``"ahead"``: as ``"auto"``, and a failure to build or load a CPU package is raised (on CUDA, ``"auto"``);
- ``"compiled"``: ``torch.compile`` in this process on every device, and a compiler's failure is raised (to find out
  why it fails);
- ``"eager"``: never compiled (no compile time: the first compiled call of each size takes seconds, cached on disk
  for later runs).
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Callable
from typing import Any, Literal, TypeVar

import torch
from torch import Tensor

from lightning_gradcomp.core.validation import check_choice

__all__ = ["AHEAD_DEVICES", "CODEC_MODES", "FusedKernel", "codec_mode", "compiles_on", "fused", "set_codec_mode"]

CodecMode = Literal["auto", "ahead", "compiled", "eager"]
CODEC_MODES: tuple[str, ...] = ("auto", "ahead", "compiled", "eager")
#: Specialisations a kernel may hold (one per tensor size it meets): torch's limit per function, 8 by default, is
#: raised to this at the first compiled call, as a model's units come in more sizes than 8.
RECOMPILE_LIMIT = 64
#: Devices whose kernels ``"auto"`` and ``"ahead"`` build ahead of time in a child process (the CPU: the compiler's
#: resident memory stays out of the training process; on CUDA the compiled kernels are ``torch.compile``'s).
AHEAD_DEVICES: tuple[str, ...] = ("cpu",)

_mode: str | None = None
#: Why compiling failed, by device type (``None`` until it did): from then on that device runs eagerly.
_broken: dict[str, str] = {}

F = TypeVar("F", bound=Callable[..., Any])


def set_codec_mode(mode: CodecMode) -> None:
    """Choose how codec kernels run from now on: ``"auto"``, ``"ahead"``, ``"compiled"`` or ``"eager"`` (see the
    module)."""
    global _mode
    _mode = check_choice("mode", mode, CODEC_MODES)


def codec_mode() -> str:
    """The mode in force: :func:`set_codec_mode`'s, else ``GRADCOMP_CODECS``, else ``"auto"``."""
    if _mode is not None:
        return _mode
    return check_choice("GRADCOMP_CODECS", os.environ.get("GRADCOMP_CODECS", "auto"), CODEC_MODES)


def compiles_on(device: torch.device) -> bool:
    """Whether kernels on ``device`` run compiled: as the mode says, unless compiling failed there before, and only on
    a little-endian machine (the kernels read the planar codes as words in the machine's order, the eager codecs as
    little-endian bytes: :mod:`~lightning_gradcomp.core.compressors.planar`)."""
    return codec_mode() != "eager" and device.type not in _broken and sys.byteorder == "little"


class FusedKernel:
    """A pure tensor function and its compiled form; calls go to one or the other (:func:`compiles_on` of the first
    tensor argument's device). ``compiled_calls`` counts the calls that ran compiled in this process, ``ahead_calls``
    those that ran a package built ahead of time (tests read them)."""

    def __init__(self, function: Callable[..., Any]) -> None:
        self.function = function
        self.__name__ = function.__name__
        self.__doc__ = function.__doc__
        self._compiled: Callable[..., Any] | None = None
        self._warned_limit = False
        self._packages: dict[tuple[Any, int], Any] = {}  # ahead.Package by argument layout and thread count
        self._importable: bool | None = None
        self.compiled_calls = 0
        self.ahead_calls = 0

    def eager(self, *args: Any) -> Any:
        """The function itself, uncompiled (the oracle)."""
        return self.function(*args)

    def compiled(self, *args: Any) -> Any:
        """The compiled function, whatever the mode (raises what the compiler raises)."""
        if self._compiled is None:
            # a limit per process (raised, never lowered; patching it around each call costs more than a kernel)
            config = torch._dynamo.config
            limit = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"  # torch < 2.6
            setattr(config, limit, max(getattr(config, limit), RECOMPILE_LIMIT))
            self._compiled = torch.compile(self.function, dynamic=False, fullgraph=True, options=inductor_options())
        result = self._compiled(*args)
        self.compiled_calls += 1
        return result

    def ahead(self, *args: Any) -> Any:
        """The call run by this argument layout's package (:mod:`~lightning_gradcomp.core.ahead`) for this process's
        thread count, built first if it is not in the cache. A call no package can stand for runs eagerly: arguments
        that are neither tensors nor constants or that overlap, a kernel the child cannot import (one outside this
        library, or not a module's attribute). Raises what building or loading raises."""
        from lightning_gradcomp.core import ahead

        if self._importable is None:  # decided once: a module-level kernel of this library
            module = sys.modules.get(self.function.__module__)
            self._importable = self.function.__module__.startswith(ahead.LIBRARY) and (
                getattr(module, self.__name__, None) is self
            )
        if not self._importable:
            return self.function(*args)
        try:
            layout, tensors = ahead.describe(args)
        except ahead.AheadUnsupported:
            return self.function(*args)
        key = (layout, torch.get_num_threads())
        package = self._packages.get(key)
        if package is None:
            if len(self._packages) >= RECOMPILE_LIMIT:
                return self._beyond_limit(*args)
            package = self._packages[key] = ahead.load(self.function, layout)
        result = package(tensors)
        self.ahead_calls += 1
        return result

    def _beyond_limit(self, *args: Any) -> Any:
        """A call of a size past the kernel's :data:`RECOMPILE_LIMIT` specialisations (a model of many parameter sizes):
        eager, the same result, with one warning per kernel; the sizes compiled so far stay compiled."""
        if not self._warned_limit:
            self._warned_limit = True
            warnings.warn(
                f"lightning_gradcomp: codec kernel {self.__name__} met more than {RECOMPILE_LIMIT} tensor sizes; "
                "further sizes run eagerly (same results, more passes over memory)",
                RuntimeWarning,
                stacklevel=3,
            )
        return self.function(*args)

    def __call__(self, *args: Any) -> Any:
        device = next(a.device for a in args if isinstance(a, Tensor))
        if not compiles_on(device):
            return self.function(*args)
        mode = codec_mode()
        built_ahead = device.type in AHEAD_DEVICES and mode != "compiled"
        # the modes that want to know: "compiled" raises torch.compile's failures, "ahead" a package's
        strict = mode == "compiled" or (mode == "ahead" and built_ahead)
        try:
            return self.ahead(*args) if built_ahead else self.compiled(*args)
        except Exception as error:  # a compiler's failure falls back; anything else is raised
            if not built_ahead and mode != "compiled" and _is_recompile_limit(error):
                return self._beyond_limit(*args)
            if strict or not _is_compiler_failure(error):
                raise
            _broken[device.type] = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
            warnings.warn(
                f"lightning_gradcomp: {'AOTInductor' if built_ahead else 'torch.compile'} cannot build codec kernels "
                f"on {device.type} "
                f"({_broken[device.type]}); they run eagerly (same results, more passes over memory). "
                "Set GRADCOMP_CODECS=eager to skip the attempt.",
                RuntimeWarning,
                stacklevel=2,
            )
            return self.function(*args)


#: Operations a fused expression may hold before inductor writes it out as a buffer of its own (its defaults: 50 on the
#: CPU, 30 on GPUs). A codec's draw is one long expression per element (a hash, the decision, the packing): under
#: the default, QSGD's 4-bit draw with a multiplier per block wrote its decisions as three bool planes of the layer's
#: size and read them back in a second loop: 721.6 ms a 4096 x 4096 layer on one AMD EPYC thread, 39.5 fused
#: (``benchmarks/field_layout.py`` run before and after the change; the docs' speed page, twelfth round).
INLINED_OPERATIONS = 1000


def inductor_options() -> dict[str, int]:
    """The inductor settings the codec kernels compile with: :data:`INLINED_OPERATIONS` where this torch has them."""
    from torch._inductor import config

    names = ("realize_cpu_opcount_threshold", "realize_opcount_threshold")
    return {name: INLINED_OPERATIONS for name in names if hasattr(config, name)}


def _is_recompile_limit(error: BaseException) -> bool:
    """Whether ``error`` is dynamo's refusal to compile one more specialisation (``fullgraph`` raises it; named
    ``FailOnCacheLimitHit`` before torch 2.6)."""
    from torch._dynamo import exc

    names = ("FailOnRecompileLimitHit", "FailOnCacheLimitHit")
    refusals = tuple(getattr(exc, name) for name in names if hasattr(exc, name))
    return isinstance(error, refusals)


def _is_compiler_failure(error: BaseException) -> bool:
    """Whether ``error`` says the compiler (not the function) failed: no C++ compiler, no Triton, a backend crash."""
    from lightning_gradcomp.core.ahead import BuildFailed

    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, (BuildFailed, ImportError, OSError)):
            return True
        if type(seen).__name__ in {"BackendCompilerFailed", "InvalidCxxCompiler"}:
            return True
        if type(seen).__name__ in {"TritonMissing", "GPUTooOldForTriton"}:
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def fused(function: F) -> F:
    """Mark ``function`` (pure, tensors in and out, no Python-side effects) as a codec kernel: :class:`FusedKernel`."""
    return FusedKernel(function)  # type: ignore[return-value]
