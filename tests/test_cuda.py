"""The codec kernels on a CUDA device give what they give on the CPU (skipped where no GPU is present).

Run with ``pytest -m cuda`` on a machine with a GPU. Each test computes the same thing on the CPU and on the
device and compares them bit for bit where the arithmetic is the same (selections, integer codes, casts),
else within the working precision that the stated cause (another summation order in a matrix product)
explains.
"""

from __future__ import annotations

import pytest
import torch

from lightning_gradcomp.core.comm.gtopk import SparseSet, merge
from lightning_gradcomp.core.compressors import qsgd, ternary
from lightning_gradcomp.core.compressors.atomo import AtomoCompressor
from lightning_gradcomp.core.compressors.blocks import streamed_above
from lightning_gradcomp.core.compressors.gaussiank import GaussianKCompressor
from lightning_gradcomp.core.compressors.indices import decode_indices, encode_indices
from lightning_gradcomp.core.compressors.precision import scaled_cast
from lightning_gradcomp.core.compressors.radix import magnitude_digits, radix_top_k
from lightning_gradcomp.core.compressors.segments import Segments
from lightning_gradcomp.core.compressors.topk import TopKCompressor, ascending_top_k
from lightning_gradcomp.core.fused import set_codec_mode
from lightning_gradcomp.core.host_copies import device_tensor
from lightning_gradcomp.core.host_waits import host_waits
from lightning_gradcomp.core.randomness import CounterStream

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

CUDA = torch.device("cuda")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("inclusive", [False, True])
def test_streamed_candidates_are_the_cpus(dtype: torch.dtype, inclusive: bool) -> None:
    x = torch.randn(3_000_001, generator=torch.Generator().manual_seed(0)).to(dtype)
    thr = float(x.abs()[17])
    assert torch.equal(streamed_above(x.to(CUDA), thr, inclusive).cpu(), streamed_above(x, thr, inclusive))


@pytest.mark.parametrize("k", [1, 250, 999])
def test_ascending_top_k_is_the_cpus_ties_included(k: int) -> None:
    magnitudes = torch.randint(0, 30, (1000,), generator=torch.Generator().manual_seed(k)).float()
    assert torch.equal(ascending_top_k(magnitudes.to(CUDA), k).cpu(), ascending_top_k(magnitudes, k))


def test_top_k_selects_the_cpus_entries_from_a_device_generator() -> None:
    x = torch.randn(2_000_000, generator=torch.Generator().manual_seed(1))
    codec = TopKCompressor(0.01)
    on_device = codec.compress(x.to(CUDA), torch.Generator(device=CUDA).manual_seed(2))
    on_cpu = codec.compress(x, torch.Generator().manual_seed(2))
    assert torch.equal(on_device.indices.cpu(), on_cpu.indices)
    assert torch.equal(on_device.to_bytes().cpu(), on_cpu.to_bytes())


def test_host_waits_counts_a_read_back() -> None:
    x = torch.ones(1000, device=CUDA)
    x.sum().item()  # the process's first read-back counted 2 waits on torch 2.11 (it allocates its pinned scalar)
    assert host_waits(lambda: x.sum().item(), CUDA) == 1 and host_waits(lambda: x.mul_(2), CUDA) == 0


def test_host_values_and_a_unit_in_pieces_reach_the_device_without_a_wait() -> None:
    x = torch.randn(3000, device=CUDA)
    made = [lambda: device_tensor([0, 7, 2**40], torch.int64, CUDA), lambda: Segments([x[:1000], x[1000:]])._bounds]
    for make in made:
        make()  # a first call allocates the pinned block of its size, outside the count
        assert host_waits(make, CUDA) == 0
    assert device_tensor([0, 7, 2**40], torch.int64, CUDA).tolist() == [0, 7, 2**40]


def selecting_by(codec: TopKCompressor, way: str) -> TopKCompressor:
    codec.device_selection = way
    return codec


