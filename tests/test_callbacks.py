"""Diagnostics callbacks: 2-process CPU fits asserting on what was logged, plus bad-input and bound math checks."""

from __future__ import annotations

import csv
import io
import math
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from models import TinyClassifier, quiet_trainer, teacher_task
from ranks import run_ranks
from rich.console import Console
from test_terngrad import Z_LIMIT
from torch.utils.data import DataLoader

from lightning_gradcomp import GradCompStrategy, TopKCompressor
from lightning_gradcomp.callbacks import (
    BoundCheck,
    BoundViolationError,
    CompressionMonitor,
    GradientHistogram,
    layer_bounds,
)
from lightning_gradcomp.core.compressors import IdentityCompressor
from lightning_gradcomp.core.compressors.indices import encoded_nbytes
from lightning_gradcomp.core.compressors.topk import k_for

TIMEOUT = timedelta(seconds=60)
STEPS = 10
DENSITY = 0.05
LAYERS = ("net.0.weight", "net.2.weight")  # 2048 and 256 elements; compressed with min_compress_numel=256
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _history(strategy: GradCompStrategy) -> list[dict[str, Any]]:
    assert strategy.gradcomp_hook is not None
    return [
        {
            "step": s.step,
            "dense_bytes": s.dense_bytes,
            "bytes_sent": s.bytes_sent,
            "numel": s.numel,
            "selected": s.selected,
            "numel_compressed": s.numel_compressed,
            "ratio": s.compression_ratio,
        }
        for s in strategy.gradcomp_hook.history
    ]


def _fit_topk_csv(rank: int, world_size: int, root: str) -> dict[str, Any]:
    pl.seed_everything(0, verbose=False)
    monitor = CompressionMonitor(every_n_steps=3, per_layer=True, progress_bar_every_n_steps=5)
    histograms = GradientHistogram(layers=list(LAYERS), every_n_steps=4)
    bounds = BoundCheck(every_n_steps=2, on_violation="raise")
    strategy = GradCompStrategy(compressor="topk", density=DENSITY, min_compress_numel=256, timeout=TIMEOUT)
    logger = CSVLogger(root, name="csv")
    trainer = quiet_trainer(strategy, world_size, STEPS, [monitor, histograms, bounds], logger)
    trainer.fit(TinyClassifier(), DataLoader(teacher_task(n=512), batch_size=16))
    text = io.StringIO()
    console = Console(file=text, width=200)
    console.print(monitor.summary_table())
    console.print(monitor.layer_table())
    return {
        "history": _history(strategy),
        "progress_bar": {k: float(v) for k, v in trainer.progress_bar_metrics.items()},
        "summary": monitor.summary,
        "table": text.getvalue(),
        "written": [str(p) for p in histograms.written],
        "metrics_file": str(Path(logger.log_dir) / "metrics.csv") if rank == 0 else None,
        # the hook keeps captured tensors on its latest step only
        "captures_left": sum(len(s.captures) for s in list(strategy.gradcomp_hook.history)[:-1]),
    }


def _rows(path: str, key: str) -> list[dict[str, float]]:
    with open(path, newline="") as handle:
        return [
            {k: float(v) for k, v in row.items() if v != ""} for row in csv.DictReader(handle) if row.get(key, "") != ""
        ]


