"""Training throughput on a bandwidth-limited network: every rank in its own network namespace.

Builds a star of P network namespaces joined through a bridge, each link shaped both ways with
``tc tbf`` to ``--rate``, runs one process per rank inside its namespace (gloo over the shaped
link, ``GLOO_SOCKET_IFNAME``), and trains the same model on the same batches with every method in
ONE launch, so the ratios between methods are comparable: plain DDP, PyTorch's fp16 and
PowerSGD hooks, every named strategy with the hook ``GradCompStrategy`` installs for it, and the
variants of ``methods.py``; ``--model`` picks one of the models of ``workloads.py`` (random inputs of
its shape: what a step costs does not depend on the pixels). A method with a density warm-up (the
Top-k presets) first has its dense first step and its warm-up timed on their own
(``warmup_seconds_per_step`` in the JSON), then its steady state; the table shows the steady state.

Reports images/s, scaling efficiency (throughput at P / (P x single-process throughput)) and, for
our hooks, the bytes each rank handed to collectives per step and got back, and each method's
*limit*: plain DDP's unshaped step time in the same run (``--rate none`` must be among the rates)
plus the bytes the method receives per step divided by the link rate, i.e. the step time of a
method whose compression and decoding cost nothing and whose bytes fill the link. Needs root and iproute2; it creates
and always deletes its own namespaces, and uses only addresses it assigns inside them.

    sudo python benchmarks/network.py --ranks 4 --rate 100mbit --json benchmarks/results/network_mlp_100mbit.json

``--nodes N --ranks-per-node L`` emulates a cluster instead: one namespace per *node*, its L ranks
talking over that namespace's own loopback (unshaped, the fast link inside a node), the nodes
joined through the bridge by links shaped to ``--rate`` (the slow links between nodes). Every
rank gets its node's ``GROUP_RANK`` and ``LOCAL_RANK`` as under ``torchrun --nnodes N``, which
``hierarchy="node"`` reads. Each node also counts the bytes its link actually transmitted
(``/sys/class/net/eth0/statistics/tx_bytes``, headers included) during the timed steps:
``link_bytes_per_step`` in the JSON, summed over nodes, is what crossed the slow links.

    sudo python benchmarks/network.py --nodes 2 --ranks-per-node 2 --rate 100mbit \
        --methods dense,ddp_topk,ddp_topk:node --json benchmarks/results/network_mlp_2x2_100mbit.json

With ``--nodes``, ``hsdp`` and ``hsdp_topk`` shard the model over a node's ranks with FSDP2 and replicate it across
nodes: FSDP2's own HSDP, and the replica exchange compressed by :class:`~lightning_gradcomp.ReplicaExchange`. DiLoCo's
methods (``ddp_diloco*``, ``torchft_diloco``) are timed over whole rounds of ``--sync-every`` steps.
"""

from __future__ import annotations

import argparse
import atexit
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from methods import (
    AFTER_WARMUPS,
    DEFAULT_METHODS,
    HSDP_METHODS,
    LocalSGD,
    attach,
    check_methods,
    compressed_adam,
    hsdp_model,
    is_compressed_adam,
    is_local_sgd,
)
from workloads import MODELS, build_model, loss, random_batch

SUBNET = "10.213.0"
PORT = 29561


@dataclass
class Result:
    method: str
    images_per_s: float
    seconds_per_step: float
    bytes_sent_per_step: float | None
    dense_bytes_per_step: float | None
    bytes_received_per_step: float | None = None
    #: the method's dense steps and density warm-up (0: none) and, when they make more than the one
    #: dense first step, the mean seconds of those ``dense_steps + density_warmup_steps`` first steps,
    #: timed before the steady state
    density_warmup_steps: int = 0
    warmup_seconds_per_step: float | None = None
    dense_steps: int = 1
    #: under Accordion (``adaptive="accordion"``), the steady seconds per step of its critical regime (compressed
    #: less, or dense); ``seconds_per_step`` is then its relaxed regime's
    critical_seconds_per_step: float | None = None
    #: bytes this rank handed to collectives inside its node (``hierarchy="node"``), per timed step
    bytes_sent_intra_node_per_step: float | None = None
    #: bytes every node's link to the others transmitted per timed step, summed over nodes
    link_bytes_per_step: float | None = None
    note: str = ""


