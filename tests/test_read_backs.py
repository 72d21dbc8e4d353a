"""What in a compressed step would make a GPU's host wait, counted on the CPU: the operations that read a device
tensor back (``.item()``, ``float()``, ``bool()``, ``tolist()``, ``nonzero``) and the copies of host values made from
pageable memory (``torch.tensor(..., device=...)``, which on CUDA waits for the copy).
``lightning_gradcomp.core.host_copies`` copies from pinned memory instead, which does not wait, so its copies are not
counted.

On a GPU ``host_waits`` counts the waits themselves (``tests/test_cuda.py``); this catches a new one in CI, where no GPU
is. The paths a device takes are counted on the CPU under ``cpu_as_a_device`` (Top-k's CPU selection reads counts
that its device selection does not; a memory's finiteness check is a bool on the CPU and a flag on a device).
"""

from __future__ import annotations

import collections
import contextlib
import os
import tempfile
import traceback
from collections.abc import Iterator
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_gradcomp import NAMED_STRATEGIES, gradcomp_comm_hook, make_hook
from lightning_gradcomp.core.compressors.segments import Segments
from lightning_gradcomp.core.compressors.sparse import SparseEntries
from lightning_gradcomp.core.host_copies import device_tensor
from lightning_gradcomp.core.host_waits import cpu_as_a_device

READS_BACK = {"_local_scalar_dense", "nonzero", "masked_select", "_unique2", "unique_dim", "repeat_interleave"}


class ReadBacks(TorchDispatchMode):
    """Counts, by operation, what would wait for a device (the comm hook runs on autograd's thread, which the mode
    reaches: torch carries it to the backward pass)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name.split("::")[-1]
        if name in READS_BACK:
            self.counts[name] += 1
        elif name == "lift_fresh" and not any(f.filename.endswith("host_copies.py") for f in traceback.extract_stack()):
            self.counts["copy from pageable memory"] += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def counting_read_backs() -> Iterator[collections.Counter[str]]:
    """:class:`ReadBacks`' counts of what runs inside, ``tolist()`` among them (a read-back that dispatches no
    operation)."""
    counting = ReadBacks()
    tolist = torch.Tensor.tolist

    def counted_tolist(self: torch.Tensor) -> object:
        counting.counts["tolist"] += 1
        return tolist(self)

    torch.Tensor.tolist = counted_tolist
    try:
        with counting:
            yield counting.counts
    finally:
        torch.Tensor.tolist = tolist


@pytest.fixture(scope="module")
def group() -> dist.ProcessGroup:
    with tempfile.TemporaryDirectory() as directory:
        store = dist.FileStore(os.path.join(directory, "store"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=timedelta(seconds=60))
        try:
            yield dist.group.WORLD
        finally:
            dist.destroy_process_group()


def read_backs_in_a_step(preset: str | None) -> collections.Counter[str]:
    """What one compressed step of a 1-process DDP of a 3-layer MLP under ``preset`` reads back (``None``: plain)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 64))
    ddp = DistributedDataParallel(net, bucket_cap_mb=0.1)  # units spread over several buckets, some read in pieces
    if preset is not None:
        overrides = {"warmup_steps": 1, "min_compress_numel": 100, "keep_last_layer_dense": False}
        if NAMED_STRATEGIES[preset][1].get("adaptive"):
            overrides["adaptive"] = "none"
        ddp.register_comm_hook(make_hook(ddp, preset, **overrides), gradcomp_comm_hook)
    optimizer = torch.optim.SGD(net.parameters(), lr=1e-3)
    x, y = torch.randn(32, 64), torch.randn(32, 64)

    def step() -> None:
        optimizer.zero_grad()
        nn.functional.mse_loss(ddp(x), y).backward()
        optimizer.step()

    for _ in range(3):
        step()
    with counting_read_backs() as counts:
        step()
    return counts


def test_the_counter_sees_a_read_back_on_the_hooks_thread(group: dist.ProcessGroup) -> None:
    assert read_backs_in_a_step("ddp_gtopk")["_local_scalar_dense"] > 0  # gTop-k reads its merge's counts
    assert not read_backs_in_a_step(None)


@pytest.mark.parametrize("preset", ["ddp_fp16", "ddp_bf16", "ddp_int8", "ddp_terngrad"])
def test_the_dense_wires_int8_and_terngrad_read_nothing_back(group: dist.ProcessGroup, preset: str) -> None:
    assert not read_backs_in_a_step(preset)


#: What a compressed step reads back on a device's paths, by strategy: only the cuts of a unit's entries at its
#: parameters' bounds where the unit is read in pieces from DDP's buckets (one read each: the gather from the pieces,
#: the split for the memory, the scatter into the pieces), Gaussian_k's ladder of levels (one), and gTop-k's check
#: that the indices ascend and the positions of the entries that survived its merges (one each).
ON_A_DEVICE = {
    "ddp_fp16": {},
    "ddp_bf16": {},
    "ddp_int8": {},
    "ddp_terngrad": {},
    "ddp_efsign": {},
    "ddp_diana": {},
    "ddp_powersgd": {},
    "ddp_topk": {"tolist": 3},
    "ddp_gaussiank": {"tolist": 4},
    "ddp_gtopk": {"tolist": 3, "_local_scalar_dense": 1, "nonzero": 1},
}


@pytest.mark.parametrize("preset", sorted(ON_A_DEVICE))
def test_a_step_on_the_device_paths_reads_back_only_the_cuts_it_must(group: dist.ProcessGroup, preset: str) -> None:
    """Catches: a finiteness check read back (error feedback's, DIANA's, the mean's, PowerSGD's warm start) where
    a flag on the device would do, and any new read on the paths a GPU takes."""
    with cpu_as_a_device():
        assert dict(read_backs_in_a_step(preset)) == ON_A_DEVICE[preset]


def test_host_values_reach_a_device_as_torch_tensor_makes_them() -> None:
    for values, dtype in (([0, 5, 2**40], torch.int64), ([1.5, -2.0], torch.float32), ([-7, 3], torch.int32)):
        made = device_tensor(values, dtype, "cpu")
        assert made.dtype == dtype and torch.equal(made, torch.tensor(values, dtype=dtype))


def test_a_sparse_mean_cut_by_parameter_and_routed_to_pieces_reads_back_once_each() -> None:
    """Ascending indices: whether they ascend and where the cuts fall are read back together (one wait on a GPU)."""
    indices = torch.tensor([3, 10, 999, 1000, 1500, 2999])
    entries = SparseEntries(indices, torch.arange(6.0), 3000)
    with counting_read_backs() as counts:
        parts = entries.split([1000, 2000])
    assert dict(counts) == {"tolist": 1}
    assert [p.indices.tolist() for p in parts] == [[3, 10, 999], [0, 500, 1999]]
    pieces = Segments([torch.arange(1000.0), torch.arange(1000.0, 3000.0)])
    with counting_read_backs() as counts:
        gathered = pieces.gather(indices)
    assert counts["tolist"] == 1 and counts["_local_scalar_dense"] == 0
    assert gathered.tolist() == [3.0, 10.0, 999.0, 1000.0, 1500.0, 2999.0]