@pytest.fixture(scope="module")
def topk_csv_fit(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_ranks(_fit_topk_csv, 2, str(tmp_path_factory.mktemp("csv")), init=False)


def test_monitor_logs_the_counted_ratio_per_rank_and_in_total(topk_csv_fit: list[dict[str, Any]]) -> None:
    histories = [r["history"] for r in topk_csv_fit]
    assert [len(h) for h in histories] == [STEPS, STEPS]
    rows = _rows(topk_csv_fit[0]["metrics_file"], "gradcomp/compression_ratio")
    # every 3 steps, and the leftover step at the end of training
    assert [int(r["step"]) for r in rows] == [3, 6, 9, 10]
    previous = 0
    for row in rows:
        window = range(previous, int(row["step"]))
        previous = int(row["step"])
        steps = [[h[s] for s in window] for h in histories]
        dense = sum(s["dense_bytes"] for rank in steps for s in rank)
        sent = sum(s["bytes_sent"] for rank in steps for s in rank)
        assert row["gradcomp/compression_ratio"] == dense / sent
        assert row["gradcomp/dense_bytes"] == dense / len(window)
        assert row["gradcomp/bytes_sent"] == sent / len(window)
        for r, rank in enumerate(steps):
            assert row[f"gradcomp/bytes_sent_rank{r}"] == sum(s["bytes_sent"] for s in rank) / len(window)
        numel = sum(s["numel"] for rank in steps for s in rank)
        assert row["gradcomp/bits_per_element"] == 8.0 * sent / numel
        selected = sum(s["selected"] for rank in steps for s in rank)
        assert row["gradcomp/density"] == selected / sum(s["numel_compressed"] for rank in steps for s in rank)
        shares = [row[f"gradcomp/time_{part}"] for part in ("compress", "communicate", "decompress")]
        assert all(0.0 <= share < 1.0 for share in shares) and sum(shares) > 0
        assert row["gradcomp/residual_norm"] > 0
    # compressed steps send far less than dense DDP would
    assert rows[-1]["gradcomp/compression_ratio"] > 4
    # the live ratio in the progress bar is rank 0's latest step
    assert topk_csv_fit[0]["progress_bar"]["comp_ratio"] == pytest.approx(histories[0][-1]["ratio"], rel=1e-6)


def test_monitor_summary_table_covers_the_run(topk_csv_fit: list[dict[str, Any]]) -> None:
    histories = [r["history"] for r in topk_csv_fit]
    summary = topk_csv_fit[0]["summary"]
    assert [s.rank for s in summary] == ["0", "1", "all"]
    total = summary[-1]
    assert total.steps == STEPS and total.compressed_steps == STEPS - 1
    dense = sum(s["dense_bytes"] for h in histories for s in h)
    assert total.compression_ratio == dense / sum(s["bytes_sent"] for h in histories for s in h)
    for name in LAYERS:
        d = dict(TinyClassifier().named_parameters())[name].numel()
        layer = total.layers[name]
        k = k_for(d, DENSITY)
        assert layer["numel"] == d and layer["payload_bytes"] == 8 + encoded_nbytes(d, k) + 4 * k
        assert name in topk_csv_fit[0]["table"]
    assert "Gradient compression" in topk_csv_fit[0]["table"]


def test_bound_check_topk_bound_holds_on_every_layer(topk_csv_fit: list[dict[str, Any]]) -> None:
    rows = _rows(topk_csv_fit[0]["metrics_file"], "bounds/violations/topk")
    assert [int(r["step"]) for r in rows] == [2, 4, 6, 8, 10]
    params = dict(TinyClassifier().named_parameters())
    for row in rows:
        assert row["bounds/violations/topk"] == 0.0
        for name in LAYERS:
            d = params[name].numel()
            assert row[f"bounds/{name}/topk"] == 1.0 - k_for(d, DENSITY) / d
            assert row[f"bounds/{name}/gaussian"] == row[f"bounds/{name}/topk"] ** 2
            assert 0.0 < row[f"bounds/{name}/error"] <= row[f"bounds/{name}/topk"]
            assert f"bounds/{name}/omega" not in row and f"bounds/{name}/terngrad_ratio" not in row
    # what was read was released: no captured tensors stay in the hook's history
    assert [r["captures_left"] for r in topk_csv_fit] == [0, 0]


def test_histogram_pngs_are_valid_images(topk_csv_fit: list[dict[str, Any]]) -> None:
    import matplotlib.image

    written = [Path(p) for p in topk_csv_fit[0]["written"]]
    assert topk_csv_fit[1]["written"] == []  # only rank 0 writes
    assert sorted(p.name for p in written) == sorted(f"{n}_step{s:07d}.png" for n in LAYERS for s in (4, 8))
    metrics_dir = Path(topk_csv_fit[0]["metrics_file"]).parent
    for path in written:
        assert path.parent == metrics_dir / "gradient_histograms"
        assert path.read_bytes()[:8] == PNG_SIGNATURE
        image = matplotlib.image.imread(path)
        assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 300
        assert image.std() > 0  # something was drawn
    thresholds = _rows(topk_csv_fit[0]["metrics_file"], f"gradients/{LAYERS[0]}/threshold")
    assert [int(r["step"]) for r in thresholds] == [4, 8] and all(
        r[f"gradients/{LAYERS[0]}/threshold"] > 0 for r in thresholds
    )


def _fit_terngrad_tensorboard(rank: int, world_size: int, root: str) -> dict[str, Any]:
    from lightning_gradcomp.core.compressors.terngrad import TernGradCompressor

    pl.seed_everything(0, verbose=False)
    histograms = GradientHistogram(every_n_steps=3)
    bounds = BoundCheck(every_n_steps=3)
    strategy = GradCompStrategy(compressor=TernGradCompressor(), memory="none", min_compress_numel=256, timeout=TIMEOUT)
    logger = TensorBoardLogger(root, name="tb")
    trainer = quiet_trainer(
        strategy, world_size, STEPS, [CompressionMonitor(every_n_steps=5), histograms, bounds], logger
    )
    trainer.fit(TinyClassifier(), DataLoader(teacher_task(n=512), batch_size=16))
    return {"log_dir": logger.log_dir, "written": histograms.written, "checked": sorted(bounds.last_check)}


def test_tensorboard_events_carry_histograms_and_terngrad_ratio(tmp_path: Path) -> None:
    pytest.importorskip("lightning_gradcomp.core.compressors.terngrad")
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    results = run_ranks(_fit_terngrad_tensorboard, 2, str(tmp_path), init=False)
    assert results[0]["written"] == [] and results[0]["checked"] == sorted(LAYERS)
    events = EventAccumulator(results[0]["log_dir"], size_guidance={"histograms": 0, "scalars": 0})
    events.Reload()
    layer = "net.0.weight"  # the default: the largest compressed parameter
    histograms = events.Tags()["histograms"]
    assert sorted(histograms) == [f"gradients/{layer}/{kind}" for kind in ("compensated", "raw", "sent")]
    for tag in histograms:
        assert [e.step for e in events.Histograms(tag)] == [3, 6, 9]
        assert all(e.histogram_value.num == 2048 for e in events.Histograms(tag))  # ternary payloads are dense
    scalars = events.Tags()["scalars"]
    assert "gradcomp/compression_ratio" in scalars and "bounds/violations/terngrad" in scalars
    assert not any(tag.startswith("bounds/violations/topk") or tag.endswith("/omega") for tag in scalars)
    ratios = [e.value for e in events.Scalars(f"bounds/{layer}/terngrad_ratio")]
    assert len(ratios) == 3 and all(1.0 <= r <= math.sqrt(2048) for r in ratios)
    # steps 0-4 include the dense warm-up step; 5-9 are all ternary (2 bits + a scaler; biases stay dense)
    warm, compressed = (e.value for e in events.Scalars("gradcomp/compression_ratio"))
    assert 1 < warm < compressed and compressed > 8


class SmallestK(TopKCompressor):
    """A broken selector for the test: the k *smallest* magnitudes, which violates the contraction bound."""

    name = "smallestk"

    def select(self, x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        return torch.topk(x.abs(), k_for(x.numel(), self.density), largest=False, sorted=False).indices


def _fit_broken(rank: int, world_size: int, root: str) -> dict[str, Any]:
    pl.seed_everything(0, verbose=False)
    bounds = BoundCheck(layers=["net.0.weight"], every_n_steps=3, on_violation="stop")
    # asks for another layer at the same step, first: both requests must reach the hook
    histograms = GradientHistogram(layers=["net.2.weight"], every_n_steps=3)
    strategy = GradCompStrategy(compressor=SmallestK(0.05), min_compress_numel=256, timeout=TIMEOUT)
    trainer = quiet_trainer(strategy, world_size, STEPS, [histograms, bounds], CSVLogger(root, name="broken"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(TinyClassifier(), DataLoader(teacher_task(n=512), batch_size=16))
    return {
        "global_step": trainer.global_step,
        "warnings": [str(w.message) for w in caught if "BoundCheck" in str(w.message)],
        "last": {k: (v.error, v.topk) for k, v in bounds.last_check.items()},
        "written": [p.name for p in histograms.written],
    }


def test_bound_check_stops_training_when_the_topk_bound_fails(tmp_path: Path) -> None:
    results = run_ranks(_fit_broken, 2, str(tmp_path), init=False)
    for r in results:
        assert r["global_step"] == 3  # stopped after the first check, at the step it failed
        error, bound = r["last"]["net.0.weight"]
        assert error > bound
        assert r["warnings"] and "failed on 2 (layer, rank) pairs" in r["warnings"][0]
    assert results[0]["written"] == ["net.2.weight_step0000003.png"]


# ---- bad input -----------------------------------------------------------------------------------


@pytest.mark.parametrize("make", [CompressionMonitor, GradientHistogram, BoundCheck])
@pytest.mark.parametrize("value", [0, -1, 1.5, True, "3", None])
def test_frequencies_must_be_integers_of_at_least_one(make: type, value: Any) -> None:
    with pytest.raises(ValueError, match=rf"every_n_steps must be an integer >= 1, got {value!r}"):
        make(every_n_steps=value)


@pytest.mark.parametrize(
    ("make", "kwargs", "message"),
    [
        (GradientHistogram, {"layers": "net.0.weight"}, "layers must be a non-empty list"),
        (GradientHistogram, {"layers": []}, "layers must be a non-empty list"),
        (GradientHistogram, {"bins": 1}, "bins must be an integer >= 2"),
        (GradientHistogram, {"backend": "svg"}, "backend must be one of"),
        (BoundCheck, {"layers": [3]}, "layers must be a non-empty list"),
        (BoundCheck, {"on_violation": "explode"}, "on_violation must be one of"),
        (BoundCheck, {"rtol": -0.1}, "rtol must be a number in"),
        (CompressionMonitor, {"per_layer": "yes"}, "per_layer must be True or False"),
    ],
)
def test_bad_arguments_fail_at_construction(make: type, kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make(**kwargs)


def _unfitted(strategy: Any, logger: Any = False) -> pl.Trainer:
    """A trainer that is never fitted: ``setup`` is called by hand, so no process group is started."""
    return pl.Trainer(
        accelerator="cpu", devices=1, strategy=strategy, logger=logger, enable_progress_bar=False, max_steps=1
    )


@pytest.mark.parametrize("make", [GradientHistogram, BoundCheck])
def test_unknown_or_dense_layers_fail_at_setup(make: type) -> None:
    trainer = _unfitted(GradCompStrategy(min_compress_numel=1024))
    model = TinyClassifier()
    with pytest.raises(ValueError, match=r"unknown layers \['net.1.weight'\]; the model's parameters are \[") as err:
        make(layers=["net.0.weight", "net.1.weight"]).setup(trainer, model, "fit")
    assert all(name in str(err.value) for name, _ in model.named_parameters())
    with pytest.raises(ValueError, match=r"\['net.0.bias'\] are averaged densely.*compressed parameters are"):
        make(layers=["net.0.bias"]).setup(trainer, model, "fit")
    make(layers=["net.0.weight"]).setup(trainer, model, "fit")


@pytest.mark.parametrize("make", [CompressionMonitor, GradientHistogram, BoundCheck])
def test_other_strategies_are_refused_at_setup(make: type) -> None:
    with pytest.raises(TypeError, match=r"needs strategy=GradCompStrategy.*uses SingleDeviceStrategy"):
        make().setup(_unfitted("auto"), TinyClassifier(), "fit")


def test_tensorboard_backend_needs_a_tensorboard_logger(tmp_path: Path) -> None:
    trainer = _unfitted(GradCompStrategy(min_compress_numel=256), CSVLogger(tmp_path))
    with pytest.raises(ValueError, match="backend='tensorboard' needs a TensorBoardLogger"):
        GradientHistogram(backend="tensorboard").setup(trainer, TinyClassifier(), "fit")


# ---- the bounds on tensors -----------------------------------------------------------------------


def test_topk_error_meets_the_contraction_bound_exactly_at_its_worst_case() -> None:
    compressor = TopKCompressor(0.1)
    x = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    b = layer_bounds(x, compressor.decompress(compressor.compress(x)), compressor)
    assert b is not None and b.k == 100 and b.topk == 0.9 and b.gaussian == pytest.approx(0.81)
    assert b.error < b.gaussian  # Gaussian data: the bell-shape bound holds too
    assert not any(b.violations().values()) and b.omega is None and b.terngrad_ratio is None
    # all magnitudes equal: the error is exactly 1 - k/d, which must not count as a violation
    flat = torch.ones(1000).mul_(torch.tensor([1.0, -1.0]).repeat(500))
    worst = layer_bounds(flat, compressor.decompress(compressor.compress(flat)), compressor)
    assert worst is not None and worst.error == pytest.approx(0.9, abs=1e-12) and not worst.violations()["topk"]
    broken = layer_bounds(x, SmallestK(0.1).decompress(SmallestK(0.1).compress(x)), compressor)
    assert broken is not None and broken.violations()["topk"]
    assert layer_bounds(torch.zeros(10), torch.zeros(10), compressor) is None


def test_gaussiank_bound_uses_the_count_it_sent() -> None:
    gaussiank = pytest.importorskip("lightning_gradcomp.core.compressors.gaussiank")
    compressor = gaussiank.GaussianKCompressor(0.01)
    x = torch.randn(20000, generator=torch.Generator().manual_seed(1))
    sent = compressor.decompress(compressor.compress(x))
    b = layer_bounds(x, sent, compressor)
    assert b is not None and b.k == int(torch.count_nonzero(sent)) and not b.violations()["topk"]


def _bernoulli_error_moments(x: torch.Tensor, magnitude: torch.Tensor) -> tuple[float, float]:
    """Exact mean and variance of ``||C(x) - x||^2 / ||x||^2`` for ``C(x)_j = m_j sign(x_j) Bernoulli(|x_j| / m_j)``.

    Element ``j`` errs by ``(m_j - a_j)^2`` with probability ``p_j = a_j / m_j``, else by ``a_j^2``: mean
    ``m_j a_j - a_j^2``, variance ``p_j (1 - p_j) (m_j^2 - 2 a_j m_j)^2``, independent across elements.
    """
    a, m = x.double().abs(), magnitude.double()
    p = a / m
    norm_sq = float(a.square().sum())
    mean = float((m * a - a * a).sum()) / norm_sq
    variance = float((p * (1 - p) * (m * m - 2 * a * m).square()).sum()) / norm_sq**2
    return mean, variance


def test_unbiased_bounds_hold_on_average() -> None:
    """The mean measured error of the unbiased quantizers, against its exact value within Z_LIMIT standard errors
    (the suite's false-alarm rate). Catches: an all-zero output (error 1.0 against 1.74) or a mis-scaled one."""
    terngrad = pytest.importorskip("lightning_gradcomp.core.compressors.terngrad")
    quantizer = pytest.importorskip("lightning_gradcomp.core.compressors.quantizer")
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(512, generator=gen)
    tern = terngrad.TernGradCompressor(clip_sigma=0.0, share_scale=False)
    trials = 400
    draws = [layer_bounds(x, tern.decompress(tern.compress(x, gen)), tern) for _ in range(trials)]
    ratio = draws[0].terngrad_ratio
    assert ratio == pytest.approx(float(x.abs().max() * x.abs().sum() / x.square().sum()))
    # unclipped TernGrad with its own scaler s = max|x|: E[error] = R - 1 exactly (Wen et al., Sec. 3)
    mean, variance = _bernoulli_error_moments(x, x.abs().max().expand_as(x))
    assert mean == pytest.approx(ratio - 1.0, rel=1e-12)
    measured = sum(d.error for d in draws) / trials
    assert abs(measured - mean) <= Z_LIMIT * math.sqrt(variance / trials), (measured, mean)
    assert draws[0].omega is None and draws[0].topk is None
    # DIANA's block quantizer (p = inf, one block of 512): the same law, and the measured error within omega
    q = quantizer.BlockQuantizer()
    trials = 200
    draws = [layer_bounds(x, q.decompress(q.compress(x, gen)), q) for _ in range(trials)]
    assert draws[0].omega == q.omega(512)
    measured = sum(d.error for d in draws) / trials
    assert abs(measured - mean) <= Z_LIMIT * math.sqrt(variance / trials), (measured, mean)
    assert measured <= draws[0].omega
    identity = layer_bounds(x, IdentityCompressor().decompress(IdentityCompressor().compress(x)), IdentityCompressor())
    assert identity is not None and identity.error == 0.0 and identity.violations() == {}


def test_bound_violation_error_is_a_runtime_error() -> None:
    assert issubclass(BoundViolationError, RuntimeError)


def test_the_top_k_bounds_are_checked_for_the_largest_entries_only_not_a_random_draw() -> None:
    from lightning_gradcomp.callbacks.bound_check import applicable_bounds, layer_bounds
    from lightning_gradcomp.core.compressors import (
        DGCCompressor,
        GaussianKCompressor,
        RandomKCompressor,
        TopKCompressor,
        WirePrecision,
    )
    from lightning_gradcomp.core.compressors.lowbit import TwoBitValues

    for family in (
        TopKCompressor(0.1),
        GaussianKCompressor(0.1),
        DGCCompressor(0.1),
        WirePrecision(TopKCompressor(0.1), "bf16"),
    ):
        assert applicable_bounds(family)[:2] == ("topk", "gaussian"), family
    assert applicable_bounds(RandomKCompressor(0.1)) == ("omega",)  # unbiased: its variance bound instead
    assert applicable_bounds(RandomKCompressor(0.1, scaled=False)) == ()
    assert applicable_bounds(TwoBitValues(TopKCompressor(0.1))) == ()
    # a random draw of 1 entry in 10 from a vector whose mass sits on one entry breaks 1 - k/d: no bound to break
    x = torch.zeros(10)
    x[0] = 1.0
    compressor = RandomKCompressor(0.1, scaled=False)
    payload = compressor.compress(x, torch.Generator().manual_seed(3))
    bounds = layer_bounds(x, compressor.decompress(payload), compressor)
    assert bounds is not None and bounds.error in (0.0, 1.0) and bounds.violations() == {}
