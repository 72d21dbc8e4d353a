"""Session fixtures several test modules share: the launches of multi-case workers, the real MNIST files and
the fits trained on them."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from mnist_fit import fit
from ranks import EveryRank, LaunchOnce, case_results, run_ranks

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