def _batches(rank: int, batch: int, count: int, model: str):
    import torch

    gen = torch.Generator().manual_seed(1000 + rank)
    return [random_batch(model, batch, gen) for _ in range(count)]


def _link_tx_bytes() -> int:
    """Bytes this namespace's link (eth0) has transmitted so far."""
    return int(Path("/sys/class/net/eth0/statistics/tx_bytes").read_text())


def _timed_steps(model, optimizer, batches, args: argparse.Namespace, first: int, count: int, after=None) -> float:
    """Seconds ``count`` training steps take on every rank, from batch ``first`` on (cycling); ``after`` runs after
    each optimizer step (DiLoCo's outer loop)."""
    import torch.distributed as dist

    dist.barrier()
    start = time.perf_counter()
    for step in range(first, first + count):
        x, y = batches[step % len(batches)]
        optimizer.zero_grad()
        loss(args.model, model(x), y).backward()
        optimizer.step()
        if after is not None:
            after()
    dist.barrier()
    return time.perf_counter() - start


def _link_bytes_since(before: int) -> float:
    """Bytes every node's link transmitted since this rank read ``before``, summed over nodes (each node's counted
    once, at its local rank 0)."""
    import torch
    import torch.distributed as dist

    tx = torch.tensor([float(_link_tx_bytes() - before) if int(os.environ["LOCAL_RANK"]) == 0 else 0.0])
    dist.all_reduce(tx)
    return float(tx)


