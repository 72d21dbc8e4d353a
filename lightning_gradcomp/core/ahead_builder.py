"""The child process of :mod:`lightning_gradcomp.core.ahead`: builds codec kernel packages on request.

It reads one JSON request a line (the kernel as ``module:name``, the arguments' layout, the package's path, the thread
count, the parent's source digest and torch version), exports the kernel with example tensors of that layout and the
constants bound (``torch.export``), compiles it with AOTInductor for that many threads and writes the package (through
a temporary file and a rename, so that a reader never sees half of one, private to the user), then answers one JSON
line with the request's ticket. Only this library's kernels are built, and only from the sources the parent keyed
them by. A ``{"quit": true}`` line ends it.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any

import torch

from lightning_gradcomp.core.ahead import LIBRARY, rebuild, sources_digest
from lightning_gradcomp.core.fused import FusedKernel, inductor_options

#: AOTInductor's settings for a package's C++ wrapper (the glue that checks the arguments and calls the kernel; the
#: kernel itself is compiled at -O3 whatever they say): unoptimised and without line tables, a package builds in 7.1-7.3
#: s instead of 11.7-13.3, and a call costs 14 us instead of 7 (one AMD EPYC core, EF-sign's encoder).
WRAPPER_OPTIONS: dict[str, Any] = {"compile_wrapper_opt_level": "O0", "enable_line_tables": False}


def build_options() -> dict[str, Any]:
    """The inductor settings a package is compiled with: the codec kernels' (:func:`inductor_options`) and
    :data:`WRAPPER_OPTIONS` where this torch has them."""
    from torch._inductor import config

    wrapper = config.aot_inductor
    return {
        **inductor_options(),
        **{f"aot_inductor.{name}": value for name, value in WRAPPER_OPTIONS.items() if hasattr(wrapper, name)},
    }


class _Bound(torch.nn.Module):
    """The kernel with its constants bound: called with the tensors alone, as the package will be."""

    def __init__(self, function: Any, layout: Any) -> None:
        super().__init__()
        self.function = function
        self.layout = layout

    def forward(self, *tensors: torch.Tensor) -> Any:
        given = iter(tensors)
        return self.function(*[rebuild(argument, given) for argument in self.layout])


def _examples(layout: Any) -> list[torch.Tensor]:
    """Zero tensors of the layout's shapes, strides and dtypes, in order."""
    found: list[torch.Tensor] = []

    def walk(item: list[Any]) -> None:
        kind = item[0]
        if kind == "tensor":
            _, shape, strides, dtype = item
            found.append(torch.empty_strided(shape, strides, dtype=getattr(torch, dtype)).zero_())
        elif kind in ("list", "tuple"):
            for child in item[1]:
                walk(child)

    for argument in layout:
        walk(argument)
    return found


def _kernel(name: str) -> Any:
    """The function of the ``@fused`` kernel named ``module:attribute``, one of this library's."""
    module_name, _, attribute = name.partition(":")
    if not module_name.startswith(LIBRARY):
        raise ValueError(f"kernel {name!r} is not one of this library's")
    kernel = getattr(importlib.import_module(module_name), attribute)
    if not isinstance(kernel, FusedKernel):
        raise ValueError(f"{name!r} is not a codec kernel (@fused)")
    return kernel.function


def build(request: dict[str, Any]) -> None:
    """Export, compile and write one package (see the module)."""
    if request["sources"] != sources_digest() or request["torch"] != torch.__version__:
        raise RuntimeError("the builder imported other sources or another torch than its parent keyed the package by")
    function, layout, path = _kernel(request["kernel"]), request["layout"], Path(request["path"])
    torch.set_num_threads(request["threads"])  # inductor writes its loops for the threads it compiles under
    bound = _Bound(function, layout)
    with torch.no_grad():
        program = torch.export.export(bound, tuple(_examples(layout)), strict=False)
    staged = path.with_name(f"{path.stem}.{os.getpid()}.tmp.pt2")  # the compiler wants the suffix
    try:
        torch._inductor.aoti_compile_and_package(program, package_path=str(staged), inductor_configs=build_options())
        os.replace(staged, path)
    finally:
        staged.unlink(missing_ok=True)


def main() -> None:
    """Answer requests from standard input until it ends or says quit; the compiler's output goes to standard error."""
    os.umask(0o077)  # packages private to the user
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # whatever the compiler (or a process it starts) prints goes to the log, not into the replies
    sys.stdout = sys.stderr
    for line in sys.stdin:
        request = json.loads(line)
        if request.get("quit"):
            break
        try:
            build(request)
            answer: dict[str, Any] = {"ok": True}
        except Exception as error:  # every failure is an answer: the parent warns and runs the kernel eagerly
            traceback.print_exc()
            first_line = str(error).splitlines()[0] if str(error) else ""
            answer = {"ok": False, "error": f"{type(error).__name__}: {first_line}"}
        replies.write(json.dumps({**answer, "ticket": request.get("ticket")}) + "\n")
        replies.flush()


if __name__ == "__main__":
    main()
