"""Where a unit is compressed: by every rank across the world, or once per node between nodes.

A cluster's links inside a node (NVLink, PCIe, shared memory) are fast; the links between nodes
are the slow ones. :class:`FlatTopology` (the default) treats every link as slow: every rank
compresses every unit and exchanges it with every other rank. :class:`NodeTopology` spends the
fast links on dense sums and the slow ones on compressed payloads, one per node instead of one
per rank, as Horovod and BytePS do for dense gradients. A unit's trip under it:

1. **Dense inside the node.** The node's ranks sum the unit with one allreduce over the node's
   group and scale it by ``N / P`` (``N`` nodes, ``P`` ranks): node ``n`` then holds
   ``c_n = (N / P) sum_{ranks of n} g``, whose mean over the nodes is the mean over all ``P``
   ranks, for nodes of unequal size too.
2. **Compressed between nodes.** Each unit has one *owner* per node, which compresses ``c_n``
   (its error feedback residual or DIANA shift lives there, and only there) and aggregates it
   with the owners on the other nodes. ``scheme="sharded"`` spreads the units over the node's
   first ``S`` local ranks (``S`` the smallest node's size; unit ``i`` to local rank ``i mod S``):
   each local rank compresses a share and exchanges it with the same local rank on the other
   nodes, a reduce-scatter inside the node followed by ``S`` inter-node exchanges in parallel,
   then an allgather inside the node. ``scheme="leader"`` gives every unit to local rank 0, the
   node leader, which alone talks to the other nodes.
3. **Shared inside the node.** The node's ranks sum, in one allreduce over the node's group,
   what they hold of the exchange's units: the owner its estimate, every other rank zeros.
   Adding zeros is exact, so every rank ends with the owner's estimate bit for bit, and, the
   owners' estimates being equal across nodes (they come out of one collective), every rank of
   the world holds the same gradient.

The hook's dense warm-up steps stay DDP's own allreduce over the world. Which scheme is faster
is measured, not assumed: ``benchmarks/network.py --nodes 2`` runs both.
Bytes handed to the node's group are counted apart from the others (``StepStats``'s
``bytes_sent_intra_node``), so what crossed the slow links is what ``bytes_sent`` counts.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_gradcomp.core.comm.collectives import Collectives
from lightning_gradcomp.core.comm.counter import CommCounter
from lightning_gradcomp.core.validation import check_choice

#: The strategy's ``hierarchy`` values: every rank alike, or dense inside nodes and compressed between them.
HIERARCHIES = ("none", "node")
#: The ways :class:`NodeTopology` assigns each unit an owner on every node.
SCHEMES = ("sharded", "leader")


def node_id_from_environment() -> str:
    """This process's node: torchrun's ``GROUP_RANK``, else Lightning's ``NODE_RANK``, else the host name.

    (Emulated nodes on one machine share a host name but not their launcher's node rank.)
    """
    for variable in ("GROUP_RANK", "NODE_RANK"):
        value = os.environ.get(variable)
        if value is not None:
            return f"node-{value}"
    return f"host-{socket.gethostname()}"


@dataclass(frozen=True)
class NodeLayout:
    """The ranks of each node: ``nodes[n]`` the global ranks on node ``n`` (ascending), nodes by first rank."""

    nodes: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        ranks = sorted(r for node in self.nodes for r in node)
        if not self.nodes or any(not node for node in self.nodes) or ranks != list(range(len(ranks))):
            raise ValueError(f"nodes must split ranks 0..P-1 into non-empty groups, got {self.nodes}")

    @classmethod
    def of(cls, node_ids: Sequence[object]) -> NodeLayout:
        """The layout of ranks whose node ids (any equality-comparable label) are ``node_ids[rank]``."""
        nodes: dict[object, list[int]] = {}
        for rank, node in enumerate(node_ids):
            nodes.setdefault(node, []).append(rank)
        return cls(tuple(tuple(ranks) for ranks in nodes.values()))

    @classmethod
    def gather(cls, node_id: object) -> NodeLayout:
        """Every rank's node id, gathered from the world (a collective: every rank calls it)."""
        ids: list[object] = [None] * dist.get_world_size()
        dist.all_gather_object(ids, node_id)
        return cls.of(ids)

    @property
    def world_size(self) -> int:
        return sum(len(node) for node in self.nodes)

    @property
    def slots(self) -> int:
        """Local ranks that exist on every node: the most owners a unit can have per node."""
        return min(len(node) for node in self.nodes)

    def locate(self, rank: int) -> tuple[int, int]:
        """``(node, local index)`` of global ``rank``."""
        for n, node in enumerate(self.nodes):
            if rank in node:
                return n, node.index(rank)
        raise ValueError(f"rank {rank} is on no node of {self.nodes}")


class FlatTopology:
    """Every rank compresses every unit and exchanges it with every rank (no node structure)."""

    def __init__(self, collectives: Collectives) -> None:
        self.collectives = collectives
        self.intra_counter: CommCounter | None = None

    def enter_(self, tensors: Sequence[Tensor]) -> None:
        """Nothing to sum before compression: each rank compresses its own gradient."""

    def owns(self, unit_index: int) -> bool:
        return True

    def share_(self, tensors: Sequence[Tensor]) -> None:
        """Nothing to share: every rank computed every unit's estimate."""

    def describe(self) -> str:
        return "flat"


class NodeTopology:
    """Dense sums inside each node, compression and exchange between nodes (see the module docstring).

    Args:
        layout: which ranks share a node (:meth:`NodeLayout.gather`); at least two nodes.
        scheme: ``"sharded"`` (units spread over the node's local ranks) or ``"leader"`` (local rank 0).
        counter: counts the inter-node collectives (the hook's own counter: they are its ``bytes_sent``).
        timeout: of the process groups created here.

    Every rank must build it, in the same order as every other rank: it creates one group per node
    and one per owner slot, and ``torch.distributed.new_group`` is a collective over the world.
    """

    def __init__(
        self,
        layout: NodeLayout,
        scheme: str = "sharded",
        counter: CommCounter | None = None,
        timeout: timedelta | None = None,
    ) -> None:
        check_choice("hierarchy_scheme", scheme, SCHEMES)
        if len(layout.nodes) < 2:
            raise ValueError(f"a node topology needs at least two nodes, got {layout.nodes}")
        if layout.world_size != dist.get_world_size():
            raise ValueError(f"the layout has {layout.world_size} ranks, the world {dist.get_world_size()}")
        self.layout = layout
        self.scheme = scheme
        self.nodes = len(layout.nodes)
        self.owner_slots = layout.slots if scheme == "sharded" else 1
        self.node, self.local_index = layout.locate(dist.get_rank())
        # new_group is collective over the world: every rank creates every group, in this order
        intra = [dist.new_group(list(node), timeout=timeout) for node in layout.nodes]
        inter = [dist.new_group([node[s] for node in layout.nodes], timeout=timeout) for s in range(self.owner_slots)]
        self.intra_counter = CommCounter()
        self.intra = Collectives(intra[self.node], self.intra_counter)
        self.node_size = len(layout.nodes[self.node])
        self._weight = self.nodes / layout.world_size
        self.counter = counter if counter is not None else CommCounter()
        slot = self.local_index if self.local_index < self.owner_slots else None
        self.collectives: Collectives | None = Collectives(inter[slot], self.counter) if slot is not None else None

    def enter_(self, tensors: Sequence[Tensor]) -> None:
        """Replace each unit's tensor by its node's ``(N / P)``-weighted sum: one allreduce per tensor over the
        node's group (each alone, so a float sum's order depends on the unit, not on what travels with it)."""
        launched = [self.intra.all_reduce_start(t) for t in tensors] if self.node_size > 1 else []
        for reduction in launched:
            reduction.wait()
        for t in tensors:
            t.mul_(self._weight)

    def owner_slot(self, unit_index: int) -> int:
        """The local rank that compresses unit ``unit_index`` on every node."""
        return unit_index % self.owner_slots

    def owns(self, unit_index: int) -> bool:
        """Whether this rank compresses unit ``unit_index`` for its node."""
        return self.local_index == self.owner_slot(unit_index)

    def share_(self, tensors: Sequence[Tensor]) -> None:
        """Give every rank of the node the owners' estimates: non-owners hold zeros in ``tensors``
        (the caller zeroed them), so one exact sum over the node's group completes every tensor."""
        if self.node_size == 1 or not tensors:
            return
        flat = torch.cat([t.reshape(-1) for t in tensors]) if len(tensors) > 1 else tensors[0].reshape(-1).clone()
        self.intra.all_reduce_(flat)
        for t, summed in zip(tensors, flat.split([t.numel() for t in tensors]), strict=True):
            t.copy_(summed.view_as(t))

    def describe(self) -> str:
        sizes = "/".join(str(len(node)) for node in self.layout.nodes)
        return f"{self.nodes} nodes ({sizes} ranks), {self.scheme}, {self.owner_slots} owner(s) per node"
