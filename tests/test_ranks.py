"""tests/ranks.py: a failing case of a multi-case launch fails its own tests, not every test of the launch."""

from __future__ import annotations

import pytest
from ranks import case_results, run_cases, run_ranks


def _one_fine_one_failing(rank: int, world_size: int) -> dict:
    def failing(rank: int, world_size: int) -> int:
        if rank == 1:
            raise ValueError("rank 1 refuses")
        return rank

    return run_cases(rank, world_size, {"failing": failing, "fine": lambda r, w: (r, w)})


def test_a_failing_case_reports_its_ranks_tracebacks_and_leaves_the_others_readable() -> None:
    launched = run_ranks(_one_fine_one_failing, 2)
    assert case_results(launched, "fine") == [(0, 2), (1, 2)]
    with pytest.raises(AssertionError, match=r"(?s)case 'failing' failed on ranks \[1\].*ValueError: rank 1 refuses"):
        case_results(launched, "failing")
