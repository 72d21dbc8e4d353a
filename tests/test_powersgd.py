"""PowerSGD: the math against a reference, PyTorch's own hook on real ranks, error feedback, bad arguments."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook as torch_powersgd
from ranks import run_ranks
from test_sign import _Recording
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from lightning_gradcomp import NAMED_STRATEGIES, GradCompStrategy
from lightning_gradcomp.core.compressors import DensePayload, LowRankPayload, PowerSGDCompressor
from lightning_gradcomp.core.compressors.powersgd import orthogonalize_
from lightning_gradcomp.ddp.hook import GradCompHook, gradcomp_comm_hook

STEPS = 6
START = 2  # dense steps first (PyTorch needs start_powerSGD_iter >= 2 for its bucket-keyed state)


def _reference(matrices: list[torch.Tensor], q0: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Algorithm 1 of Vogels et al. written out over all ranks' matrices at once: (M^, Q-)."""
    q, _ = torch.linalg.qr(q0.double())
    p = sum(m.double() @ q for m in matrices)
    p_hat, _ = torch.linalg.qr(p)
    q_mean = sum(m.double().T @ p_hat for m in matrices) / len(matrices)
    return p_hat @ q_mean.T, q_mean


def _two_rounds(
    compressor: PowerSGDCompressor, xs: list[torch.Tensor], q0: torch.Tensor, shapes: tuple | None = None
) -> list[torch.Tensor]:
    """What the allreduce aggregator does with PowerSGD's payloads, with the sums taken in this process."""
    world = len(xs)
    warm = [q0.clone() for _ in xs]
    payloads = [compressor.compress(x, warm_start=q, shapes=shapes) for x, q in zip(xs, warm, strict=True)]
    total = sum(compressor.summable(p, world).clone() for p in payloads)
    seconds = [compressor.next_summable(p, total.clone(), world) for p in payloads]
    total = sum(seconds)
    assert all(compressor.next_summable(p, total, world) is None for p in payloads)  # two rounds, no more
    means = [compressor.from_sum(total.clone(), p, world) for p in payloads]
    for q in warm[1:]:
        assert torch.equal(q, warm[0])  # every rank's warm start moves on alike
    return [*means, warm[0]]


