"""Accordion's adaptive compression: its rule by hand, the same decisions on every rank, and its settings."""

from __future__ import annotations

import math

import pytest
import torch
from models import teacher_task
from ranks import run_ranks
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from lightning_gradcomp import GradCompStrategy
from lightning_gradcomp.core.adaptive import Accordion, AccordionDecision
from lightning_gradcomp.core.compressors import SparseEntries, TopKCompressor
from lightning_gradcomp.core.memory import ErrorFeedback
from lightning_gradcomp.core.schedule import WarmupSchedule
from lightning_gradcomp.ddp.hook import GradCompHook, gradcomp_comm_hook


def _feed(schedule: Accordion, squared_norms: list[float], start: int = 0, world_size: int = 1) -> list[str]:
    """Run ``schedule`` over steps with these squared norms, as the hook does; the regime of each step."""
    regimes = []
    for step, value in enumerate(squared_norms, start=start):
        if schedule.due(step):
            schedule.decide(step, schedule.statistics() * world_size, world_size)
        regimes.append(schedule.plan(step).regime)
        schedule.observe(torch.tensor(value, dtype=torch.float32))
    return regimes


def test_the_rule_by_hand() -> None:
    """Agarwal et al., Algorithm 1: the interval's norm against the last one's, a change of at least eta is critical."""
    schedule = Accordion(density=0.001, critical_density=0.01, interval=2, threshold=0.5)
    # norms per interval: 2, 3 (+50%: critical), sqrt(12.5) (+18%: relaxed), 10 (+183%: critical), 10 (relaxed)
    regimes = _feed(schedule, [4, 4, 9, 9, 9, 16, 100, 100, 100, 100, 1])
    assert regimes == ["warmup"] + ["critical"] * 5 + ["relaxed"] * 2 + ["critical"] * 2 + ["relaxed"]
    assert schedule.decisions == [
        AccordionDecision(2, 2.0, None, True),  # nothing to compare with: the first intervals stay critical
        AccordionDecision(4, 3.0, 0.5, True),
        AccordionDecision(6, math.sqrt(12.5), abs(3.0 - math.sqrt(12.5)) / 3.0, False),
        AccordionDecision(8, 10.0, (10.0 - math.sqrt(12.5)) / math.sqrt(12.5), True),
        AccordionDecision(10, 10.0, 0.0, False),
    ]
    plans = [schedule.plan(10), Accordion(density=0.001, critical_density=0.01).plan(5)]
    assert [(p.compress, p.density) for p in plans] == [(True, 0.001), (True, 0.01)]
    dense = Accordion(interval=2)  # no density: critical steps are averaged densely, as DDP does
    assert [(p.compress, p.regime) for p in (dense.plan(0), dense.plan(1))] == [(False, "warmup"), (False, "critical")]


def test_summed_over_ranks_and_blind_to_skipped_steps() -> None:
    """The ranks' squared norms are averaged over ranks and steps; a non-finite one (a step AMP skips) is left out."""
    ranks = [Accordion(interval=3, threshold=0.5) for _ in range(2)]
    for schedule, values in zip(ranks, ([1.0, math.inf, 1.0], [9.0, 9.0, 9.0]), strict=True):
        for value in values:
            schedule.observe(torch.tensor(value))
    summed = ranks[0].statistics() + ranks[1].statistics()
    assert summed.tolist() == [29.0, 5.0]  # 1 + 1 + 27 over 2 + 3 finite steps
    for schedule in ranks:
        schedule.decide(3, summed, 2)
    assert ranks[0].decisions == ranks[1].decisions == [AccordionDecision(3, math.sqrt(29 / 5), None, True)]


@pytest.mark.parametrize("stop", [5, 7])
def test_a_schedule_restored_between_two_decisions_decides_as_the_one_that_never_stopped(stop: int) -> None:
    """Stopped inside the second interval (still critical), or inside the third (relaxed since step 6)."""
    norms = [4.0, 4.1, 9.0, 9.3, 9.1, 9.6, 9.5, 9.4, 41.0, 40.0, 42.0, 40.5]
    straight = Accordion(density=0.01, critical_density=0.1, interval=3, threshold=0.4)
    expected = _feed(straight, norms)
    assert expected[6:9] == ["relaxed"] * 3 and expected[9] == "critical"
    stopped = Accordion(density=0.01, critical_density=0.1, interval=3, threshold=0.4)
    first = _feed(stopped, norms[:stop])
    assert stopped.critical == (stop < 6)
    resumed = Accordion(density=0.01, critical_density=0.1, interval=3, threshold=0.4)
    resumed.load_state_dict(stopped.state_dict())
    assert first + _feed(resumed, norms[stop:], start=stop) == expected
    assert resumed.decisions == straight.decisions and len(straight.decisions) == 3
    assert resumed.state_dict() == straight.state_dict()


