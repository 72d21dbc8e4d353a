"""Why the compiled decodes of packed codes ran at a fraction of memory speed on the CPU, and what a planar layout buys.

Packed interleaved, code ``j`` lies in byte ``j // per_byte`` (QSGD's 4-bit levels two to a byte, as the wire packs
them; the scaled signs eight, as the wire packed them before its planar rows). Inductor's C++ loop over the decoded
elements then reads each element's byte with one scalar load (it fills a vector lane by lane), so a compiled mean of
the ranks' payloads runs well below memory speed. In a *planar* layout the fields of one byte are elements a stripe
apart (byte ``b`` of a block of ``B`` levels holds levels ``b`` and ``b + B / 2``; of a row of ``8 R`` signs, signs
``b, b + R, ..., b + 7 R``: the scaled signs' wire now), so every load and store is contiguous. This script times, for
one 4096 x 4096 layer on one CPU thread (or ``--device cuda``), each mean both ways, with a compiled fill of the layer
as the floor (writing the mean is most of the traffic):

* the mean of two ranks' 4-bit levels, one scale per block of 512 (DIANA's and QSGD's): the library's kernel on the
  wire (interleaved) against a planar prototype;
* the mean of two ranks' scaled signs (EF-sign's): an interleaved prototype (the kernel as it was) against the
  library's kernel on the planar wire;
* QSGD's 4-bit levels of a layer drawn (one counter hash per element) and packed: the library's kernel against the
  same draws packed planar.

Each prototype's mean equals the library's on the same codes, and the planar draw's codes are the library's, element
for element (checked before timing). The prototypes are not wire formats the library reads.

    python benchmarks/field_layout.py --json benchmarks/results/field_layout_cpu.json
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor

from lightning_gradcomp.core.compressors.kernels import _codes_of, draw_packed_codes, mean_of_fields_, mean_of_signs_
from lightning_gradcomp.core.compressors.sign import pack_signs
from lightning_gradcomp.core.fused import set_codec_mode
from lightning_gradcomp.core.randomness import CounterStream, hash_at

LAYER = 4096 * 4096
BLOCK, BIAS = 512, 8  # QSGD's 4-bit levels: 7 levels each side, field = level + 8


def best_ms(fn: Callable[[], object], repeats: int, device: torch.device) -> float:
    """The fastest of ``repeats`` calls after two untimed ones (compiling), in milliseconds."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return 1e3 * min(times)


