"""Seconds per step past what this machine can run: a cost model for P = 8 to 1024 ranks, validated here.

A step costs its computation plus its exchange, in the alpha-beta (Hockney) model of each link:

    step = share * (forward/backward + compression + decoding) + sum over links (messages * alpha + bytes / beta)

* **Computation** is measured on this machine (``measure``): one process, one thread, the model in
  ``DistributedDataParallel`` with the method's real hook in a world of one, at several model sizes (the
  per-element cost of compression grows once a model leaves the cache, so the largest measured size's
  per-element cost is carried to larger models). The decoding of each further payload an allgather
  brings (``accumulate``) and each gTop-k merge are timed on their own. ``share`` is how many ranks share
  a core (2 for 4 ranks on this 2-core machine; 1 on a GPU cluster).
* **Bytes** per rank come from ``StepStats`` of the measured run (bytes per compressed element, the share
  of elements compressed); how many cross a node's link follows from the collective's algorithm with the
  node's ``L`` ranks contiguous: a ring allreduce of ``B`` bytes sends ``2 (P - 1) / P * B`` through each
  link in ``2 (P - 1)`` messages; a ring allgather of ``B`` per rank ``(P - 1) B`` in ``P - 1``; gTop-k's
  butterfly (Shi et al., ICDCS 2019, Sec. IV) ``log2(P)`` rounds of ``B``, of which the last ``log2(N)``
  cross the link with all ``L`` ranks of the node at once. ``hierarchy="node"`` (sharded) adds a dense
  allreduce inside the node (the node's sum, one per unit) and another after the exchange (each unit's
  owner shares its estimate), ``2 * 2 (L - 1) / L * 4d`` bytes, and runs the method among
  ``N`` nodes on shards of ``d / L``: a link then carries ``(N - 1) B`` for an allgather, ``log2(N) B``
  for gTop-k.
* **Links** on this machine are measured (``calibrate``), in the layout and under the load of the runs
  they are compared with: every rank sends 1 KB to 8 MB along a ring that changes node at every hop
  while it receives (a ring step's traffic, both directions at once), through the shaped veth links
  between namespaces (``tc tbf``, as ``network.py`` builds them), then to its partner inside its node
  over the node's loopback. beta comes from the two largest messages, alpha from the smallest (see
  :func:`fit_link`). On a cluster (``predict``) they are parameters: 8 GPUs a node on NVLink-class
  links (300 GB/s, 5 us), nodes on 10, 25 or 100 Gbit/s at 95.6% of the line rate (1448 payload bytes
  per 1514-byte Ethernet frame), 10 us.

**DiLoCo** (``ddp_diloco*``, ``--sync-every H``) exchanges a pseudo-gradient once every ``H`` inner steps: its
exchange (link, loopback, and the synchronisation's own computation: compressing, decoding, the outer step, timed
in a world of one by ``measure-diloco``) is divided by ``H``; its inner steps cost the forward/backward alone.

**HSDP** (``hsdp``: FSDP2's own; ``hsdp_topk``: ``ReplicaExchange`` with the ``ddp_topk`` preset's measured codec
costs and bytes per element) shards each unit over a node's ``L`` ranks: inside the node FSDP2 all-gathers every
unit's parameters before its forward and again before its backward and reduce-scatters its gradients, ``3 (L - 1) / L
* 4d`` bytes in ``(L - 1)`` messages per unit and collective; between the nodes each rank exchanges its shard of
``d / L`` with its ``N - 1`` replicas, one collective per unit, the node's ``L`` rings side by side through its link
(dense: ``2 (N - 1) / N * 4d`` bytes a link; Top-k: ``(N - 1)`` payloads of the whole model's ``d``); the Top-k
shard costs ``1 / L`` of the model's compression and decoding.

The model counts no overlap of the exchange with the backward pass, no congestion beyond a node's link,
and rings only (NCCL switches to trees at scale, which shortens dense allreduce's ``2 (P - 1)`` latency
terms); ``validate`` shows how far it is from this machine's measured steps.

    python benchmarks/scale_model.py measure --json benchmarks/results/scale_profile.json
    sudo python benchmarks/scale_model.py calibrate --json benchmarks/results/scale_links.json
    python benchmarks/scale_model.py validate --profile benchmarks/results/scale_profile.json \\
        --links benchmarks/results/scale_links.json \\
        --measured benchmarks/results/network_mlp_2x2.json benchmarks/results/network_mnist_mlp_4x1.json
    python benchmarks/scale_model.py measure-diloco --profile benchmarks/results/scale_profile.json
    python benchmarks/scale_model.py predict --profile benchmarks/results/scale_profile.json \\
        --plot benchmarks/results/scale_model.png --json benchmarks/results/scale_model.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from datetime import timedelta
from functools import cache, partial
from pathlib import Path
from typing import Any

from methods import AFTER_WARMUPS, attach, strategy_arguments
from workloads import build_model

#: the methods the model predicts, as ``network.py`` names them; ``:node`` is ``hierarchy="node"`` (sharded)
METHODS = ("dense", "ddp_fp16", "ddp_topk", "ddp_gtopk", "ddp_terngrad")
HIERARCHICAL = ("ddp_gradcomp_dense:node", "ddp_topk:node", "ddp_gtopk:node", "ddp_terngrad:node")
#: DiLoCo's presets, predicted at each ``--sync-every`` (``ddp_diloco_topk:H100``)
DILOCO = ("ddp_diloco", "ddp_diloco_topk", "ddp_diloco_qsgd")
#: HSDP's methods (``network.py``'s names): FSDP2's own, and the replica exchange with Top-k
HSDP = ("hsdp", "hsdp_topk")
#: the measured method whose codec costs ``hsdp_topk`` takes (a Top-k with error feedback); its bytes per element are
#: its own preset's payload's (:func:`hsdp_payload_bytes_per_element`)
HSDP_CODEC = "ddp_topk"
#: FSDP units of the measured MLPs as ``network.py`` shards them: their three Linear layers (the root holds none);
#: ``predict --hsdp-units`` sets the predicted model's
HSDP_UNITS = 3
#: ``(label, model, width)`` of the sizes ``measure`` times: the validation runs' models, then larger MLPs
SIZES = (("mlp-512", "mlp", 512), ("mnist-mlp", "mnist-mlp", 512), ("mlp-1536", "mlp", 1536), ("mlp-4096", "mlp", 4096))
ETHERNET_EFFICIENCY = 1448 / 1514
MESSAGE_SIZES = (1 << 10, 1 << 14, 1 << 18, 1 << 21, 1 << 23)


@dataclass(frozen=True)
class Link:
    """One link in the alpha-beta model: ``seconds(n bytes, m messages) = m * alpha + n / bytes_per_s``."""

    alpha_s: float
    bytes_per_s: float

    def seconds(self, nbytes: float, messages: float) -> float:
        return messages * self.alpha_s + nbytes / self.bytes_per_s


@dataclass(frozen=True)
class Cluster:
    """``nodes`` x ``per_node`` ranks; ``share`` ranks per core for the computation (1: a device each)."""

    nodes: int
    per_node: int
    inter: Link
    intra: Link
    share: float = 1.0

    @property
    def ranks(self) -> int:
        return self.nodes * self.per_node


@dataclass(frozen=True)
class Costs:
    """One method's measured costs for a model of ``params`` parameters (seconds per step, bytes per element)."""

    params: float
    forward_backward_s: float
    codec_s: float
    decode_s: float
    merge_s: float
    aggregator: str
    payload_bytes_per_element: float
    compressed_fraction: float
    #: units (tensors or groups the hook compresses apart): the node's sum is one allreduce per unit
    units: int = 1
    #: for ``aggregator="auto"``: ``{ranks: (aggregator, bytes per element)}``, what the compressor picks for
    #: each power-of-two number of peers (TernGrad: allgather of 2-bit codes up to 8, int8 allreduce beyond)
    auto: dict[int, tuple[str, float]] | None = None
    #: inner steps per exchange (DiLoCo's ``H``; 1: every step exchanges), over which the exchange is spread
    sync_every: int = 1

    def path(self, peers: int) -> tuple[str, float]:
        """The aggregator among ``peers`` ranks and the bytes per compressed element it moves."""
        if self.auto is None:
            return self.aggregator, self.payload_bytes_per_element
        return self.auto[min((p for p in self.auto if p >= peers), default=max(self.auto))]