@pytest.mark.parametrize(
    ("codec", "waits"),
    [
        (TopKCompressor(0.01), 0),
        (selecting_by(TopKCompressor(0.01), "radix"), 0),
        (selecting_by(TopKCompressor(0.01), "levels"), 1),
        (GaussianKCompressor(0.01), 1),
    ],
    ids=["topk-by-torch.topk", "topk-by-radix", "topk-by-levels", "gaussiank"],
)
def test_a_selection_on_the_device_waits_for_it_at_most_once(codec: TopKCompressor, waits: int) -> None:
    # torch.topk and the radix select never wait; the ladder's one read-back sizes the selection; the CPU's sampled
    # threshold and Gaussian_k's refinements read a count per try (391 waits for 1e8 entries)
    x = torch.randn(10_000_000, generator=torch.Generator().manual_seed(4)).to(CUDA)
    first = codec.compress(x, CounterStream(0, CUDA))  # a first call may wait where the allocator grows
    assert host_waits(lambda: codec.compress(x, CounterStream(1, CUDA)), CUDA) == waits
    on_cpu = codec.compress(x.cpu(), CounterStream(0))
    if codec.exact_count:  # an exact Top-k: the CPU's entries (continuous draws, no ties)
        assert torch.equal(first.indices.cpu(), on_cpu.indices)
    else:  # between k/2 and k of the largest entries
        kept = torch.zeros(x.numel(), dtype=torch.bool)
        kept[first.indices.cpu()] = True
        assert 50_000 <= int(kept.sum()) <= 100_000 and float(x.abs().cpu()[kept].min()) > float(
            x.abs().cpu()[~kept].max()
        )


@pytest.mark.parametrize(
    ("mode", "kind"),
    [
        ("compiled", "gaussian"),
        ("compiled", "ties"),
        *(("eager", kind) for kind in ["gaussian", "ties", "bf16", "pieces"]),
    ],
)
def test_the_radix_select_is_the_cpus_ties_included_and_never_waits(mode: str, kind: str) -> None:
    generator = torch.Generator().manual_seed(5)
    n, k = 20_000_003, 200_000  # two chunks of 2^24 and a part
    x = torch.randn(n, generator=generator)
    if kind == "ties":
        x = torch.randint(-3, 4, (n,), generator=generator).float()
    elif kind == "bf16":
        x = x.bfloat16()
    expected = ascending_top_k(x.float().abs(), k)
    on_device = x.to(CUDA)
    flat = Segments([on_device[:7_000_001], on_device[7_000_001:]]) if kind == "pieces" else on_device
    set_codec_mode(mode)
    compiled_before = magnitude_digits.compiled_calls
    try:
        assert torch.equal(radix_top_k(flat, k).cpu(), expected)
        assert host_waits(lambda: radix_top_k(flat, k), CUDA) == 0
        assert (magnitude_digits.compiled_calls > compiled_before) == (mode == "compiled")
    finally:
        set_codec_mode("eager")


@pytest.mark.parametrize("way", ["radix", "levels"])
def test_selections_by_histograms_under_deterministic_algorithms_select_by_torch_topk(way: str) -> None:
    x = torch.randn(1_000_000, generator=torch.Generator().manual_seed(6))
    torch.use_deterministic_algorithms(True)  # which refuses CUDA's histc
    try:
        on_device = selecting_by(TopKCompressor(0.01), way).compress(x.to(CUDA)).indices.cpu()
        kept = GaussianKCompressor(0.01).compress(x.to(CUDA), CounterStream(0, CUDA)).indices.cpu()
    finally:
        torch.use_deterministic_algorithms(False)
    assert torch.equal(on_device, ascending_top_k(x.abs(), 10_000))
    assert 5_000 <= kept.numel() <= 10_000  # Gaussian_k's count window, found by its refinements there


@pytest.mark.parametrize(("n", "k", "capacity"), [(25_000_000, 250_000, None), (1000, 600, None), (10**6, 5000, 8000)])
def test_index_bytes_are_the_cpus(n: int, k: int, capacity: int | None) -> None:
    indices = torch.randperm(n, generator=torch.Generator().manual_seed(3))[:k].sort().values
    encoded = encode_indices(indices.to(CUDA), n, capacity)
    assert torch.equal(encoded.cpu(), encode_indices(indices, n, capacity))
    assert torch.equal(decode_indices(encoded, n, k, capacity).cpu(), indices)