def planar_levels(fields: Tensor) -> Tensor:
    """The uint8 fields (one per code, interleaved order) packed planar: byte ``b`` of a block holds codes ``b`` (low
    nibble) and ``b + BLOCK / 2`` (high)."""
    blocks = fields.view(-1, 2, BLOCK // 2).to(torch.int32)
    return (blocks[:, 0] | (blocks[:, 1] << 4)).to(torch.uint8).reshape(-1)


def planar_levels_mean_(out: Tensor, packs: list[Tensor], scales: list[Tensor]) -> None:
    """The mean of the ranks' planar 4-bit levels times their block scales, as ``mean_of_fields_`` sums and divides."""
    blocks = out.numel() // BLOCK
    shifts = torch.tensor([0, 4], dtype=torch.int32, device=out.device).view(1, 2, 1)
    total = None
    for packed, scale in zip(packs, scales, strict=True):
        fields = (packed.view(blocks, 1, BLOCK // 2).to(torch.int32) >> shifts) & 15
        values = (fields - BIAS).to(torch.float32) * scale.view(blocks, 1, 1)
        total = values if total is None else total + values
    assert total is not None
    out.view(blocks, 2, BLOCK // 2).copy_(total / len(packs))


def interleaved_signs_mean_(out: Tensor, packs: list[Tensor], scales: list[Tensor], table: Tensor) -> None:
    """The mean of the ranks' scaled signs packed interleaved (byte ``b`` holds signs ``8 b .. 8 b + 7``): row ``b`` of
    ``table`` is byte ``b``'s eight signs; the kernel as it was before the planar rows."""
    total = table[packs[0].to(torch.int32)] * scales[0]
    for rank in range(1, len(packs)):
        total = total + table[packs[rank].to(torch.int32)] * scales[rank]
    out.view(total.shape).copy_(total / len(packs))


def planar_draw(g: Tensor, multipliers: Tensor, block: Tensor) -> Tensor:
    """QSGD's 4-bit levels of ``g`` (whole blocks of ``BLOCK``) drawn as ``draw_packed_codes`` draws them (element
    ``j`` from counter ``j``) and packed planar: each half of a block is read contiguously."""
    blocks, half = g.numel() // BLOCK, BLOCK // 2
    columns = g.view(blocks, 2, half)
    rows = BLOCK * torch.arange(blocks, dtype=torch.int32, device=g.device)[:, None]
    rows = rows + torch.arange(half, dtype=torch.int32, device=g.device)
    column = multipliers[:, None]
    packed = None
    for p in range(2):
        codes = _codes_of(columns[:, p], lambda v: v * column, hash_at(block, rows + p * half), None, True)
        field = (codes.to(torch.int32) + BIAS) << (4 * p)
        packed = field if packed is None else packed | field
    assert packed is not None
    return packed.to(torch.uint8).reshape(-1)


def interleaved(fields: Tensor, per_byte: int) -> Tensor:
    """Fields (one per code) packed as the wire does: code ``j`` in byte ``j // per_byte``, the first lowest."""
    width = 8 // per_byte
    columns = fields.view(-1, per_byte).to(torch.int32)
    packed = columns[:, 0]
    for k in range(1, per_byte):
        packed = packed | (columns[:, k] << (width * k))
    return packed.to(torch.uint8)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cpu", help="cpu (one thread) or cuda")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.set_num_threads(1)
    set_codec_mode("compiled")
    generator = torch.Generator().manual_seed(0)
    out, floor_out = torch.empty(LAYER, device=device), torch.empty(LAYER, device=device)

    fields = [torch.randint(1, 16, (LAYER,), dtype=torch.uint8, generator=generator).to(device) for _ in range(2)]
    scales = [torch.rand(LAYER // BLOCK, generator=generator).to(device) for _ in range(2)]
    wire_levels = [interleaved(f, 2) for f in fields]
    flat_levels = [planar_levels(f) for f in fields]
    signed = [torch.randn(LAYER, generator=generator).to(device) for _ in range(2)]
    magnitudes = [torch.rand((), generator=generator).to(device) for _ in range(2)]
    old_signs = [interleaved((x >= 0).to(torch.uint8), 8) for x in signed]
    wire_signs = [pack_signs(x) for x in signed]
    bits = (torch.arange(256, device=device).unsqueeze(1) >> torch.arange(8, device=device)) & 1
    table = (2 * bits - 1).to(torch.float32)

    levels_planar = torch.compile(planar_levels_mean_, dynamic=False, fullgraph=True)
    signs_interleaved = torch.compile(interleaved_signs_mean_, dynamic=False, fullgraph=True)
    fill = torch.compile(lambda o, s: o.copy_(s.expand(o.shape) * 2), dynamic=False, fullgraph=True)

    check = torch.empty_like(out)
    mean_of_fields_(out, wire_levels, scales, BLOCK, 2, BIAS)
    levels_planar(check, flat_levels, scales)
    assert torch.equal(out, check), "the planar levels' mean differs from the wire's"
    mean_of_signs_(out, wire_signs, magnitudes)
    signs_interleaved(check, old_signs, magnitudes, table)
    assert torch.equal(out, check), "the interleaved signs' mean differs from the wire's"

    gradient = torch.randn(LAYER, generator=generator).to(device)
    multipliers = 7 / gradient.view(-1, BLOCK).norm(dim=1)
    block = CounterStream(3, device).block(LAYER)
    draw_planar = torch.compile(planar_draw, dynamic=False, fullgraph=True)
    wire_draw = draw_packed_codes(gradient, multipliers, block, None, 0, BLOCK, True, BIAS, 2, BIAS)
    planar = draw_planar(gradient, multipliers, block).view(-1, BLOCK // 2).to(torch.int32)
    by_element = torch.stack([planar & 15, planar >> 4], 1).reshape(-1)
    wire = wire_draw.to(torch.int32)
    assert torch.equal(by_element, torch.stack([wire & 15, wire >> 4], 1).reshape(-1)), "the planar draw differs"

    rows = {
        "floor: a compiled fill of the layer": best_ms(lambda: fill(floor_out, magnitudes[0]), args.repeats, device),
        "4-bit levels, mean of 2 ranks, wire (interleaved)": best_ms(
            lambda: mean_of_fields_(out, wire_levels, scales, BLOCK, 2, BIAS), args.repeats, device
        ),
        "4-bit levels, mean of 2 ranks, planar prototype": best_ms(
            lambda: levels_planar(out, flat_levels, scales), args.repeats, device
        ),
        "scaled signs, mean of 2 ranks, interleaved prototype (the wire before)": best_ms(
            lambda: signs_interleaved(out, old_signs, magnitudes, table), args.repeats, device
        ),
        "scaled signs, mean of 2 ranks, wire (planar rows)": best_ms(
            lambda: mean_of_signs_(out, wire_signs, magnitudes), args.repeats, device
        ),
        "4-bit levels drawn and packed, wire (interleaved)": best_ms(
            lambda: draw_packed_codes(gradient, multipliers, block, None, 0, BLOCK, True, BIAS, 2, BIAS),
            args.repeats,
            device,
        ),
        "4-bit levels drawn and packed, planar prototype": best_ms(
            lambda: draw_planar(gradient, multipliers, block), args.repeats, device
        ),
    }
    where = "one CPU thread" if device.type == "cpu" else torch.cuda.get_device_name(device)
    print(f"{LAYER} elements, {where}, torch {torch.__version__}, best of {args.repeats} (ms)")
    for what, ms in rows.items():
        print(f"{what}: {ms:.2f}")
    if args.json:
        machine = {"device": where, "torch": torch.__version__, "machine": platform.machine()}
        args.json.write_text(json.dumps({"elements": LAYER, **machine, "ms": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