@dataclass(frozen=True)
class Prediction:
    compute_s: float
    intra_s: float
    inter_s: float

    @property
    def total_s(self) -> float:
        return self.compute_s + self.intra_s + self.inter_s


def predict_step(costs: Costs, cluster: Cluster, hierarchical: bool) -> Prediction:
    """Seconds per step of one method on ``cluster`` (see the module docstring for each term)."""
    n, local, p = cluster.nodes, cluster.per_node, cluster.ranks
    if hierarchical and n == 1:
        # hierarchy="node" on a single node is DDP's dense allreduce (the hook says so and steps aside)
        hierarchical = False
        costs = replace(costs, codec_s=0.0, decode_s=0.0, merge_s=0.0, aggregator="allreduce",
                        payload_bytes_per_element=4.0, compressed_fraction=1.0, auto=None)  # fmt: skip
    d = costs.params
    dense_rest = 4.0 * (1.0 - costs.compressed_fraction) * d
    intra = cluster.intra
    crossing_rounds = math.log2(n) if n > 1 else 0.0
    if hierarchical:
        # two dense allreduces inside the node (the sum, one per unit; the owners' estimates shared, one in all);
        # the method among the nodes on 1/L of the units
        allreduces = costs.units + 1
        intra_s = intra.seconds(2 * 2 * (local - 1) / local * 4.0 * d, allreduces * 2 * (local - 1))
        codec_s, peers, shard, inside_rounds = costs.codec_s / local, n, 1.0 / local, 0.0
    else:
        intra_s, codec_s, peers, shard, inside_rounds = 0.0, costs.codec_s, p, 1.0, math.log2(local)
    aggregator, bytes_per_element = costs.path(peers)
    payload = bytes_per_element * costs.compressed_fraction * d
    # bytes through one node's link (each direction) and messages, or through the loopback for one node
    link = cluster.inter if n > 1 else intra
    dense_bytes = 2 * (peers - 1) / peers * dense_rest
    dense_messages = 2 * (peers - 1) if dense_rest else 0
    decode_s = 0.0
    if aggregator == "allreduce":
        link_s = link.seconds(2 * (peers - 1) / peers * (payload + dense_rest), 2 * (peers - 1))
    elif aggregator == "allgather":
        link_s = link.seconds((peers - 1) * payload + dense_bytes, (peers - 1) + dense_messages)
        decode_s = (peers - 1) * costs.decode_s * shard
    elif aggregator == "gtopk":
        # every rank of a node crosses the link in the same round: L payloads of 1/L of the units (sharded) or
        # L full payloads (flat); the flat butterfly's first log2(L) rounds stay inside the node
        per_round = payload if hierarchical else local * payload
        link_s = link.seconds(crossing_rounds * per_round + dense_bytes, crossing_rounds + dense_messages)
        intra_s += intra.seconds(inside_rounds * payload, inside_rounds)
        decode_s = (crossing_rounds + inside_rounds) * costs.merge_s * shard
    else:
        raise ValueError(f"aggregator={aggregator!r}: the model knows allreduce, allgather and gtopk")
    h = costs.sync_every  # one exchange (and its computation) every h inner steps
    compute_s = cluster.share * (costs.forward_backward_s + (codec_s + decode_s) / h)
    intra_s, link_s = intra_s / h, link_s / h
    return Prediction(compute_s, intra_s, link_s) if n > 1 else Prediction(compute_s, intra_s + link_s, 0.0)