@pytest.mark.parametrize("rank", [1, 2, 3])
def test_two_rounds_give_algorithm_1(rank: int) -> None:
    gen = torch.Generator().manual_seed(rank)
    xs = [torch.randn(24, 3, 2, 2, generator=gen, dtype=torch.float64) for _ in range(3)]
    q0 = torch.randn(12, rank, generator=gen, dtype=torch.float64)
    compressor = PowerSGDCompressor(rank=rank)
    *means, q_next = _two_rounds(compressor, xs, q0)
    expected, q_mean = _reference([x.reshape(24, 12) for x in xs], q0)
    # Gram-Schmidt (rank <= 2) and QR agree up to the columns' signs, which cancel in P^ Q-^T
    for mean in means:
        torch.testing.assert_close(mean, expected.reshape(-1), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(q_next.abs(), q_mean.abs(), rtol=1e-10, atol=1e-12)


def test_a_matrix_of_rank_r_comes_back_exactly() -> None:
    """P = M Q spans M's column space, so P^ P^^T M = M: one power iteration recovers a rank-r matrix."""
    gen = torch.Generator().manual_seed(0)
    m = torch.randn(40, 2, generator=gen, dtype=torch.float64) @ torch.randn(2, 30, generator=gen, dtype=torch.float64)
    mean, q_next = _two_rounds(PowerSGDCompressor(rank=2), [m], torch.randn(30, 2, generator=gen, dtype=torch.float64))
    torch.testing.assert_close(mean, m.reshape(-1), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(m @ torch.linalg.pinv(q_next.T) @ q_next.T, m)  # Q- spans the row space


def test_orthogonalize_gives_orthonormal_columns_and_leaves_zero_columns_zero() -> None:
    gen = torch.Generator().manual_seed(1)
    for rank in (1, 2, 4):
        m = orthogonalize_(torch.randn(50, rank, generator=gen, dtype=torch.float64))
        torch.testing.assert_close(m.T @ m, torch.eye(rank, dtype=torch.float64))
    zero = orthogonalize_(torch.zeros(8, 1))
    assert torch.equal(zero, torch.zeros(8, 1))  # PyTorch's hook with epsilon 0 gives NaN here


def test_small_matrices_and_vectors_go_dense_by_pytorchs_rule() -> None:
    compressor = PowerSGDCompressor(rank=4)
    assert compressor.factor_rank(torch.Size([64])) is None
    assert compressor.factor_rank(torch.Size([4, 64])) is None  # (4 + 64) * 4 * 2 = 544 >= 256
    assert compressor.factor_rank(torch.Size([64, 32])) == 4  # 96 * 4 * 2 = 768 < 2048
    assert compressor.factor_rank(torch.Size([8, 2, 3, 3])) is None  # (8 + 18) * 4 * 2 = 208 >= 144
    assert PowerSGDCompressor(rank=1).factor_rank(torch.Size([8, 2, 3, 3])) == 1
    assert isinstance(compressor.compress(torch.ones(4, 64)), DensePayload)
    payload = compressor.compress(torch.ones(64, 32), warm_start=torch.randn(32 * 4))
    assert isinstance(payload, LowRankPayload) and payload.nbytes == (64 + 32) * 4 * 4


#: a unit of mixed tensors: two matrices PowerSGD approximates (one 4-D), a matrix too small to gain, a vector
GROUP_SHAPES = (torch.Size([24, 3, 2, 2]), torch.Size([5]), torch.Size([40, 30]), torch.Size([4, 6]))


def test_a_group_is_its_tensors_compressed_one_by_one_in_one_sum_per_round() -> None:
    """A unit of several parameters gives, bit for bit, what each would give alone: its matrices' P (then Q)
    and its dense tensors share one summand per round, each in its own slice."""
    gen = torch.Generator().manual_seed(5)
    compressor = PowerSGDCompressor(rank=2)
    world = 3
    tensors = [[torch.randn(s, generator=gen, dtype=torch.float64) for s in GROUP_SHAPES] for _ in range(world)]
    q0 = compressor.initial_state(GROUP_SHAPES, torch.float64, torch.device("cpu"), torch.Generator().manual_seed(9))
    # the unit's Q is each matrix's Q drawn in turn from the same stream (the small matrix and the vector get none)
    again = torch.Generator().manual_seed(9)
    alone = [compressor.initial_state((s,), torch.float64, torch.device("cpu"), again) for s in GROUP_SHAPES]
    assert [a is None for a in alone] == [False, True, False, True]
    assert torch.equal(q0, torch.cat([alone[0], alone[2]]))

    group = _two_rounds(compressor, [torch.cat([t.reshape(-1) for t in ts]) for ts in tensors], q0, GROUP_SHAPES)
    *group_means, group_q = group
    offsets = [0]
    for shape in GROUP_SHAPES:
        offsets.append(offsets[-1] + shape.numel())
    for i in range(len(GROUP_SHAPES)):
        span = slice(offsets[i], offsets[i + 1])
        if alone[i] is None:  # summed exactly, no approximation
            expected = [sum(ts[i] for ts in tensors).reshape(-1) / world] * world
        else:
            *expected, q_alone = _two_rounds(compressor, [ts[i] for ts in tensors], alone[i])
            q_span = slice(0, alone[0].numel()) if i == 0 else slice(alone[0].numel(), None)
            assert torch.equal(group_q[q_span], q_alone)
        for mean, reference in zip(group_means, expected, strict=True):
            torch.testing.assert_close(mean[span], reference, rtol=0, atol=1e-15)

    # bytes: (n + m) r per matrix, plus the dense tensors' values; what reached the average: the shared
    # estimate for the matrices, the whole local tensor for the dense ones (their error feedback stays 0)
    x = torch.cat([t.reshape(-1) for t in tensors[0]])
    payload = compressor.compress(x, warm_start=q0.clone(), shapes=GROUP_SHAPES)
    assert payload.nbytes == 8 * ((24 + 12) * 2 + 5 + (40 + 30) * 2 + 24)
    payload.mean = torch.zeros(x.numel(), dtype=torch.float64)
    sent = compressor.decompress(payload)
    dense = torch.zeros(x.numel(), dtype=torch.bool)
    dense[offsets[1] : offsets[2]] = dense[offsets[3] : offsets[4]] = True
    assert torch.equal(sent[dense], x[dense]) and not sent[~dense].any()


def test_a_group_refuses_shapes_or_warm_starts_that_do_not_fit() -> None:
    compressor = PowerSGDCompressor(rank=2)
    with pytest.raises(ValueError, match="do not add up to the 100 elements of x"):
        compressor.compress(torch.ones(100), warm_start=torch.ones(4), shapes=GROUP_SHAPES)
    with pytest.raises(ValueError, match=r"needs the unit's warm start Q \(84 values for shapes"):  # (12 + 30) * 2
        compressor.compress(torch.ones(1517), warm_start=torch.ones(83), shapes=GROUP_SHAPES)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"rank": 0}, r"rank must be an integer >= 1 \(the approximation rank r\), got 0"),
        ({"rank": 2.0}, r"rank must be an integer >= 1 \(the approximation rank r\), got 2.0"),
        ({"min_compression_rate": 0.5}, "min_compression_rate must be a finite number >= 1, got 0.5"),
        ({"epsilon": -1e-8}, "epsilon must be a finite number >= 0, got -1e-08"),
    ],
)
def test_bad_arguments_are_refused_by_name(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        GradCompStrategy(compressor="powersgd", compressor_kwargs=kwargs)


def test_the_preset_and_what_it_refuses() -> None:
    description, params = NAMED_STRATEGIES["ddp_powersgd"]
    assert params["compressor"] == "powersgd" and params["compressor_kwargs"] == {"rank": 4}
    # dense while Accordion sees a critical regime (the first 100 steps at least), not a fixed number of steps
    assert params["adaptive"] == "accordion" and "warmup_steps" not in params and "critical regimes" in description
    assert GradCompStrategy(**params).schedule.critical_density is None
    for aggregator in ("allgather", "gtopk"):
        with pytest.raises(ValueError, match=f"aggregator='{aggregator}' gathers each rank's payload bytes"):
            GradCompStrategy(compressor="powersgd", aggregator=aggregator)
    assert params["granularity"] == "group"  # a group's matrices share their two allreduces
    for granularity in ("layer", "group", "model"):  # told the parameters' shapes, any unit is its matrices
        assert GradCompStrategy(compressor="powersgd", granularity=granularity).granularity == granularity
    with pytest.raises(ValueError, match="drops the rest of the spectrum"):
        GradCompStrategy(compressor="powersgd", memory="diana")


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Flatten(), nn.Linear(288, 32), nn.ReLU(), nn.Linear(32, 10))


