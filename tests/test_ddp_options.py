"""DistributedDataParallel's own options under compressed presets (``static_graph``, ``gradient_as_bucket_view``,
a small ``bucket_cap_mb``): on 2 ranks, every rank ends bit-identical to the run without them, which it also is to
the other rank -- the options change how DDP hands gradients over, never the arithmetic."""

from __future__ import annotations

import pytest
import torch
from models import ShuffledClassifier, fit
from ranks import run_ranks

from lightning_gradcomp import GradCompStrategy

#: The presets with the most distinct trips through the hook; PowerSGD compressing from step 2 (its preset's
#: Accordion would average the first 100 steps densely).
PRESETS = {
    "ddp_topk": {},
    "ddp_terngrad": {},
    "ddp_diana": {},
    "ddp_powersgd": {"adaptive": "none"},
}
OPTIONS = {
    "plain": {},
    "static_graph": {"static_graph": True},
    "bucket_view": {"gradient_as_bucket_view": True},
    "both_small_buckets": {"static_graph": True, "gradient_as_bucket_view": True, "bucket_cap_mb": 0.005},
}


def _runs(rank: int, world_size: int) -> dict:
    results = {}
    for preset, overrides in PRESETS.items():
        for option, ddp in OPTIONS.items():
            strategy = GradCompStrategy.from_preset(preset, **overrides, **ddp)
            model, _ = fit(strategy, world_size, 8, model_class=ShuffledClassifier)
            results[preset, option] = {
                "weights": {k: v.detach().clone() for k, v in model.state_dict().items()},
                "compressed": sum(s.compressed for s in strategy.gradcomp_hook.history),
            }
    return results


@pytest.fixture(scope="module")
def runs() -> list[dict]:
    return run_ranks(_runs, 2, init=False, timeout=600)


@pytest.mark.parametrize("preset", list(PRESETS))
def test_ddp_options_leave_the_compressed_run_bit_identical(runs: list[dict], preset: str) -> None:
    plain = runs[0][preset, "plain"]
    assert plain["compressed"] == 7  # every step after the first
    for option in OPTIONS:
        for rank in (0, 1):
            run = runs[rank][preset, option]
            assert run["compressed"] == 7, (option, rank)
            for key, value in plain["weights"].items():
                assert torch.equal(run["weights"][key], value), (option, rank, key)