def test_a_checkpoint_of_another_schedule_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="holds the state of the 'warmup' schedule, but this run uses 'accordion'"):
        Accordion().load_state_dict({})  # a shard written without adaptive compression (or before it existed)
    with pytest.raises(ValueError, match="holds the state of the 'accordion' schedule, but this run uses 'warmup'"):
        WarmupSchedule().load_state_dict(Accordion().state_dict())


def test_a_norm_of_zero_after_zero_is_no_change_and_a_norm_after_zero_an_infinite_one() -> None:
    """Catches: a regime that starts to move after an interval of norm 0 called relaxed (its change taken as 0)."""
    schedule = Accordion(interval=1)
    _feed(schedule, [0.0, 0.0, 0.0])
    assert [d.change for d in schedule.decisions] == [None, 0.0] and not schedule.critical
    _feed(schedule, [4.0, 4.0], start=3)
    assert schedule.decisions[2:] == [AccordionDecision(3, 0.0, 0.0, False), AccordionDecision(4, 2.0, math.inf, True)]
    assert schedule.plan(4).regime == "critical"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"interval": 0}, r"interval must be an integer >= 1 \(optimizer steps between two decisions\), got 0"),
        ({"threshold": 0.0}, r"threshold must be a finite number > 0, got 0.0"),
        ({"density": 0.01, "critical_density": 0.001}, r"critical_density=0.001 is below the density 0.01"),
        ({"critical_density": 0.1}, r"critical_density=0.1 needs a compressor with a density"),
        ({"density": 0.01, "critical_density": 1.5}, r"critical_density must be a number in \(0, 1\], got 1.5"),
    ],
)
def test_bad_arguments_are_refused_by_name(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Accordion(**kwargs)


def test_the_strategy_builds_it_and_refuses_what_conflicts() -> None:
    topk = GradCompStrategy(density=0.001, adaptive="accordion", adaptive_kwargs={"interval": 20})
    assert repr(topk.schedule) == (
        "Accordion(density=0.001, critical_density=0.004, interval=20, threshold=0.5, warmup_steps=1)"
    )
    terngrad = GradCompStrategy(compressor="terngrad", memory="none", adaptive="accordion")
    assert terngrad.schedule.critical_density is None  # no density: critical regimes are averaged densely
    dense = GradCompStrategy(adaptive="accordion", adaptive_kwargs={"critical_density": None})
    assert dense.schedule.critical_density is None
    # four times 0.1 would send 40% of the entries, about what the dense gradient costs: critical regimes dense instead
    assert GradCompStrategy(density=0.1, adaptive="accordion").schedule.critical_density is None
    with pytest.raises(ValueError, match="compressor='none' and memory='none': every step is dense"):
        GradCompStrategy(compressor="none", memory="none", adaptive="accordion")
    with pytest.raises(ValueError, match=r"adaptive must be one of \['none', 'accordion'\], got 'acordion'"):
        GradCompStrategy(adaptive="acordion")
    with pytest.raises(ValueError, match=r"adaptive='accordion' sets the density itself; do not give density_warm"):
        GradCompStrategy(adaptive="accordion", density_warmup_steps=100)
    with pytest.raises(ValueError, match=r"adaptive_kwargs has unknown arguments \['intervl'\]; Accordion takes"):
        GradCompStrategy(adaptive="accordion", adaptive_kwargs={"intervl": 5})
    with pytest.raises(ValueError, match=r"adaptive_kwargs=\{'interval': 5\} configure an adaptive schedule"):
        GradCompStrategy(adaptive_kwargs={"interval": 5})


INTERVAL = 3
STEPS = 18
JUMP = 12  # the loss is scaled by 20 from this step on: the gradient norm jumps, a critical regime again


def _accordion_on_real_ranks(rank: int, world_size: int, loss_scale: float = 1.0) -> dict:
    """Top-k with error feedback under Accordion on every rank's own data; each step's local gradient norm measured
    apart on an undistributed copy of the same weights. With ``loss_scale``, the loss is scaled as AMP's GradScaler
    does and the hook is told the scale."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))
    copy = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))
    schedule = Accordion(density=0.05, critical_density=0.5, interval=INTERVAL, threshold=0.5)
    hook = GradCompHook(TopKCompressor(0.05), ErrorFeedback(), "allgather", list(model.named_parameters()),
                        min_compress_numel=100, schedule=schedule)  # fmt: skip
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.005)  # several buckets, rebuilt after step 1
    ddp.register_comm_hook(hook, gradcomp_comm_hook)
    if loss_scale != 1.0:
        hook.loss_scale = lambda: loss_scale
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05 / loss_scale)
    data = teacher_task(n=STEPS * 16, seed=1 + rank)
    local_norms = []
    for step in range(STEPS):
        x, y = data.tensors[0][step * 16 : (step + 1) * 16], data.tensors[1][step * 16 : (step + 1) * 16]
        scale = 20.0 if step >= JUMP else 1.0
        copy.load_state_dict(model.state_dict())
        copy.zero_grad()
        (scale * nn.functional.cross_entropy(copy(x), y)).backward()
        local_norms.append(sum(float(p.grad.double().pow(2).sum()) for p in copy.parameters()))
        optimizer.zero_grad()
        (loss_scale * scale * nn.functional.cross_entropy(ddp(x), y)).backward()
        optimizer.step()
    return {
        "decisions": schedule.decisions,
        "regimes": [s.regime for s in hook.history],
        "densities": [s.planned_density for s in hook.history],
        "bytes": [(s.bytes_sent, s.collectives) for s in hook.history],
        "local_norms": local_norms,
    }


@pytest.mark.parametrize("world_size", [2, 3])
def test_every_rank_decides_alike_from_the_ranks_local_gradient_norms(world_size: int) -> None:
    results = run_ranks(_accordion_on_real_ranks, world_size)
    first = results[0]
    for rank, r in enumerate(results):
        assert r["decisions"] == first["decisions"], rank
        assert r["regimes"] == first["regimes"] and r["densities"] == first["densities"], rank
    # the statistic: each interval's root mean square of the ranks' local gradient norms (float32 norms per
    # parameter, summed in float64, against a float64 reference)
    for decision in first["decisions"]:
        steps = range(decision.step - INTERVAL, decision.step)
        mean = sum(r["local_norms"][s] for r in results for s in steps) / (world_size * INTERVAL)
        assert decision.norm == pytest.approx(math.sqrt(mean), rel=1e-6), decision
    regimes = first["regimes"]
    assert regimes[0] == "warmup" and set(regimes[1 : 2 * INTERVAL]) == {"critical"}
    assert "relaxed" in regimes[2 * INTERVAL : JUMP]  # calm: compressed at the density
    assert regimes[JUMP + INTERVAL - JUMP % INTERVAL] == "critical"  # the jump is seen at the next decision
    assert {d for d, g in zip(first["densities"], regimes, strict=True) if g != "warmup"} == {0.5, 0.05}
    # a decision costs one collective of two float64 numbers, once per interval
    for step in range(2 * INTERVAL, STEPS - 1, INTERVAL):
        if regimes[step] == regimes[step + 1]:
            (sent, calls), (after, after_calls) = first["bytes"][step], first["bytes"][step + 1]
            assert (sent - after, calls - after_calls) == (16, 1), step


def _fit_with_monitor(rank: int, world_size: int, root: str) -> dict:
    import csv

    import lightning.pytorch as pl
    from lightning.pytorch.loggers import CSVLogger
    from models import TinyClassifier
    from torch.utils.data import DataLoader

    from lightning_gradcomp import CompressionMonitor

    pl.seed_everything(0, verbose=False)
    strategy = GradCompStrategy(density=0.05, min_compress_numel=256, adaptive="accordion",
                                adaptive_kwargs={"interval": 4, "threshold": 10.0})  # fmt: skip
    logger = CSVLogger(root, name="csv")
    trainer = pl.Trainer(accelerator="cpu", devices=world_size, strategy=strategy, max_steps=16, logger=logger,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[CompressionMonitor(every_n_steps=4, print_summary=False)])  # fmt: skip
    trainer.fit(TinyClassifier(), DataLoader(teacher_task(n=512), batch_size=16))
    rows = []
    if rank == 0:
        with open(f"{logger.log_dir}/metrics.csv", newline="") as handle:
            rows = [row for row in csv.DictReader(handle) if row.get("gradcomp/critical_fraction")]
    return {"regimes": [s.regime for s in strategy.gradcomp_hook.history], "rows": rows}


def test_the_trainer_strategy_runs_it_and_the_monitor_logs_the_critical_share(tmp_path) -> None:
    results = run_ranks(_fit_with_monitor, 2, str(tmp_path), init=False)
    regimes = results[0]["regimes"]
    assert results[1]["regimes"] == regimes
    # decisions at steps 4 (nothing to compare), 8 (a change below 10: relaxed) and 12
    assert regimes == ["warmup"] + ["critical"] * 7 + ["relaxed"] * 8
    shares = [float(row["gradcomp/critical_fraction"]) for row in results[0]["rows"]]
    assert shares == [0.75, 1.0, 0.0, 0.0]  # each window of 4 steps: the warm-up step is not critical


def test_a_dense_step_takes_what_error_feedback_owes_along() -> None:
    """``Memory.flush_``: error feedback's residual (and DGC's velocity share) goes with a dense step's gradient."""
    memory = ErrorFeedback(momentum=0.5)
    x = memory.compensate_("w", torch.tensor([1.0, 2.0, 3.0]))  # velocity u = grad; acc = u
    memory.update("w", x, SparseEntries(torch.tensor([2]), torch.tensor([3.0]), 3), x)  # index 2 sent
    assert memory.residual("w").tolist() == [1.0, 2.0, 0.0] and memory.velocity("w").tolist() == [1.0, 2.0, 0.0]
    grad = torch.tensor([10.0, 10.0, 10.0])
    memory.flush_("w", grad)
    assert grad.tolist() == [10.0 + 0.5 + 1.0, 10.0 + 1.0 + 2.0, 10.0]  # momentum * u + residual
    assert not memory.residual("w").any() and not memory.velocity("w").any()
    untouched = torch.tensor([1.0])
    memory.flush_("never compressed", untouched)
    assert untouched.tolist() == [1.0] and memory.residual("never compressed") is None


