"""Session fixtures several test modules share: the launches of multi-case workers, the real MNIST files and
the fits trained on them.

The suite's rules (each test should fail with the behaviour its name claims broken, and say in a line what
broken behaviour it catches where that is not obvious):

* **Every rank's outcome is asserted.** A multi-process test checks what each rank returned (``run_ranks``
  raises on any rank's exception; a worker that catches per case or per job hands every rank's outcome
  back), never rank 0's alone: a failure on rank 1 only must fail the test.
* **Tolerances come from variances.** A statistical check compares with the exact mean (or bound) within
  ``Z_LIMIT`` standard errors derived from the exact or measured variance, at the false-alarm rate stated in
  ``test_terngrad.py`` (``FALSE_ALARM``); never a hand-picked ``rel=0.05`` or a bound far above the value.
  Float comparisons are bit for bit where the arithmetic is the same, else within what the stated cause
  (a summation order, a rounding) can explain.
* **No skip on a misspelling.** A test skips only for something absent from the machine (the MNIST files,
  an optional package, a GPU); an unknown or misspelt name in a recipe or an argument fails.
* **Shortcuts are not the path under test.** Where the code has a fast path (the dense baseline's own
  allreduce), a test of the general path forces it and asserts that it ran (``StepStats.compressed``).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from mnist_fit import fit
from ranks import EveryRank, LaunchOnce, case_results, run_ranks

# Codec kernels run eagerly in the suite, ranks and subprocesses included: compiling each size met would cost
# seconds a test. test_fused.py runs them compiled and holds them to the eager oracle.
os.environ.setdefault("GRADCOMP_CODECS", "eager")

#: The real MNIST test set (10,000 images, IDX) beside the repository.
MNIST_DIR = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "mnist"


@pytest.fixture(scope="session")
def launch_once() -> LaunchOnce:
    """``launch_once(fn, world_size)``: ``run_ranks(fn, world_size)``, launched once per session (starting ranks
    costs seconds): for workers that run several independent cases (``ranks.run_cases``), each read by its own
    test (``ranks.case_results``)."""
    launched: dict[tuple[str, int], list[Any]] = {}

    def launch(fn: Callable[..., Any], world_size: int) -> list[Any]:
        key = (f"{fn.__module__}.{fn.__qualname__}", world_size)
        if key not in launched:
            launched[key] = run_ranks(fn, world_size)
        return launched[key]

    return launch


@pytest.fixture
def every_rank(request: pytest.FixtureRequest, launch_once: LaunchOnce) -> EveryRank:
    """``every_rank(world_size, case)``: ``case``'s result on every rank, from one launch per world size of the
    test module's ``every_case(rank, world_size)`` worker (a ``ranks.run_cases`` over its cases)."""
    worker = request.module.every_case
    return lambda world_size, case: case_results(launch_once(worker, world_size), case)


@pytest.fixture(scope="session")
def mnist_dir() -> Path:
    """The MNIST files' folder; the test is skipped where they are absent."""
    if not MNIST_DIR.is_dir():
        pytest.skip(f"MNIST files not found in {MNIST_DIR}")
    return MNIST_DIR


@pytest.fixture(scope="session")
def mnist_fit(mnist_dir: Path) -> Callable[..., dict]:
    """``mnist_fit(strategy_kwargs, steps=250, seed=0, world_size=2, model_kwargs=None)``: rank 0's validation
    accuracy and mean bytes per compressed step for ``GradCompStrategy(**strategy_kwargs)`` on LeNet-5/MNIST.

    Each fit runs once per session: the dense baseline several modules compare with is trained once.
    """
    results: dict[str, dict] = {}

    def run(
        strategy_kwargs: dict[str, Any],
        steps: int = 250,
        seed: int = 0,
        world_size: int = 2,
        model_kwargs: dict[str, Any] | None = None,
    ) -> dict:
        model_kwargs = dict(model_kwargs or {})
        key = repr((sorted(strategy_kwargs.items()), steps, seed, world_size, sorted(model_kwargs.items())))
        if key not in results:
            results[key] = run_ranks(
                fit, world_size, str(mnist_dir), strategy_kwargs, steps, seed, model_kwargs, init=False, timeout=300
            )[0]
        return results[key]

    return run
