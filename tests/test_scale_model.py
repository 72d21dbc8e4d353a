"""benchmarks/scale_model.py: the alpha-beta cost model's terms, its link fit and its crossovers, by hand."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

from scale_model import (  # noqa: E402
    Cluster,
    Costs,
    Link,
    crossovers,
    fit_link,
    hsdp_payload_bytes_per_element,
    overtakes,
    predict_hsdp_step,
    predict_step,
)

D = 1_000_000  # parameters
SLOW = Link(alpha_s=1e-3, bytes_per_s=1e6)
FAST = Link(alpha_s=1e-5, bytes_per_s=1e9)


def _costs(aggregator: str, bytes_per_element: float, **kwargs) -> Costs:
    fields = {"params": D, "forward_backward_s": 0.5, "codec_s": 0.2, "decode_s": 0.01, "merge_s": 0.03,
              "aggregator": aggregator, "payload_bytes_per_element": bytes_per_element, "compressed_fraction": 1.0,
              "units": 3} | kwargs  # fmt: skip
    return Costs(**fields)


def test_dense_ring_allreduce_sends_2_p_minus_1_over_p_of_the_gradient_through_each_link() -> None:
    cluster = Cluster(nodes=4, per_node=2, inter=SLOW, intra=FAST)
    step = predict_step(_costs("allreduce", 4.0, codec_s=0.0), cluster, hierarchical=False)
    assert step.inter_s == pytest.approx(2 * 7 * SLOW.alpha_s + 2 * 7 / 8 * 4 * D / SLOW.bytes_per_s)
    assert step.intra_s == 0.0
    assert step.compute_s == pytest.approx(0.5)


def test_allgather_link_bytes_grow_with_ranks_flat_and_with_nodes_hierarchical() -> None:
    cluster = Cluster(nodes=4, per_node=2, inter=SLOW, intra=FAST, share=2.0)
    payload = 0.008 * D
    flat = predict_step(_costs("allgather", 0.008), cluster, hierarchical=False)
    assert flat.inter_s == pytest.approx(7 * SLOW.alpha_s + 7 * payload / SLOW.bytes_per_s)
    # every other rank's payload decoded, all on a core shared by two ranks
    assert flat.compute_s == pytest.approx(2.0 * (0.5 + 0.2 + 7 * 0.01))
    node = predict_step(_costs("allgather", 0.008), cluster, hierarchical=True)
    assert node.inter_s == pytest.approx(3 * SLOW.alpha_s + 3 * payload / SLOW.bytes_per_s)
    # two dense allreduces in the node (one per unit for the sum, one to share), each 2 (L-1)/L of 4d
    assert node.intra_s == pytest.approx(4 * 2 * FAST.alpha_s + 2 * 4 * D / FAST.bytes_per_s)
    assert node.compute_s == pytest.approx(2.0 * (0.5 + 0.2 / 2 + 3 * 0.01 / 2))


def test_gtopk_crosses_the_link_in_log2_nodes_rounds_with_every_local_rank_flat_and_one_shard_each_sharded() -> None:
    cluster = Cluster(nodes=8, per_node=4, inter=SLOW, intra=FAST)
    payload = 0.008 * D
    flat = predict_step(_costs("gtopk", 0.008), cluster, hierarchical=False)
    assert flat.inter_s == pytest.approx(3 * SLOW.alpha_s + 3 * 4 * payload / SLOW.bytes_per_s)
    assert flat.intra_s == pytest.approx(2 * FAST.alpha_s + 2 * payload / FAST.bytes_per_s)
    assert flat.compute_s == pytest.approx(0.5 + 0.2 + math.log2(32) * 0.03)
    node = predict_step(_costs("gtopk", 0.008), cluster, hierarchical=True)
    assert node.inter_s == pytest.approx(3 * SLOW.alpha_s + 3 * payload / SLOW.bytes_per_s)


def test_auto_takes_the_compressors_path_for_the_number_of_peers() -> None:
    auto = {8: ("allgather", 0.25), 16: ("allreduce", 1.0), 128: ("allreduce", 4.0)}
    costs = _costs("auto", 0.25, auto=auto)
    assert costs.path(4) == ("allgather", 0.25)
    assert costs.path(9) == ("allreduce", 1.0)
    assert costs.path(2048) == ("allreduce", 4.0)
    cluster = Cluster(nodes=32, per_node=1, inter=SLOW, intra=FAST)
    step = predict_step(costs, cluster, hierarchical=False)
    assert step.inter_s == pytest.approx(2 * 31 * SLOW.alpha_s + 2 * 31 / 32 * 4.0 * D / SLOW.bytes_per_s)


def test_a_single_node_under_hierarchy_is_the_dense_allreduce() -> None:
    cluster = Cluster(nodes=1, per_node=8, inter=SLOW, intra=FAST)
    node = predict_step(_costs("allgather", 0.008), cluster, hierarchical=True)
    dense = predict_step(_costs("allreduce", 4.0, codec_s=0.0), cluster, hierarchical=False)
    assert node == dense
    assert node.intra_s == pytest.approx(14 * FAST.alpha_s + 2 * 7 / 8 * 4 * D / FAST.bytes_per_s)


def test_fit_link_takes_beta_from_the_largest_messages_and_alpha_from_the_smallest() -> None:
    alpha, beta = 2e-4, 5e7
    times = {n: alpha + n / beta for n in (1 << 10, 1 << 14, 1 << 20, 1 << 23)}
    times[1 << 14] = 1e-5  # a burst that passed faster than the link: must not bend the fit
    link = fit_link(times)
    assert link.bytes_per_s == pytest.approx(beta)
    assert link.alpha_s == pytest.approx(alpha)


def test_overtakes_names_the_first_rank_count_from_which_the_challenger_stays_ahead() -> None:
    def row(method: str, ranks: int, seconds: float) -> dict:
        return {"params": 1.0, "rate": "10gbit", "method": method, "ranks": ranks, "seconds_per_step": seconds}

    steps = {"ddp_topk": [1.0, 1.0, 2.0, 4.0], "ddp_gtopk": [0.9, 1.5, 1.8, 2.0]}
    rows = [row(m, 8 * 2**i, s) for m, series in steps.items() for i, s in enumerate(series)]
    for method in ("ddp_topk:node", "ddp_gtopk:node"):
        rows += [row(method, 8 * 2**i, 9.0) for i in range(4)]
    found = {(o["challenger"], o["incumbent"]): o["from_ranks"] for o in overtakes(rows)}
    assert found[("ddp_gtopk", "ddp_topk")] == 32  # ahead at 8, behind at 16, ahead for good from 32
    assert found[("ddp_topk:node", "ddp_topk")] is None


def test_crossovers_give_the_first_run_of_rank_counts_where_a_method_beats_dense() -> None:
    speedups = [0.9, 1.2, 1.5, 0.8, 1.1]
    rows = [{"params": 1.0, "rate": "10gbit", "method": "ddp_topk", "ranks": 8 * 2**i, "speedup_vs_dense": x}
            for i, x in enumerate(speedups)]  # fmt: skip
    (found,) = crossovers(rows)
    assert (found["faster_from"], found["faster_until"]) == (16, 32)  # not 16-128: it loses at 64
    assert (found["best_speedup"], found["best_at"]) == (1.5, 32)


def test_diloco_spreads_its_exchange_and_the_synchronisations_computation_over_h_inner_steps() -> None:
    cluster = Cluster(nodes=4, per_node=2, inter=SLOW, intra=FAST, share=2.0)
    every_step = predict_step(_costs("allgather", 0.02), cluster, hierarchical=False)
    every_ten = predict_step(_costs("allgather", 0.02, sync_every=10), cluster, hierarchical=False)
    assert every_ten.inter_s == pytest.approx(every_step.inter_s / 10)
    assert every_ten.intra_s == pytest.approx(every_step.intra_s / 10)
    # the inner steps' forward/backward stays whole; compressing, decoding (7 other ranks' payloads) spread
    assert every_ten.compute_s == pytest.approx(2.0 * (0.5 + (0.2 + 7 * 0.01) / 10))


def test_hsdp_gathers_inside_the_node_and_exchanges_each_ranks_shard_with_its_replicas() -> None:
    cluster = Cluster(nodes=4, per_node=2, inter=SLOW, intra=FAST)
    dense = predict_hsdp_step(_costs("allreduce", 4.0, codec_s=0.0), False, cluster, units=3)
    # two all-gathers (forward, backward) and a reduce-scatter of (L-1)/L of 4d each, (L-1) messages per unit each
    assert dense.intra_s == pytest.approx(3 * 3 * FAST.alpha_s + 3 * 1 / 2 * 4 * D / FAST.bytes_per_s)
    # the node's L rings of d/L side by side: a ring allreduce of 4d through its link, one per unit
    assert dense.inter_s == pytest.approx(3 * 2 * 3 * SLOW.alpha_s + 2 * 3 / 4 * 4 * D / SLOW.bytes_per_s)
    assert dense.compute_s == pytest.approx(0.5)
    topk = predict_hsdp_step(_costs("allgather", 0.03), True, cluster, units=3)
    assert topk.intra_s == dense.intra_s
    assert topk.inter_s == pytest.approx(3 * 3 * SLOW.alpha_s + 3 * 0.03 * D / SLOW.bytes_per_s)
    # each rank compresses its shard (1/L of the model) and decodes its N - 1 replicas' payloads of it
    assert topk.compute_s == pytest.approx(0.5 + (0.2 + 3 * 0.01) / 2)
    alone = predict_hsdp_step(_costs("allgather", 0.03), True, Cluster(1, 8, SLOW, FAST), units=3)
    assert alone.inter_s == 0.0 and alone.compute_s == pytest.approx(0.5)


def test_the_hsdp_topk_payload_is_one_percent_at_about_three_bytes_an_entry() -> None:
    per_entry = hsdp_payload_bytes_per_element(100_000) / 0.01
    assert 2.0 < per_entry < 4.0  # a bfloat16 value and an Elias-Fano index entry of about a byte