def _dense_critical_on_real_ranks(rank: int, world_size: int) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))
    memory = ErrorFeedback()
    schedule = Accordion(density=0.05, interval=INTERVAL, threshold=0.5)  # critical regimes averaged densely
    hook = GradCompHook(TopKCompressor(0.05), memory, "allgather", list(model.named_parameters()),
                        min_compress_numel=100, schedule=schedule)  # fmt: skip
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.005)
    ddp.register_comm_hook(hook, gradcomp_comm_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    data = teacher_task(n=STEPS * 16, seed=1 + rank)
    residuals = []
    for step in range(STEPS):
        x, y = data.tensors[0][step * 16 : (step + 1) * 16], data.tensors[1][step * 16 : (step + 1) * 16]
        optimizer.zero_grad()
        ((20.0 if step >= JUMP else 1.0) * nn.functional.cross_entropy(ddp(x), y)).backward()
        optimizer.step()
        residuals.append(sum(float(r.abs().sum()) for r in memory.local_state()))
    return {"regimes": [s.regime for s in hook.history], "compressed": [s.compressed for s in hook.history],
            "residuals": residuals, "weights": {k: v.clone() for k, v in model.state_dict().items()}}  # fmt: skip


def test_dense_critical_regimes_flush_the_residual_on_real_ranks() -> None:
    results = run_ranks(_dense_critical_on_real_ranks, 2)
    r = results[0]
    dense_after_relaxed = [
        s for s in range(1, STEPS) if r["regimes"][s] == "critical" and "relaxed" in r["regimes"][:s]
    ]
    assert dense_after_relaxed and not any(r["compressed"][s] for s in dense_after_relaxed)
    for rank_result in results:
        assert rank_result["residuals"][dense_after_relaxed[0] - 1] > 0  # owed after the relaxed steps
        assert all(rank_result["residuals"][s] == 0 for s in dense_after_relaxed)  # sent with the dense steps
        for name, value in rank_result["weights"].items():
            assert torch.equal(value, r["weights"][name]), name


def test_under_a_loss_scale_the_statistic_is_the_unscaled_gradients() -> None:
    """AMP multiplies the gradients the hook sees by the loss scale (2**10 here): told the scale, Accordion measures
    the same norms (to float32's rounding of the scaled sums), so a scale change is not a critical regime."""
    plain, scaled = run_ranks(_accordion_on_real_ranks, 2)[0], run_ranks(_accordion_on_real_ranks, 2, 1024.0)[0]
    assert [(d.step, d.critical) for d in scaled["decisions"]] == [(d.step, d.critical) for d in plain["decisions"]]
    for ours, reference in zip(scaled["decisions"], plain["decisions"], strict=True):
        assert ours.norm == pytest.approx(reference.norm, rel=1e-5)