def predict_hsdp_step(costs: Costs, compressed: bool, cluster: Cluster, units: int = HSDP_UNITS) -> Prediction:
    """Seconds per step of HSDP on ``cluster``: FSDP2 inside each node, each rank's gradient shard averaged with its
    replicas on the other nodes densely (FSDP2's own) or through ``costs``' compressor (see the module docstring)."""
    n, local, d = cluster.nodes, cluster.per_node, costs.params
    intra_s = cluster.intra.seconds(3 * (local - 1) / local * 4.0 * d, 3 * units * (local - 1)) if local > 1 else 0.0
    codec_s, link_s = 0.0, 0.0
    if n > 1 and not compressed:
        link_s = cluster.inter.seconds(2 * (n - 1) / n * 4.0 * d, 2 * (n - 1) * units)
    elif n > 1:
        aggregator, bytes_per_element = costs.path(n)
        if aggregator != "allgather":
            raise ValueError(f"aggregator={aggregator!r}: the HSDP model knows the Top-k allgather")
        link_s = cluster.inter.seconds((n - 1) * bytes_per_element * d, (n - 1) * units)
        codec_s = (costs.codec_s + (n - 1) * costs.decode_s) / local
    return Prediction(cluster.share * (costs.forward_backward_s + codec_s), intra_s, link_s)


@cache
def hsdp_payload_bytes_per_element(numel: int = 1 << 20) -> float:
    """Bytes per element of the ``hsdp_topk`` preset's payload for a shard of ``numel`` elements, from a real payload
    (its compressor on a random shard: Top-k's count is fixed, so the size does not depend on the values)."""
    import torch

    from lightning_gradcomp.core.pipeline_arguments import build_pipeline
    from lightning_gradcomp.hsdp import HSDP_PRESETS

    arguments = HSDP_PRESETS["hsdp_topk"][1]
    codec, _ = build_pipeline(arguments["compressor"], None, arguments["density"], arguments["wire_precision"],
                              arguments["memory"], None, arguments["aggregator"])  # fmt: skip
    payload = codec.compress(torch.randn(numel, generator=torch.Generator().manual_seed(0)), torch.Generator())
    return payload.nbytes / numel


def hsdp_costs(method: str, costs_of: Any) -> tuple[Costs, bool]:
    """The costs an HSDP method is predicted from (``costs_of(measured method)``) and whether it compresses."""
    if method != "hsdp_topk":
        return costs_of("dense"), False
    bytes_per_element = hsdp_payload_bytes_per_element()
    return replace(costs_of(HSDP_CODEC), aggregator="allgather", payload_bytes_per_element=bytes_per_element,
                   auto=None), True  # fmt: skip


def costs_at(profile: dict[str, Any], method: str, params: float, scale: float = 1.0) -> Costs:
    """``method``'s costs for ``params`` parameters: per-element times interpolated in log(size) between the
    measured MLPs, the nearest measured size's carried beyond them; times multiplied by ``scale``."""
    sizes = sorted((s for s in profile["sizes"].values() if s["model"] == "mlp"), key=lambda s: s["params"])

    def per_element(key: str, entry: str | None = None) -> float:
        points = [(math.log(s["params"]), (s["methods"][method] if entry else s)[key] / s["params"]) for s in sizes]
        x = min(max(math.log(params), points[0][0]), points[-1][0])
        for (x0, y0), (x1, y1) in itertools.pairwise(points):
            if x0 <= x <= x1:
                return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
        return points[0][1]

    largest = sizes[-1]["methods"][method]
    return Costs(
        params=params,
        forward_backward_s=scale * params * per_element("forward_backward_s"),
        codec_s=scale * params * per_element("codec_s", method),
        decode_s=scale * params * per_element("decode_s", method),
        merge_s=scale * params * per_element("merge_s", method),
        aggregator=largest["aggregator"],
        payload_bytes_per_element=largest["payload_bytes_per_element"],
        compressed_fraction=1.0,
        units=largest["units"],
        auto=_auto(largest),
    )


def _auto(method: dict[str, Any]) -> dict[int, tuple[str, float]] | None:
    return {int(p): (a, b) for p, (a, b) in method["auto"].items()} if "auto" in method else None


