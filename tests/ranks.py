"""Start real ranks for a test: processes over gloo on loopback, with a hard deadline.

``run_ranks(fn, P, *args)`` runs ``fn(rank, P, *args)`` in P processes (forked from a server that has imported
torch and Lightning once, with the test's environment as it is at the launch) and returns their results in rank
order. A worker that runs several independent cases in one launch (starting ranks costs seconds) runs them
through :func:`run_cases`, and each test reads its own with :func:`case_results`: a case that raises fails its
own tests, with its ranks' tracebacks, and not every test of the launch. With ``init=True`` the default process
group is initialised (gloo, 60 s timeout); with ``init=False`` only the environment Lightning reads is set
(``LOCAL_RANK`` and friends), so a ``Trainer`` in ``fn`` joins the ranks as under torchrun.
"""

from __future__ import annotations

import os
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_gradcomp.ddp.torch_ddp import destroy_process_group

PROCESS_GROUP_TIMEOUT = timedelta(seconds=60)


#: what the fork server imports once, for every rank forked from it
PRELOAD = ["torch", "torch.distributed", "lightning.pytorch", "lightning_gradcomp", "models", "ranks"]


def _forkserver() -> Any:
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    return context


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _entry(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    port: int,
    out: str,
    init: bool,
    args: tuple,
    environment: dict[str, str],
) -> None:
    os.environ.clear()  # the test's environment as it is now (a forked rank has the fork server's, from its start)
    os.environ.update(environment)
    os.environ.update(
        OMP_NUM_THREADS="1",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        WORLD_SIZE=str(world_size),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        NODE_RANK="0",
    )
    torch.set_num_threads(1)
    failed = False
    try:
        if init:
            dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=PROCESS_GROUP_TIMEOUT)
        result = fn(rank, world_size, *args)
        torch.save(result, Path(out) / f"{rank}.pt")
    except BaseException:
        (Path(out) / f"{rank}.err").write_text(traceback.format_exc())
        failed = True  # exit below: a live traceback would keep the failed frames' DDP wrappers alive
    destroy_process_group()  # after the frames that held DDP wrappers are gone (see its docstring)
    if failed:
        sys.exit(1)


def run_ranks(
    fn: Callable[..., Any], world_size: int, *args: Any, init: bool = True, timeout: float = 180, fresh: bool = False
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` ranks; results in rank order.

    The ranks are forked from a server that imported torch, Lightning and the package once (a freshly spawned
    interpreter imports them again, about 5 s of CPU per rank on the 2-core CI machine); ``fresh=True`` spawns
    them instead, for a test that needs what only a new interpreter reads at start-up (malloc's environment).
    """
    context = mp.get_context("spawn") if fresh else _forkserver()
    with tempfile.TemporaryDirectory() as out:
        port = free_port()
        procs = [
            context.Process(target=_entry, args=(fn, r, world_size, port, out, init, args, dict(os.environ)))
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        errors = {
            r: (Path(out) / f"{r}.err").read_text() for r in range(world_size) if (Path(out) / f"{r}.err").exists()
        }
        if errors or hung:
            details = "\n".join(f"--- rank {r} ---\n{text}" for r, text in sorted(errors.items()))
            raise AssertionError(
                f"ranks failed (hung past {timeout} s: {hung}; exit codes {[p.exitcode for p in procs]})\n{details}"
            )
        return [torch.load(Path(out) / f"{r}.pt", weights_only=False) for r in range(world_size)]


#: ``launch_once(fn, world_size)``, the session fixture of conftest.py: ``run_ranks(fn, world_size)`` launched
#: once per session, for workers that run several cases each read by its own test.
LaunchOnce = Callable[[Callable[..., Any], int], list[Any]]
#: ``every_rank(world_size, case)``, the fixture of conftest.py: a case's result on every rank (``case_results``
#: of the launch of a test module's ``every_case`` worker).
EveryRank = Callable[[int, Any], list[Any]]


@dataclass(frozen=True)
class CaseFailure:
    """What a case raised on one rank (its traceback), kept in place of the case's result."""

    case: Any
    rank: int
    traceback: str


def run_cases(rank: int, world_size: int, cases: dict[Any, Callable[[int, int], Any]]) -> dict[Any, Any]:
    """Run every case on this rank, ``case(rank, world_size)``; one that raises is recorded as a
    :class:`CaseFailure` and the next one runs. (A case that fails on some ranks only can leave the others
    waiting in a collective until the process group's timeout: they then fail that case too, and the ranks'
    collectives may stay out of step for the cases after it, which then fail or time out as well.)"""
    out: dict[Any, Any] = {}
    for name, case in cases.items():
        try:
            out[name] = case(rank, world_size)
        except Exception:
            out[name] = CaseFailure(name, rank, traceback.format_exc())
    return out


def case_results(launched: list[dict[Any, Any]], case: Any) -> list[Any]:
    """``case``'s result on every rank, in rank order; an ``AssertionError`` with the tracebacks of the ranks
    where it failed."""
    results = [ranks[case] for ranks in launched]
    failures = [r for r in results if isinstance(r, CaseFailure)]
    if failures:
        details = "\n".join(f"--- rank {f.rank} ---\n{f.traceback}" for f in failures)
        raise AssertionError(f"case {case!r} failed on ranks {[f.rank for f in failures]}\n{details}")
    return results
