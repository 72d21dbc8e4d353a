"""The child process of :mod:`lightning_gradcomp.core.ahead`: builds codec kernel packages on request.

It reads one JSON request a line (the kernel as ``module:name``, the arguments' layout, the package's path), exports
the kernel with example tensors of that layout and the constants bound (``torch.export``), compiles it with
AOTInductor and writes the package and the outputs' structure beside it (each through a temporary file and a rename,
so that a reader never sees half of one), then answers one JSON line. Only this library's kernels are built.
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
from torch.utils import _pytree

from lightning_gradcomp.core.ahead import rebuild
from lightning_gradcomp.core.fused import FusedKernel, inductor_options


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
    module_name, _, attribute = name.partition(":")
    if not module_name.startswith("lightning_gradcomp."):
        raise ValueError(f"kernel {name!r} is not one of this library's")
    kernel = getattr(importlib.import_module(module_name), attribute)
    if not isinstance(kernel, FusedKernel):
        raise ValueError(f"{name!r} is not a codec kernel (@fused)")
    return kernel.function


def build(request: dict[str, Any]) -> None:
    """Export, compile and write one package (see the module)."""
    function, layout, path = _kernel(request["kernel"]), request["layout"], Path(request["path"])
    tensors = _examples(layout)
    bound = _Bound(function, layout)
    outputs = _pytree.tree_flatten(bound(*[t.clone() for t in tensors]))[1]
    with torch.no_grad():
        program = torch.export.export(bound, tuple(tensors), strict=False)
    staged = path.with_name(f"{path.stem}.{os.getpid()}.tmp.pt2")  # the compiler wants the suffix
    torch._inductor.aoti_compile_and_package(program, package_path=str(staged), inductor_configs=inductor_options())
    spec = path.with_suffix(".json")
    staged_spec = spec.with_name(f"{spec.name}.{os.getpid()}.tmp")
    staged_spec.write_text(_pytree.treespec_dumps(outputs))
    os.replace(staged_spec, spec)
    os.replace(staged, path)


def main() -> None:
    replies = sys.stdout
    sys.stdout = sys.stderr  # whatever the compiler prints goes to the log, not into the replies
    torch.set_num_threads(1)
    for line in sys.stdin:
        try:
            build(json.loads(line))
            answer: dict[str, Any] = {"ok": True}
        except Exception as error:  # every failure is an answer: the parent warns and runs the kernel eagerly
            traceback.print_exc()
            first_line = str(error).splitlines()[0] if str(error) else ""
            answer = {"ok": False, "error": f"{type(error).__name__}: {first_line}"}
        replies.write(json.dumps(answer) + "\n")
        replies.flush()


if __name__ == "__main__":
    main()