def profiled_method(method: str) -> tuple[str, bool]:
    """The measured method a ``network.py`` method name stands for, and whether it is ``hierarchy="node"``
    (``ddp_diloco_topk:H100``: the DiLoCo preset, synchronising every 100 steps)."""
    base, _, scheme = method.partition(":")
    return base, scheme == "node"


def measured_costs(size: dict[str, Any], method: str) -> Costs:
    """``method``'s costs for one measured model, as measured (no interpolation)."""
    m = size["methods"][method]
    return Costs(size["params"], size["forward_backward_s"], m["codec_s"], m["decode_s"], m["merge_s"],
                 m["aggregator"], m["payload_bytes_per_element"], m["compressed_fraction"], m["units"],
                 _auto(m))  # fmt: skip


# --- measure: computation and bytes on this machine -------------------------------------------------------------


def _median_step_seconds(ddp, optimizer, batches, warmup: int = 3) -> float:
    from torch import nn

    times = []
    for i, (x, y) in enumerate(batches):
        start = time.perf_counter()
        optimizer.zero_grad()
        nn.functional.cross_entropy(ddp(x), y).backward()
        optimizer.step()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def _median_seconds(fn, repeats: int = 7) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_size(model_name: str, width: int, steps: int, batch: int, rounds: int) -> dict[str, Any]:
    """Forward/backward and each method's compression, decoding and bytes for one model, in a world of one.

    The methods take turns, ``rounds`` times ``steps`` steps each, and each keeps the median of its rounds'
    median step: a slow minute of the machine then falls on all methods, not on one.
    """
    import torch
    from torch.nn.parallel import DistributedDataParallel
    from workloads import MODELS

    from lightning_gradcomp.core.comm.gtopk import canonical, merge

    shape = MODELS[model_name][1]
    gen = torch.Generator().manual_seed(0)
    batches = [(torch.randn(batch, *shape, generator=gen), torch.randint(0, 10, (batch,), generator=gen))
               for _ in range(steps + 3)]  # fmt: skip
    out: dict[str, Any] = {"model": model_name, "width": width, "methods": {}}
    runs = {}
    for method in ("dense", *METHODS[1:], "ddp_gradcomp_dense"):
        torch.manual_seed(0)
        model = build_model(model_name, width)
        ddp = DistributedDataParallel(model)
        hook = attach(method, ddp, model, overrides=AFTER_WARMUPS)
        runs[method] = (model, ddp, hook, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9), [])
    for _ in range(rounds):
        for _, ddp, _, optimizer, seconds in runs.values():
            seconds.append(_median_step_seconds(ddp, optimizer, batches))
    dense_s = statistics.median(runs["dense"][4])
    for method, (model, _, hook, _, rounds_s) in runs.items():
        seconds = statistics.median(rounds_s)
        print(f"{model_name} {width}: {method} {seconds * 1e3:.1f} ms/step", file=sys.stderr, flush=True)
        if hook is None:
            out["params"] = sum(p.numel() for p in model.parameters())
            out["forward_backward_s"] = seconds
            out["methods"][method] = {"aggregator": "allreduce", "codec_s": 0.0, "decode_s": 0.0, "merge_s": 0.0,
                                      "payload_bytes_per_element": 4.0, "compressed_fraction": 1.0,
                                      "units": 1}  # fmt: skip
            continue
        stats = [s for s in hook.history if not s.warmup][-1]
        compressed, dense_per_element = stats.numel_compressed, stats.dense_bytes / stats.numel
        x = torch.randn(compressed or stats.numel, generator=gen)
        payload = hook.compressor.compress(x)
        total = torch.zeros_like(x)
        decode_s = _median_seconds(lambda c=hook.compressor, p=payload, t=total: c.accumulate(p, t))
        merge_s = 0.0
        aggregator = strategy_arguments(method)["aggregator"]
        if aggregator == "gtopk":
            k = stats.selected
            a = canonical(torch.randperm(x.numel(), generator=gen)[:k], torch.randn(k, generator=gen))
            b = canonical(torch.randperm(x.numel(), generator=gen)[:k], torch.randn(k, generator=gen))
            merge_s = _median_seconds(lambda a=a, b=b, k=k: merge(a, b, k))
        entry = out["methods"][method] = {
            "aggregator": aggregator,
            "codec_s": max(0.0, seconds - dense_s),
            "decode_s": decode_s,
            "merge_s": merge_s,
            # a dense hook (identity) compresses nothing: everything travels at its dense size
            "payload_bytes_per_element": stats.payload_bytes / compressed if compressed else dense_per_element,
            "compressed_fraction": compressed / stats.numel if compressed else 1.0,
            "bytes_sent": stats.bytes_sent,
            "collectives": stats.collectives,
            "units": len(hook.units),
        }
        if aggregator == "auto":
            # what the compressor picks at each world size, and the bytes per element of that path
            shared = hook.compressor.compress(x, scale=hook.compressor.local_scale(x))
            entry["auto"] = {}
            for peers in (2**i for i in range(1, 11)):
                choice = hook.compressor.preferred_aggregator(peers)
                per_element = (
                    entry["payload_bytes_per_element"]
                    if choice == "allgather"
                    else hook.compressor.summable(shared, peers).element_size()
                )
                entry["auto"][peers] = (choice, per_element)
    return out


