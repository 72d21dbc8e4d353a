"""Two emulated nodes, as on a cluster: a network namespace per node joined by a shaped veth pair,
each node's two ranks started by its own ``torchrun --nnodes 2 --node_rank I`` (needs root and
iproute2; skipped otherwise). The ranks of a node talk over its loopback, the nodes over the link.

Only addresses assigned here, inside namespaces created here, are used; the namespaces are
deleted whatever happens.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from ranks import free_port
from test_hierarchy import check_two_by_two_run

TESTS = Path(__file__).resolve().parent
SUBNET = "10.214.0"

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None,
    reason="emulated nodes need root and iproute2 (ip, tc) for network namespaces",
)


class TwoNodes:
    """Namespaces ``<tag>n0`` and ``<tag>n1`` joined by a veth pair shaped both ways with ``tc tbf``."""

    def __init__(self, rate: str = "1gbit") -> None:
        self.tag = f"gct{os.getpid() % 100000}"
        self.names = [f"{self.tag}n0", f"{self.tag}n1"]
        self.rate = rate

    def __enter__(self) -> TwoNodes:
        try:
            for ns in self.names:
                self._ip("netns", "add", ns)
            self._ip("link", "add", f"{self.tag}a", "type", "veth", "peer", "name", f"{self.tag}b")
            for i, (ns, end) in enumerate(zip(self.names, ("a", "b"), strict=True)):
                self._ip("link", "set", f"{self.tag}{end}", "netns", ns)
                self._ip("-n", ns, "link", "set", f"{self.tag}{end}", "name", "eth0")
                self._ip("-n", ns, "addr", "add", f"{SUBNET}.{i + 1}/24", "dev", "eth0")
                self._ip("-n", ns, "link", "set", "eth0", "up")
                self._ip("-n", ns, "link", "set", "lo", "up")
                shape = ["tbf", "rate", self.rate, "burst", "256kbit", "latency", "50ms"]
                self._ip("netns", "exec", ns, "tc", "qdisc", "add", "dev", "eth0", "root", *shape)
        except BaseException:
            self.delete()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.delete()

    @staticmethod
    def _ip(*args: str) -> None:
        subprocess.run(["ip", *args], check=True, capture_output=True, text=True)

    def delete(self) -> None:
        for ns in self.names:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)

    def tx_bytes(self, node: int) -> int:
        counter = "/sys/class/net/eth0/statistics/tx_bytes"
        command = ["ip", "netns", "exec", self.names[node], "cat", counter]
        done = subprocess.run(command, check=True, capture_output=True)
        return int(done.stdout)


def test_torchrun_on_two_emulated_nodes_trains_hierarchically(tmp_path: Path) -> None:
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="eth0",
               PYTHONPATH=os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]))  # fmt: skip
    with TwoNodes() as nodes:
        before = [nodes.tx_bytes(n) for n in range(2)]
        launch = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "2",
                  "--master_addr", f"{SUBNET}.1", "--master_port", str(port)]  # fmt: skip
        script = [str(TESTS / "node_train.py"), str(tmp_path)]
        procs = []
        for i, ns in enumerate(nodes.names):
            command = ["ip", "netns", "exec", ns, *launch, "--node_rank", str(i), *script]
            procs.append(subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
        try:
            logs = [p.communicate(timeout=240)[0].decode(errors="replace") for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
        crossed = sum(nodes.tx_bytes(n) - before[n] for n in range(2))
    assert all(p.returncode == 0 for p in procs), "\n".join(log[-3000:] for log in logs)
    results = [torch.load(tmp_path / f"{rank}.pt", weights_only=False) for rank in range(4)]
    assert [r["node_rank"] for r in results] == [0, 0, 1, 1]
    assert results[0]["environment"] == "TorchElasticEnvironment"
    check_two_by_two_run(results)
    # what the collectives between nodes were handed crossed the link (plus TCP/IP headers and the
    # launchers' rendezvous); the dense sums inside the nodes did not
    inter = sum(s.bytes_sent for r in results for s in r["history"])
    intra = sum(s.bytes_sent_intra_node for r in results for s in r["history"])
    assert inter <= crossed < inter + intra