def worker(args: argparse.Namespace) -> None:
    """One rank: train every method for ``--steps`` timed steps; rank 0 writes the results."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from lightning_gradcomp.core.adaptive import Accordion

    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=300))
    batches = _batches(rank, args.batch, args.steps + args.warmup, args.model)
    results = []
    for method in args.methods.split(","):
        torch.manual_seed(0)
        model = build_model(args.model, args.width)
        if is_local_sgd(method):
            results.append(_local_sgd_steps(method, model, batches, args, rank, world))
            continue
        if method in HSDP_METHODS:
            results.append(_hsdp_steps(method, model, batches, args, rank, world))
            continue
        if is_compressed_adam(method):
            results.append(_compressed_adam_steps(method, model, batches, args, rank, world))
            continue
        ddp = DistributedDataParallel(model)
        try:
            hook = attach(method, ddp, model, overrides=AFTER_WARMUPS if args.after_warmups else None)
        except (ValueError, KeyError) as err:
            results.append(Result(method, 0.0, 0.0, None, None, note=f"skipped: {err}"))
            continue
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

        def run(first: int, count: int, ddp=ddp, optimizer=optimizer) -> float:
            return _timed_steps(ddp, optimizer, batches, args, first, count)

        # dense steps and a density warm-up are timed on their own, then the steady state
        schedule = hook.schedule if hook is not None else None
        density_warmup = getattr(getattr(schedule, "density_warmup", None), "steps", 0)
        dense_steps = schedule.warmup_steps if schedule is not None else 1
        early = dense_steps + density_warmup
        warmup_seconds = run(0, early) / early if early > 1 else None
        untimed = 0 if early > 1 else args.warmup
        run(early, untimed)
        critical_seconds = None
        if isinstance(schedule, Accordion):  # each regime's steady state, the regime held for the timed steps
            schedule.interval, schedule.critical = 10**9, True
            run(early + untimed, args.warmup)
            critical_seconds = run(early + untimed, args.steps) / args.steps
            schedule.critical = False
            run(early + untimed, args.warmup)
        tx_before = _link_tx_bytes()
        elapsed = run(early + untimed, args.steps)
        tx = _link_bytes_since(tx_before)
        if rank == 0:
            print(f"{method}: {elapsed / args.steps:.3f} s/step", file=sys.stderr, flush=True)
        timed = [s for s in hook.history if not s.warmup][-args.steps :] if hook is not None else []
        results.append(
            Result(
                method,
                images_per_s=world * args.batch * args.steps / elapsed,
                seconds_per_step=elapsed / args.steps,
                bytes_sent_per_step=sum(s.bytes_sent for s in timed) / len(timed) if timed else None,
                dense_bytes_per_step=sum(s.dense_bytes for s in timed) / len(timed) if timed else None,
                bytes_received_per_step=sum(s.bytes_received for s in timed) / len(timed) if timed else None,
                bytes_sent_intra_node_per_step=sum(s.bytes_sent_intra_node for s in timed) / len(timed)
                if timed
                else None,
                link_bytes_per_step=float(tx) / args.steps,
                density_warmup_steps=density_warmup,
                warmup_seconds_per_step=warmup_seconds,
                dense_steps=dense_steps,
                critical_seconds_per_step=critical_seconds,
            )
        )
    if rank == 0:
        Path(args.out).write_text(json.dumps([asdict(r) for r in results]))
    dist.destroy_process_group()


def _compressed_adam_steps(method: str, model, batches, args: argparse.Namespace, rank: int, world: int) -> Result:
    """Compressed Adam's compressed stage, frozen after 2 untimed steps (its warm-up is dense DDP's step: the time
    model takes plain DDP's row for it), then ``--steps`` timed."""
    import torch
    from torch.nn.parallel import DistributedDataParallel

    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    adam = compressed_adam(method, optimizer, ddp, freeze_step=2)
    _timed_steps(ddp, optimizer, batches, args, 0, max(args.warmup, 3))
    tx_before = _link_tx_bytes()
    elapsed = _timed_steps(ddp, optimizer, batches, args, max(args.warmup, 3), args.steps)
    tx = _link_bytes_since(tx_before)
    if rank == 0:
        print(f"{method}: {elapsed / args.steps:.3f} s/step (compressed stage)", file=sys.stderr, flush=True)
    timed = [s for s in adam.history if s.compressed][-args.steps :]
    mean = lambda key: sum(getattr(s, key) for s in timed) / len(timed)  # noqa: E731
    return Result(method, images_per_s=world * args.batch * args.steps / elapsed,
                  seconds_per_step=elapsed / args.steps, bytes_sent_per_step=mean("bytes_sent"),
                  dense_bytes_per_step=mean("dense_bytes"), bytes_received_per_step=mean("bytes_received"),
                  link_bytes_per_step=float(tx) / args.steps, note="compressed Adam, its compressed stage")  # fmt: skip


def _local_sgd_steps(method: str, model, batches, args: argparse.Namespace, rank: int, world: int) -> Result:
    """A DiLoCo method's steady inner step, synchronisations included: ``--sync-every`` untimed steps (the first
    synchronisation: torchft's first quorum configures its process group), then whole rounds of ``H`` steps timed,
    at least ``--steps`` of them."""
    import torch

    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    local = LocalSGD(method, model, optimizer, args.sync_every)
    h = local.sync_every  # the run's --sync-every, or the method's own @H
    timed_steps = h * math.ceil(args.steps / h)

    try:
        _timed_steps(model, optimizer, batches, args, 0, h, local.step)
        tx_before = _link_tx_bytes()
        elapsed = _timed_steps(model, optimizer, batches, args, h, timed_steps, local.step)
        tx = _link_bytes_since(tx_before)
    finally:
        local.close()
    if rank == 0:
        print(f"{method}: {elapsed / timed_steps:.3f} s/step (H={h})", file=sys.stderr, flush=True)
    timed = list(local.history)[-timed_steps:]
    mean = (lambda key: sum(getattr(s, key) for s in timed) / len(timed)) if timed else (lambda key: None)
    return Result(method, images_per_s=world * args.batch * timed_steps / elapsed,
                  seconds_per_step=elapsed / timed_steps, bytes_sent_per_step=mean("bytes_sent"),
                  dense_bytes_per_step=mean("dense_bytes"), bytes_received_per_step=mean("bytes_received"),
                  link_bytes_per_step=float(tx) / timed_steps, note=f"DiLoCo, H={h}")  # fmt: skip