@pytest.mark.parametrize("wire", [torch.float16, torch.bfloat16])
def test_the_scaled_cast_is_the_cpus(wire: torch.dtype) -> None:
    x = torch.randn(3_000_000, generator=torch.Generator().manual_seed(4)) * 3e4
    on_device = scaled_cast(x.to(CUDA), 0.5, torch.empty(x.numel(), dtype=wire, device=CUDA))
    assert torch.equal(on_device.cpu(), scaled_cast(x, 0.5, torch.empty(x.numel(), dtype=wire)))


def test_gtopk_merge_is_the_cpus() -> None:
    gen = torch.Generator().manual_seed(5)
    a = SparseSet(torch.randperm(10**6, generator=gen)[:20_000].sort().values, torch.randn(20_000, generator=gen))
    b = SparseSet(torch.randperm(10**6, generator=gen)[:20_000].sort().values, torch.randn(20_000, generator=gen))
    merged = merge(
        SparseSet(a.indices.to(CUDA), a.values.to(CUDA)), SparseSet(b.indices.to(CUDA), b.values.to(CUDA)), 20_000
    )
    expected = merge(a, b, 20_000)
    assert torch.equal(merged.indices.cpu(), expected.indices) and torch.equal(merged.values.cpu(), expected.values)


def test_sketched_atoms_sum_to_the_gradient_on_the_device() -> None:
    gen = torch.Generator().manual_seed(6)
    layer = (torch.randn(512, 20, generator=gen) @ torch.randn(20, 3072, generator=gen)).to(CUDA)
    u, sigma, vh = AtomoCompressor(3).decompose(layer)
    eps = torch.finfo(torch.float32).eps
    assert float((u @ torch.diag(sigma) @ vh - layer).norm() / layer.norm()) < 100 * eps
    assert float((u.T @ u - torch.eye(512, device=CUDA)).abs().max()) < 100 * eps
    exact = torch.linalg.svdvals(layer.double())
    assert float(sigma.double().sum()) <= 1.05 * float(exact.sum())


@pytest.mark.parametrize("kind", ["ternary", "levels"])
def test_codes_drawn_into_packed_bytes_on_the_device_are_the_int8_draw_packed(kind: str) -> None:
    # on the device: the chunked draw packed as it goes, with the tied elements stepped in their bytes (a uint8
    # index_add_ with repeated bytes), against the device's own int8 draw packed afterwards
    numel = 3 * ternary.ENCODE_CHUNK + 5
    g = torch.randn(numel, generator=torch.Generator().manual_seed(4)).to(CUDA)
    norms = g.view(-1)[: numel - numel % 512].view(-1, 512).norm(dim=1)
    norms = torch.cat([norms, g[numel - numel % 512 :].norm().reshape(1)])
    draws = [torch.Generator(device=CUDA).manual_seed(5) for _ in range(2)]
    if kind == "levels":
        packing = qsgd.level_packing(7)
        codes = ternary.stochastic_levels(g, 7 / norms, 512, draws[0], levels=7)
        packed = ternary.stochastic_levels(g, 7 / norms, 512, draws[1], packing, _bytes(packing, numel), levels=7)
        expected = qsgd.pack_levels(codes, 7)
    else:
        codes = ternary.stochastic_ternary(g, norms, 512, draws[0])
        packed = ternary.stochastic_ternary(g, norms, 512, draws[1], packed=_bytes(ternary.TERNARY_PACKING, numel))
        expected = ternary.pack_2bit(codes)
    assert torch.equal(packed.cpu(), expected.cpu())
    assert packed.device.type == "cuda"


def _bytes(packing: ternary.CodePacking, numel: int) -> torch.Tensor:
    return torch.empty(packing.nbytes(numel), dtype=torch.uint8, device=CUDA)