def measure(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=0, world_size=1,
                                timeout=timedelta(seconds=300))  # fmt: skip
        try:
            sizes = {label: measure_size(model, width, args.steps, args.batch, args.rounds)
                     for label, model, width in SIZES}  # fmt: skip
        finally:
            dist.destroy_process_group()
    return {"batch": args.batch, "torch": torch.__version__, "threads": 1, "sizes": sizes}


def measure_diloco_size(model_name: str, width: int, repeats: int) -> dict[str, Any]:
    """Each DiLoCo preset's synchronisation in a world of one (the exchange's compression, the aggregator's own
    decoding, the outer step) and its payload's bytes per element; the decoding of each further rank's payload
    (parsed from its bytes, then added) timed on its own."""
    import torch

    from lightning_gradcomp.diloco import DILOCO_PRESETS, OuterSync

    out = {}
    for preset in DILOCO:
        arguments = dict(DILOCO_PRESETS[preset][1])
        outer = {k: arguments.pop(k) for k in ("outer_lr", "outer_momentum", "nesterov") if k in arguments}
        torch.manual_seed(0)
        model = build_model(model_name, width)
        sync = OuterSync(model.named_parameters(), sync_every=1, **outer, **arguments)
        seconds = []
        for _ in range(repeats + 1):
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(torch.randn_like(p), alpha=1e-3)  # an inner step's worth of change
            start = time.perf_counter()
            sync.step()
            seconds.append(time.perf_counter() - start)
        stats = sync.last_step
        numel = stats.numel
        decode_s = 0.0
        if sync.exchange is not None:
            codec = sync.exchange.compressor
            x = torch.randn(numel)
            wire, total = codec.compress(x).to_bytes(), torch.zeros(numel)
            # each other rank's payload parsed from its bytes, then added (the DDP methods' profile times the adding)
            decode_s = _median_seconds(lambda c=codec, b=wire, t=total: c.accumulate(c.unpack(b, t.shape, t.dtype), t))
        out[preset] = {
            "aggregator": "allreduce" if sync.exchange is None else "allgather",
            "codec_s": statistics.median(seconds[1:]),
            "decode_s": decode_s,
            "merge_s": 0.0,
            "payload_bytes_per_element": 4.0 if sync.exchange is None else stats.payload_bytes / numel,
            "compressed_fraction": 1.0,
            "units": sum(1 for p in model.parameters() if p.requires_grad),
            "sync": True,
        }
        bits = 8 * out[preset]["payload_bytes_per_element"]
        print(f"{model_name} {width}: {preset} {out[preset]['codec_s'] * 1e3:.1f} ms/synchronisation, "
              f"{bits:.3f} bits/element", file=sys.stderr, flush=True)  # fmt: skip
    return out