def _hsdp_steps(method: str, model, batches, args: argparse.Namespace, rank: int, world: int) -> Result:
    """HSDP's step, each node a replica of the model sharded over its ranks (``--nodes``): FSDP2's own (dense between
    replicas) or the compressed replica exchange; ``--warmup`` untimed steps, then ``--steps`` timed."""
    import torch

    local = int(os.environ["LOCAL_WORLD_SIZE"])
    model, exchange = hsdp_model(method, model, world // local, local)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    _timed_steps(model, optimizer, batches, args, 0, args.warmup)
    tx_before = _link_tx_bytes()
    elapsed = _timed_steps(model, optimizer, batches, args, args.warmup, args.steps)
    tx = _link_bytes_since(tx_before)
    if rank == 0:
        print(f"{method}: {elapsed / args.steps:.3f} s/step", file=sys.stderr, flush=True)
    timed = [s for s in exchange.history if s.step >= args.warmup] if exchange is not None else []  # every unit's
    sent = sum(s.bytes_sent for s in timed) / args.steps if timed else None
    dense = sum(s.dense_bytes for s in timed) / args.steps if timed else None
    return Result(method, images_per_s=world * args.batch * args.steps / elapsed, seconds_per_step=elapsed / args.steps,
                  bytes_sent_per_step=sent, dense_bytes_per_step=dense, link_bytes_per_step=float(tx) / args.steps,
                  note="HSDP: a replica per node, sharded over its ranks")  # fmt: skip


def single_process_throughput(args: argparse.Namespace) -> float:
    """Images/s of one process training the same model with no communication at all."""
    import torch

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = build_model(args.model, args.width)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    batches = _batches(0, args.batch, args.steps + args.warmup, args.model)
    for step, (x, y) in enumerate(batches):
        if step == args.warmup:
            start = time.perf_counter()
        optimizer.zero_grad()
        loss(args.model, model(x), y).backward()
        optimizer.step()
    return args.batch * args.steps / (time.perf_counter() - start)


class Network:
    """``nodes`` namespaces on one bridge, each link shaped both ways to ``rate`` (``"none"``: unshaped), with
    ``ranks_per_node`` ranks in each (talking over its loopback inside the node); deleted on exit."""

    def __init__(self, nodes: int, rate: str, ranks_per_node: int = 1) -> None:
        self.tag = f"gc{os.getpid() % 100000}"
        self.bridge_ns = f"{self.tag}br"
        self.rank_ns = [f"{self.tag}r{i}" for i in range(nodes)]
        self.ranks_per_node = ranks_per_node
        self.rate = rate
        atexit.register(self.delete)

    @staticmethod
    def _ip(*cmd: str) -> None:
        subprocess.run(cmd, check=True, capture_output=True, text=True)

    def create(self) -> None:
        run = self._ip
        run("ip", "netns", "add", self.bridge_ns)
        run("ip", "-n", self.bridge_ns, "link", "add", "br0", "type", "bridge")
        run("ip", "-n", self.bridge_ns, "link", "set", "br0", "up")
        shape = ["tbf", "rate", self.rate, "burst", "256kbit", "latency", "50ms"]
        for i, ns in enumerate(self.rank_ns):
            host, port = f"{self.tag}h{i}", f"{self.tag}p{i}"
            run("ip", "netns", "add", ns)
            run("ip", "link", "add", host, "type", "veth", "peer", "name", port)
            run("ip", "link", "set", host, "netns", ns)
            run("ip", "link", "set", port, "netns", self.bridge_ns)
            run("ip", "-n", ns, "link", "set", host, "name", "eth0")
            run("ip", "-n", ns, "addr", "add", f"{SUBNET}.{i + 1}/24", "dev", "eth0")
            run("ip", "-n", ns, "link", "set", "eth0", "up")
            run("ip", "-n", ns, "link", "set", "lo", "up")
            run("ip", "-n", self.bridge_ns, "link", "set", port, "master", "br0")
            run("ip", "-n", self.bridge_ns, "link", "set", port, "up")
            if self.rate != "none":
                run("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "eth0", "root", *shape)
                run("ip", "netns", "exec", self.bridge_ns, "tc", "qdisc", "add", "dev", port, "root", *shape)

    def delete(self) -> None:
        for ns in [*self.rank_ns, self.bridge_ns]:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)

    def launch(self, argv: list[str], timeout: float) -> None:
        """Run ``python *argv`` once per rank, each in its node's namespace with the rank's ``torchrun``-like
        environment (gloo on the node's ``eth0``, one thread); raise ``SystemExit`` if a rank fails or the
        ranks outlive ``timeout`` seconds."""
        procs = []
        world = len(self.rank_ns) * self.ranks_per_node
        for rank in range(world):
            node, local = divmod(rank, self.ranks_per_node)
            env = dict(os.environ, MASTER_ADDR=f"{SUBNET}.1", MASTER_PORT=str(PORT), RANK=str(rank),
                       WORLD_SIZE=str(world), GROUP_RANK=str(node), LOCAL_RANK=str(local),
                       LOCAL_WORLD_SIZE=str(self.ranks_per_node), GLOO_SOCKET_IFNAME="eth0",
                       HOST_ADDR=f"{SUBNET}.{node + 1}",
                       OMP_NUM_THREADS="1")  # fmt: skip
            cmd = ["ip", "netns", "exec", self.rank_ns[node], sys.executable, *argv]
            procs.append(subprocess.Popen(cmd, env=env))
        deadline = time.monotonic() + timeout
        try:
            for p in procs:
                p.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            raise SystemExit(f"ranks did not finish within {timeout} s") from None
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        if any(p.returncode for p in procs):
            raise SystemExit(f"a rank failed: exit codes {[p.returncode for p in procs]}")


def link_bits_per_s(rate: str) -> float | None:
    """A ``tc`` rate (``100mbit``, ``1gbit``, ``500kbit``: decimal units, as tc reads them) in bit/s, else ``None``."""
    units = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "bit": 1.0}
    for suffix, factor in units.items():
        if rate.endswith(suffix) and rate[: -len(suffix)].replace(".", "", 1).isdigit():
            return float(rate[: -len(suffix)]) * factor
    return None


