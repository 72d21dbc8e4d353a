"""What the compiled codec kernels add to a process's resident memory, and whether it grows with the tensors.

Each row is one fresh process (so nothing an earlier row loaded is shared) that imports Lightning and the library as a
training script does, then runs one codec's encode and decode on a bucket of ``n`` fp32 elements three times, as
``gpu/codecs.py`` times them (error feedback's compensation and residual where the method has them), with the kernels
eager, built ahead of time and loaded (``ahead``: what ``auto`` does on the CPU; a build runs in a child process,
outside the row's memory) or compiled by ``torch.compile`` in the process (``compiled``). It reports the resident
memory that stays once the bucket's tensors are freed (``steady``: the compiler's modules, graphs and loaded kernels)
and the peak over the calls (``peak``: the bucket's three tensors, the codec's temporaries and, compiled, what
compiling allocates on the way), both in MiB above the process's RSS before the first call. Where the compiled rows
exceed the eager ones by the same amount at every size, the excess is the compiler's own and not a temporary of the
tensors' size.

    python benchmarks/compiler_memory.py --json benchmarks/results/compiler_memory_cpu.json
    python benchmarks/compiler_memory.py --sizes 1.84e6 2.52e7 --codecs terngrad efsign qsgd_4bit

A fresh ``TORCHINDUCTOR_CACHE_DIR`` (and ``GRADCOMP_KERNEL_CACHE``) per run would make every compile cold; the rows
use the machine's caches as a training run does.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from machine import describe


def _mib(field: str) -> float:
    return int(re.search(rf"{field}:\s+(\d+)", Path("/proc/self/status").read_text()).group(1)) / 1024


def _settled() -> float:
    """The RSS (MiB) once freed memory is handed back to the system."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    return _mib("VmRSS")


def child(codec: str, numel: int, mode: str) -> dict:
    """One row, in this process: the RSS before, after (steady) and the peak over three encodes and decodes."""
    import lightning  # noqa: F401  (a training script's process holds it)
    import torch

    from lightning_gradcomp.core.fused import set_codec_mode

    # benchmarks/gpu/codecs.py, by its path: ``codecs`` is also a standard module, imported at startup
    spec = importlib.util.spec_from_file_location("gpu_codecs", Path(__file__).resolve().parent / "gpu" / "codecs.py")
    codecs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(codecs)
    measure = codecs.measure

    torch.set_num_threads(1)
    set_codec_mode(mode)
    before = _settled()
    Path("/proc/self/clear_refs").write_text("5")  # the peak from here on
    measure(codec, numel, torch.device("cpu"), repeats=3)
    peak = _mib("VmHWM")
    steady = _settled()
    return {"codec": codec, "numel": numel, "mode": mode, "rss_before_mib": before,
            "steady_mib": steady - before, "peak_mib": peak - before}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", type=float, default=[1.84e6, 2.52e7])
    parser.add_argument("--codecs", nargs="+", default=["terngrad", "qsgd_4bit", "efsign"])
    modes = ["eager", "ahead", "compiled"]
    parser.add_argument("--modes", nargs="+", default=modes, choices=modes)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--child", nargs=3, metavar=("CODEC", "NUMEL", "MODE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child[0], int(args.child[1]), args.child[2])))
        return
    rows = []
    environment = dict(os.environ, OMP_NUM_THREADS="1")
    for codec in args.codecs:
        for size in args.sizes:
            for mode in args.modes:
                command = [sys.executable, __file__, "--child", codec, str(int(size)), mode]
                done = subprocess.run(command, capture_output=True, text=True, check=True, env=environment)
                rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
                row = rows[-1]
                print(f"{codec:10} {int(size):>11,} {mode:9} steady +{row['steady_mib']:6.1f} MiB  "
                      f"peak +{row['peak_mib']:6.1f} MiB", flush=True)  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps({"machine": describe(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