def _batches(rank: int, world_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1000 + rank)
    return [(torch.randn(8, 3, 8, 8, generator=gen), torch.randint(0, 10, (8,), generator=gen)) for _ in range(STEPS)]


def _train(ddp: DistributedDataParallel, model: nn.Module, rank: int, world_size: int) -> list[dict]:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    weights = []
    for x, y in _batches(rank, world_size):
        optimizer.zero_grad()
        nn.functional.cross_entropy(ddp(x), y).backward()
        optimizer.step()
        weights.append({k: v.clone() for k, v in model.state_dict().items()})
    return weights


def _initial_qs(hook: GradCompHook) -> dict[str, torch.Tensor]:
    """Each parameter's initial Q (flat) as our hook draws it: its unit's draw, split by matrix."""
    qs = {}
    for unit in hook.units:
        q = hook.compressor.initial_state(
            unit.shapes, torch.float32, torch.device("cpu"), hook.streams.shared(None, unit.key)
        )
        sizes = [s.numel() // s[0] * (hook.compressor.factor_rank(s) or 0) for s in unit.shapes]
        for name, part in zip(unit.names, q.split(sizes) if q is not None else [None] * len(sizes), strict=True):
            if part is not None and part.numel():
                qs[name] = part
    return qs


def _ours_and_torchs(rank: int, world_size: int, approximation_rank: int, granularity: str) -> dict:
    ours_model = _model()
    hook = GradCompHook(
        PowerSGDCompressor(rank=approximation_rank),
        _Recording(),
        "allreduce",
        list(ours_model.named_parameters()),
        granularity=granularity,
        warmup_steps=START,
        min_compress_numel=0,
    )
    initial = _initial_qs(hook)
    ddp = DistributedDataParallel(ours_model, bucket_cap_mb=0.01)  # several buckets, rebuilt after step 1
    ddp.register_comm_hook(hook, gradcomp_comm_hook)
    ours = _train(ddp, ours_model, rank, world_size)

    # PyTorch's hook, started from the same Q as ours (our draws, laid out in its bucket)
    torch_model = _model()
    names = {id(p): name for name, p in torch_model.named_parameters()}
    state = torch_powersgd.PowerSGDState(
        None, matrix_approximation_rank=approximation_rank, start_powerSGD_iter=START, min_compression_rate=2
    )

    def seeded(state: torch_powersgd.PowerSGDState, bucket):
        if state.iter >= START and bucket.index() not in state.q_memory_dict:
            qs = [initial[names[id(p)]] for p in bucket.parameters() if names[id(p)] in initial]
            ps = sum(p.shape[0] * (hook.compressor.factor_rank(p.shape) or 0) for p in bucket.parameters())
            state.p_memory_dict[bucket.index()] = torch.empty(ps)
            state.q_memory_dict[bucket.index()] = torch.cat(qs)
        future = torch_powersgd.powerSGD_hook(state, bucket)
        future.wait()
        return future

    torch_ddp = DistributedDataParallel(torch_model, bucket_cap_mb=100)
    torch_ddp.register_comm_hook(state, seeded)
    theirs = _train(torch_ddp, torch_model, rank, world_size)
    return {"ours": ours, "theirs": theirs, "log": hook.memory.log, "history": list(hook.history)}


def _vs_torch(rank: int, world_size: int) -> dict:
    return {(r, g): _ours_and_torchs(rank, world_size, r, g) for r in (1, 4) for g in ("layer", "group")}


@pytest.mark.parametrize("world_size", [2, 3])
def test_on_real_ranks_matches_pytorchs_hook_keeps_error_feedback_exact_and_ranks_agree(world_size: int) -> None:
    results = run_ranks(_vs_torch, world_size)
    for (approximation_rank, granularity), _ in results[0].items():
        runs = [r[approximation_rank, granularity] for r in results]
        for run in runs:
            for step, (ours, theirs) in enumerate(zip(run["ours"], run["theirs"], strict=True)):
                for name in ours:
                    torch.testing.assert_close(ours[name], theirs[name], rtol=1e-5, atol=1e-6, msg=f"{name} at {step}")
            assert {e["name"] for e in run["log"]} == {name for name in run["ours"][0]}  # min_compress_numel=0
            for e in run["log"]:
                old = torch.zeros_like(e["grad"]) if e["old"] is None else e["old"]
                assert torch.equal(e["acc"], e["grad"] + old)
                assert torch.equal(e["new"], e["acc"] - e["sent"])  # residual against the shared estimate
            # rank 1: P and Q of 0.weight (8 x 27), 3.weight (32 x 288), 5.weight (10 x 32), biases dense (50);
            # rank 4: only 3.weight gains enough ((n + m) 4 * 2 < n m), the rest goes dense
            floats = 35 + 320 + 42 + 50 if approximation_rank == 1 else 216 + 320 * 4 + 320 + 50
            assert [s.payload_bytes for s in run["history"]] == [0] * START + [4 * floats] * (STEPS - START)
            # a group (one unit here, the cap is 25 MiB) sums its P's in one allreduce and its Q's in another;
            # layer by layer each matrix takes two and each dense tensor one
            collectives = 2 if granularity == "group" else (9 if approximation_rank == 1 else 7)
            assert [s.collectives for s in run["history"]][START:] == [collectives] * (STEPS - START)
        for run in runs[1:]:
            for name, value in run["ours"][-1].items():
                assert torch.equal(value, runs[0]["ours"][-1][name]), name