def measure_diloco(args: argparse.Namespace) -> dict[str, Any]:
    """Add the DiLoCo presets to ``--profile`` (measured by ``measure``) at each of its sizes."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    profile = json.loads(Path(args.profile).read_text())
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=0, world_size=1,
                                timeout=timedelta(seconds=300))  # fmt: skip
        try:
            for label, model, width in SIZES:
                profile["sizes"][label]["methods"].update(measure_diloco_size(model, width, args.repeats))
        finally:
            dist.destroy_process_group()
    return profile


# --- calibrate: the links of this machine -------------------------------------------------------------------------


def link_worker(out: str, across: bool) -> None:
    """Every rank sends each of MESSAGE_SIZES and receives one at the same time, as a ring's step does.

    ``across``: along a ring that changes node at every hop (ranks ordered by local rank, then node), so each
    node's link carries all its ranks' flows each way at once; else with its partner inside its node (local
    rank ``j XOR 1``: the exchange of a two-rank reduce-scatter). Rank 0 writes, per size, the slowest rank's
    median seconds.
    """
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=timedelta(seconds=300))
    rank, world, per_node = dist.get_rank(), dist.get_world_size(), int(os.environ["LOCAL_WORLD_SIZE"])
    nodes = world // per_node
    if across:
        ring = [node * per_node + local for local in range(per_node) for node in range(nodes)]
        here = ring.index(rank)
        send_to, receive_from = ring[(here + 1) % world], ring[(here - 1) % world]
    else:
        node, local = divmod(rank, per_node)
        send_to = receive_from = node * per_node + (local ^ 1)
    result = {}
    for size in MESSAGE_SIZES:
        send, receive = torch.zeros(size, dtype=torch.uint8), torch.empty(size, dtype=torch.uint8)
        times = []
        for repeat in range(21 if size <= 1 << 14 else 6):  # small messages: noisier, cheap to repeat
            dist.barrier()
            start = time.perf_counter()
            request = dist.isend(send, send_to)
            dist.recv(receive, receive_from)
            request.wait()
            if repeat:
                times.append(time.perf_counter() - start)
        slowest = torch.tensor([statistics.median(times)], dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        result[size] = float(slowest)
    if rank == 0:
        Path(out).write_text(json.dumps(result))
    dist.destroy_process_group()


def fit_link(one_way: dict[int, float]) -> Link:
    """``beta`` from the two largest messages (the slope: what a step's bulk bytes see), ``alpha`` from the
    smallest. A line through all sizes would not do: ``tc tbf`` lets a burst (32 KB here) pass at the
    veth's own speed, so medium messages look faster than the link is."""
    sizes = sorted(one_way)
    small, second, largest = sizes[0], sizes[-2], sizes[-1]
    beta = (largest - second) / (one_way[largest] - one_way[second])
    return Link(alpha_s=max(0.0, one_way[small] - small / beta), bytes_per_s=beta)


def calibrate(args: argparse.Namespace) -> dict[str, Any]:
    """alpha and beta of the links of ``--nodes`` x ``--ranks-per-node`` namespaces, under the load of that layout.

    Every rank sends to a rank of the next node along a ring at once (so a node's link carries
    ``ranks-per-node`` flows each way, with as many processes on the cores as in the training run), then with
    its partner inside the node, over the node's loopback; a link's beta counts the bytes of all its flows.
    """
    from network import Network, link_bits_per_s

    links: dict[str, Any] = {}
    cases = [(rate, rate, True) for rate in args.rate]
    if args.ranks_per_node > 1:
        cases.append(("loopback", "none", False))
    for name, rate, across in cases:
        network = Network(args.nodes, rate, args.ranks_per_node)
        try:
            network.create()
            with tempfile.TemporaryDirectory() as tmp:
                out = str(Path(tmp) / "link.json")
                network.launch([__file__, "link-worker", "--out", out, *(["--across"] if across else [])], 600)
                seconds = {int(k): v for k, v in json.loads(Path(out).read_text()).items()}
        finally:
            network.delete()
        flows = args.ranks_per_node if across else 1
        link = fit_link({size * flows: t for size, t in seconds.items()})
        nominal = link_bits_per_s(rate)
        links[name] = {**asdict(link), "flows": flows, "exchange_s": seconds,
                       "nominal_bytes_per_s": nominal / 8 if nominal else None}  # fmt: skip
        print(f"{name}: alpha {link.alpha_s * 1e6:.0f} us, {link.bytes_per_s * 8 / 1e6:.0f} Mbit/s", file=sys.stderr)
    return {"nodes": args.nodes, "ranks_per_node": args.ranks_per_node, "links": links}


# --- validate: against this machine's measured steps ---------------------------------------------------------------


def validate(args: argparse.Namespace) -> list[dict[str, Any]]:
    profile = json.loads(Path(args.profile).read_text())
    # each layout's links, as ``calibrate`` measured them under that layout's load
    calibrations = [json.loads(Path(path).read_text()) for path in args.links]
    by_layout = {(c["nodes"], c["ranks_per_node"]): c["links"] for c in calibrations}
    cores = os.cpu_count() or 1
    rows = []
    for path in args.measured:
        run = json.loads(Path(path).read_text())
        label = "mnist-mlp" if run["model"] == "mnist-mlp" else f"mlp-{run['width']}"
        size = profile["sizes"][label]
        nodes = run["nodes"] or run["ranks"]
        per_node = run["ranks"] // nodes
        links = by_layout.get((nodes, per_node))
        if links is None:
            raise SystemExit(f"{path}: no calibration of {nodes} nodes x {per_node} ranks among --links")
        loopback = Link(links["loopback"]["alpha_s"], links["loopback"]["bytes_per_s"]) if per_node > 1 else None
        for rate, results in run["rates"].items():
            if rate not in links:
                continue
            inter = Link(links[rate]["alpha_s"], links[rate]["bytes_per_s"])
            cluster = Cluster(nodes, per_node, inter, loopback or inter, share=max(1.0, run["ranks"] / cores))
            for result in results:
                method = result["method"]
                base, hierarchical = profiled_method(method)
                if method in HSDP:
                    predicted = predict_hsdp_step(*hsdp_costs(method, partial(measured_costs, size)), cluster)
                elif base not in size["methods"] or method not in (*METHODS, *HIERARCHICAL):
                    continue
                else:
                    predicted = predict_step(measured_costs(size, base), cluster, hierarchical)
                measured = result["seconds_per_step"]
                rows.append({"run": Path(path).name, "layout": f"{nodes}x{per_node}", "rate": rate, "method": method,
                             "measured_s": measured, "predicted_s": predicted.total_s, **asdict(predicted),
                             "error": predicted.total_s / measured - 1.0})  # fmt: skip
    return rows


# --- predict: a cluster ------------------------------------------------------------------------------------------


def cluster_predictions(args: argparse.Namespace) -> list[dict[str, Any]]:
    from network import link_bits_per_s

    profile = json.loads(Path(args.profile).read_text())
    rows = []
    intra = Link(args.intra_latency_us * 1e-6, args.intra_gbytes_per_s * 1e9)
    for params in args.params:
        for rate in args.rates:
            inter = Link(args.inter_latency_us * 1e-6, link_bits_per_s(rate) / 8 * ETHERNET_EFFICIENCY)
            ranks = args.gpus_per_node
            while ranks <= args.max_ranks:
                cluster = Cluster(ranks // args.gpus_per_node, args.gpus_per_node, inter, intra)
                dense = predict_step(costs_at(profile, "dense", params, args.compute_scale), cluster, False).total_s
                diloco = [f"{p}:H{h}" for p in DILOCO if p in _methods(profile) for h in args.sync_every]
                for method in (*METHODS, *HIERARCHICAL, *diloco):
                    base, hierarchical = profiled_method(method)
                    costs = costs_at(profile, base, params, args.compute_scale)
                    if base in DILOCO:
                        costs = replace(costs, sync_every=int(method.rpartition(":H")[2]))
                    step = predict_step(costs, cluster, hierarchical)
                    rows.append(_row(params, rate, ranks, method, step, dense, profile["batch"]))
                for method in HSDP:
                    costs_of = partial(costs_at, profile, params=params, scale=args.compute_scale)
                    step = predict_hsdp_step(*hsdp_costs(method, costs_of), cluster, args.hsdp_units)
                    rows.append(_row(params, rate, ranks, method, step, dense, profile["batch"]))
                ranks *= 2
    return [r for r in rows if args.methods is None or r["method"] in args.methods]


def _row(params: float, rate: str, ranks: int, method: str, step: Prediction, dense: float, batch: int) -> dict:
    return {"params": params, "rate": rate, "ranks": ranks, "method": method, "seconds_per_step": step.total_s,
            "speedup_vs_dense": dense / step.total_s, "seconds_per_sample": step.total_s / (batch * ranks),
            **asdict(step)}  # fmt: skip


def _methods(profile: dict[str, Any]) -> set[str]:
    """The methods every measured size of ``profile`` holds."""
    return set.intersection(*(set(size["methods"]) for size in profile["sizes"].values()))


def crossovers(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """For each model size, rate and method: the fewest ranks at which it beats dense, and where it stops."""
    found = []
    keys = sorted({(r["params"], r["rate"], r["method"]) for r in rows}, key=lambda k: (k[0], k[1], k[2]))
    for params, rate, method in keys:
        series = sorted((r for r in rows if (r["params"], r["rate"], r["method"]) == (params, rate, method)),
                        key=lambda r: r["ranks"])  # fmt: skip
        ahead = [r["speedup_vs_dense"] > 1.0 for r in series]
        first = next((i for i, a in enumerate(ahead) if a), None)
        last = first
        while last is not None and last + 1 < len(series) and ahead[last + 1]:
            last += 1  # the first run of rank counts where it beats dense, up to where it stops
        best = max(series, key=lambda r: r["speedup_vs_dense"])
        found.append({"params": params, "rate": rate, "method": method,
                      "faster_from": series[first]["ranks"] if first is not None else None,
                      "faster_until": series[last]["ranks"] if last is not None else None,
                      "best_speedup": best["speedup_vs_dense"], "best_at": best["ranks"]})  # fmt: skip
    return found


#: ``(challenger, incumbent)``: where one method's step becomes shorter than another's
OVERTAKES = (("ddp_gtopk", "ddp_topk"), ("ddp_topk:node", "ddp_topk"), ("ddp_gtopk:node", "ddp_gtopk"),
             ("hsdp_topk", "hsdp"))  # fmt: skip


def overtakes(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """For each model size and rate: the fewest ranks from which each challenger of OVERTAKES stays faster."""
    step = {(r["params"], r["rate"], r["method"], r["ranks"]): r["seconds_per_step"] for r in rows}
    found = []
    for params, rate in dict.fromkeys((r["params"], r["rate"]) for r in rows):
        ranks = sorted({r["ranks"] for r in rows})
        for challenger, incumbent in OVERTAKES:
            if (params, rate, challenger, ranks[0]) not in step or (params, rate, incumbent, ranks[0]) not in step:
                continue
            ahead = [step[params, rate, challenger, p] < step[params, rate, incumbent, p] for p in ranks]
            start = next((i for i in range(len(ranks)) if all(ahead[i:])), None)
            found.append({"params": params, "rate": rate, "challenger": challenger, "incumbent": incumbent,
                          "from_ranks": ranks[start] if start is not None else None})  # fmt: skip
    return found


def plot(rows: list[dict[str, Any]], path: str, title: str, per_node: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    params = sorted({r["params"] for r in rows})
    rates = list(dict.fromkeys(r["rate"] for r in rows))
    methods = [m for m in dict.fromkeys(r["method"] for r in rows) if m != "dense"]
    fig, axes = plt.subplots(len(params), len(rates), figsize=(5 * len(rates), 4 * len(params)), squeeze=False)
    for i, size in enumerate(params):
        for j, rate in enumerate(rates):
            ax = axes[i][j]
            for n, method in enumerate(methods):
                series = sorted((r for r in rows if (r["params"], r["rate"], r["method"]) == (size, rate, method)),
                                key=lambda r: r["ranks"])  # fmt: skip
                style = "--" if method.endswith(":node") else ":" if ":H" in method else "-." if method in HSDP else "-"
                ax.plot([r["ranks"] for r in series], [r["speedup_vs_dense"] for r in series], label=method,
                        color=f"C{n % 10}", linestyle=style, marker=".")  # fmt: skip
            ax.axhline(1.0, color="black", linewidth=0.8)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_title(f"{size / 1e6:g}M parameters, {rate}")
            ax.set_xlabel(f"ranks ({per_node} per node)")
            ax.set_ylabel("predicted speed-up over dense ring allreduce")
    axes[0][0].legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    m = sub.add_parser("measure", help="time computation and count bytes of each method at several model sizes")
    m.add_argument("--steps", type=int, default=10, help="timed steps per method, size and round")
    m.add_argument("--rounds", type=int, default=3, help="turns the methods take, interleaved")
    m.add_argument("--batch", type=int, default=32)
    m.add_argument("--json", required=True)
    d = sub.add_parser("measure-diloco", help="time each DiLoCo preset's synchronisation; added to --profile")
    d.add_argument("--profile", required=True, help="measure's JSON, rewritten with the DiLoCo presets added")
    d.add_argument("--repeats", type=int, default=5)
    c = sub.add_parser("calibrate", help="alpha and beta of the shaped links and the loopback (root, iproute2)")
    c.add_argument("--rate", action="append", help="tc rate, repeatable (default: 100mbit, 1gbit)")
    c.add_argument("--nodes", type=int, default=2, help="namespaces, 2 or more")
    c.add_argument("--ranks-per-node", type=int, default=2, help="ranks in each, 1 or an even number")
    c.add_argument("--json", required=True)
    w = sub.add_parser("link-worker")
    w.add_argument("--out", required=True)
    w.add_argument("--across", action="store_true")
    v = sub.add_parser("validate", help="predicted vs measured steps of network.py runs")
    v.add_argument("--profile", required=True)
    v.add_argument("--links", nargs="+", required=True, help="calibrate's JSON files, one per layout")
    v.add_argument("--measured", nargs="+", required=True, help="network.py JSON files")
    v.add_argument("--json")
    p = sub.add_parser("predict", help="speed-up over dense at 8 to 1024 ranks; plot and crossovers")
    p.add_argument("--profile", required=True)
    p.add_argument("--params", type=float, nargs="+", default=[25e6, 1e9])
    p.add_argument("--rates", nargs="+", default=["10mbit", "100mbit", "1gbit", "10gbit", "100gbit"])
    p.add_argument("--sync-every", type=int, nargs="+", default=[10, 100],
                   help="DiLoCo's H: inner steps per synchronisation (presets timed by measure-diloco)")  # fmt: skip
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--max-ranks", type=int, default=1024)
    p.add_argument("--intra-gbytes-per-s", type=float, default=300.0, help="NVLink-class link inside a node")
    p.add_argument("--intra-latency-us", type=float, default=5.0)
    p.add_argument("--inter-latency-us", type=float, default=10.0)
    p.add_argument("--compute-scale", type=float, default=1.0,
                   help="multiply the measured computation (1: this machine's CPU core, as measured)")  # fmt: skip
    p.add_argument("--hsdp-units", type=int, default=32,
                   help="FSDP units of the predicted model (its blocks): messages per collective")  # fmt: skip
    p.add_argument("--methods", nargs="+", help="predict only these (default: every method; dense is the baseline)")
    p.add_argument("--plot")
    p.add_argument("--json")
    args = parser.parse_args(argv)
    if args.command == "link-worker":
        link_worker(args.out, args.across)
        return 0
    if args.command == "measure":
        report: Any = measure(args)
    elif args.command == "measure-diloco":
        report = measure_diloco(args)
        args.json = args.profile
    elif args.command == "calibrate":
        if os.geteuid() != 0:
            print("calibrate needs root and iproute2 to build shaped network namespaces; exiting.")
            return 2
        args.rate = args.rate or ["100mbit", "1gbit"]
        report = calibrate(args)
    elif args.command == "validate":
        report = validate(args)
        print(f"{'run':24} {'layout':6} {'rate':8} {'method':26} {'measured s':>10} {'predicted s':>11} "
              f"{'compute':>8} {'intra':>7} {'link':>7} {'error':>7}")  # fmt: skip
        for r in report:
            print(f"{r['run']:24} {r['layout']:6} {r['rate']:8} {r['method']:26} {r['measured_s']:10.3f} "
                  f"{r['predicted_s']:11.3f} {r['compute_s']:8.3f} {r['intra_s']:7.3f} {r['inter_s']:7.3f} "
                  f"{r['error']:+7.0%}")  # fmt: skip
        within = sum(abs(r["error"]) <= 0.25 for r in report)
        print(f"{within} of {len(report)} predictions within 25% of the measured step; "
              f"median |error| {statistics.median(abs(r['error']) for r in report):.0%}")  # fmt: skip
    else:
        rows = cluster_predictions(args)
        found = crossovers(rows)
        print(f"{'params':>8} {'rate':8} {'method':26} {'faster than dense at P':>24} {'best x dense':>13}")
        for f in found:
            span = f"{f['faster_from']}-{f['faster_until']}" if f["faster_from"] else "never"
            print(f"{f['params'] / 1e6:7g}M {f['rate']:8} {f['method']:26} {span:>24} "
                  f"{f['best_speedup']:8.2f} at {f['best_at']}")  # fmt: skip
        passes = overtakes(rows)
        for o in passes:
            start = f"from {o['from_ranks']} ranks on" if o["from_ranks"] else "not for good"
            print(f"{o['params'] / 1e6:7g}M {o['rate']:8} {o['challenger']} faster than {o['incumbent']} {start}")
        report = {"settings": {k: v for k, v in vars(args).items() if k not in ("command", "plot", "json")},
                  "predictions": rows, "crossovers": found, "overtakes": passes}  # fmt: skip
        if args.plot:
            title = (f"compute x{args.compute_scale:g} of one CPU core's (measured); "
                     f"{args.gpus_per_node} ranks a node at {args.intra_gbytes_per_s:g} GB/s")  # fmt: skip
            plot(rows, args.plot, title, args.gpus_per_node)
    if getattr(args, "json", None):
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