def step_limit(dense_unshaped_s: float | None, received_bytes: float | None, rate: str) -> float | None:
    """What a method's step could take at best on ``rate``: plain DDP's unshaped step (the computation and a
    fast exchange) plus the bytes the method receives per step sent through the link at full rate."""
    bits = link_bits_per_s(rate) if rate != "none" else math.inf
    if dense_unshaped_s is None or not received_bytes or bits is None:
        return None
    return dense_unshaped_s + 8 * received_bytes / bits


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=4, help="ranks, each in a namespace of its own")
    parser.add_argument("--nodes", type=int, help="emulated nodes (namespaces), with --ranks-per-node ranks each")
    parser.add_argument("--ranks-per-node", type=int, default=2, help="ranks in each of --nodes")
    parser.add_argument(
        "--rate",
        action="append",
        help="tc rate, repeatable; 'none' leaves the links unshaped (default: 100mbit, 1gbit)",
    )
    parser.add_argument("--methods", default=DEFAULT_METHODS)
    parser.add_argument("--steps", type=int, default=10, help="timed steps per method")
    parser.add_argument(
        "--sync-every", type=int, default=10, help="DiLoCo's H (its methods): steps per synchronisation"
    )
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per method (buckets, PowerSGD start)")
    parser.add_argument("--batch", type=int, default=32, help="images per rank per step")
    parser.add_argument("--model", default="mlp", choices=list(MODELS), help="what to train (see workloads.py)")
    parser.add_argument("--width", type=int, default=512, help="width of --model mlp (512: 1.84M parameters)")
    parser.add_argument("--timeout", type=float, default=1200)
    parser.add_argument(
        "--after-warmups", action="store_true", help="our methods compressed from step 2 at their final density"
    )
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    check_methods(args.methods.split(","))
    if args.worker:
        worker(args)
        return 0
    if args.nodes is not None:
        if args.nodes < 2 or args.ranks_per_node < 1:
            parser.error("--nodes must be >= 2 and --ranks-per-node >= 1")
        args.ranks = args.nodes * args.ranks_per_node
    if args.ranks < 2 or args.steps < 1 or args.warmup < 2:
        parser.error("--ranks must be >= 2, --steps >= 1 and --warmup >= 2")
    if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None:
        print("benchmarks/network.py needs root and iproute2 (ip, tc) to build shaped network namespaces; exiting.")
        return 2

    from rich.console import Console
    from rich.table import Table

    # a SIGTERM (e.g. from `timeout`) must still run the namespace clean-up in `finally` and atexit
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    single = single_process_throughput(args)
    report: dict[str, Any] = {"ranks": args.ranks, "nodes": args.nodes, "batch": args.batch, "model": args.model,
                              "width": args.width, "single_process_images_per_s": single, "sync_every": args.sync_every,
                              "rates": {}}  # fmt: skip
    if args.model == "stdlib-lm":  # what the model is trained on elsewhere (here: random bytes of its shape)
        from lightning_gradcomp.examples.stdlib_corpus import read_stdlib_corpus

        report["corpus"] = read_stdlib_corpus().summary
    rates = args.rate or ["100mbit", "1gbit"]
    for rate in rates:
        network = Network(args.nodes, rate, args.ranks_per_node) if args.nodes else Network(args.ranks, rate)
        try:
            network.create()
            with tempfile.TemporaryDirectory() as tmp:
                out = str(Path(tmp) / "results.json")
                argv = [__file__, "--worker", "--out", out, "--methods", args.methods, "--steps", str(args.steps),
                        "--warmup", str(args.warmup), "--batch", str(args.batch), "--width", str(args.width),
                        "--model", args.model, "--sync-every", str(args.sync_every),
                        *(["--after-warmups"] if args.after_warmups else [])]  # fmt: skip
                network.launch(argv, args.timeout)
                report["rates"][rate] = json.loads(Path(out).read_text())
        finally:
            network.delete()
    unshaped = report["rates"].get("none", [])
    dense_unshaped = next((r["seconds_per_step"] for r in unshaped if r["method"] == "dense"), None)
    for rate, results in report["rates"].items():
        dense = next((r["images_per_s"] for r in results if r["method"] == "dense"), None)
        layout = f"{args.nodes} nodes x {args.ranks_per_node} ranks" if args.nodes else f"{args.ranks} ranks"
        table = Table(title=f"{args.model}, {layout}, links shaped to {rate}, batch {args.batch}/rank, "
                            f"single process {single:.0f} img/s")  # fmt: skip
        columns = ("method", "img/s", "s/step", "limit s/step", "x limit", "scaling eff.", "x dense",
                   "bytes sent/step", "received/step", "ratio", "link bytes/step", "note")  # fmt: skip
        for column in columns:
            table.add_column(column, justify="left" if column in ("method", "note") else "right")
        for r in results:
            r["scaling_efficiency"] = r["images_per_s"] / (args.ranks * single) if r["images_per_s"] else None
            r["speedup_vs_dense"] = r["images_per_s"] / dense if dense and r["images_per_s"] else None
            sent, received = r["bytes_sent_per_step"], r.get("bytes_received_per_step")
            limit = r["limit_seconds_per_step"] = step_limit(dense_unshaped, received, rate)
            table.add_row(
                r["method"], f"{r['images_per_s']:.1f}", f"{r['seconds_per_step']:.3f}",
                f"{limit:.3f}" if limit else "-", f"{r['seconds_per_step'] / limit:.2f}" if limit else "-",
                f"{r['scaling_efficiency']:.3f}" if r["scaling_efficiency"] else "-",
                f"{r['speedup_vs_dense']:.2f}" if r["speedup_vs_dense"] else "-",
                f"{sent:,.0f}" if sent else "-", f"{received:,.0f}" if received else "-",
                f"{r['dense_bytes_per_step'] / sent:.1f}x" if sent else "-",
                f"{r['link_bytes_per_step']:,.0f}" if r.get("link_bytes_per_step") is not None else "-", r["note"],
            )  # fmt: skip
        Console().print(table)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
