"""Why the compiled decodes of packed codes ran at a fraction of memory speed on the CPU, and what the planar rows buy.

Packed interleaved, code ``j`` lies in byte ``j // per_byte`` (the wire before its planar rows: QSGD's 4-bit levels
two to a byte, ternary codes four, the scaled signs eight). Inductor's C++ loop over the decoded elements then reads
each element's byte with one scalar load (it fills a vector lane by lane), so a compiled mean of the ranks' payloads
runs well below memory speed. In the planar rows (the wire now) the fields of one byte are elements a stripe of 512
apart, so every load and store is contiguous. This script times, for one 4096 x 4096 layer on one CPU thread (or
``--device cuda``), each operation both ways, with a compiled fill of the layer as the floor (writing the mean is most
of the traffic):

* the mean of two ranks' 4-bit levels, one scale per block of 512 (DIANA's and QSGD's);
* the mean of two ranks' ternary codes under one shared scale (TernGrad's);
* the mean of two ranks' scaled signs (EF-sign's);
* QSGD's 4-bit levels of a layer drawn (one counter hash per element) and packed.

Each interleaved prototype (the kernel as it was) gives the library's result on the same codes, and its draw the
library's codes, element for element (checked before timing). The prototypes are not wire formats the library reads.

    python benchmarks/field_layout.py --json benchmarks/results/field_layout_planar_cpu.json
"""

from __future__ import annotations

import json
import platform

import torch
from timing import best_ms, kernel_device, kernel_parser
from torch import Tensor

from lightning_gradcomp.core.compressors.kernels import (
    _codes_of,
    draw_packed_codes,
    mean_of_fields_,
    mean_of_signs_,
    mean_of_summed_fields_,
)
from lightning_gradcomp.core.compressors.planar import STRIPE, fields_of_rows, pack_fields
from lightning_gradcomp.core.compressors.sign import pack_signs
from lightning_gradcomp.core.fused import set_codec_mode
from lightning_gradcomp.core.randomness import CounterStream, hash_at

LAYER = 4096 * 4096
BLOCK, BIAS = 512, 8  # QSGD's 4-bit levels: 7 levels each side, field = level + 8


def interleaved_fields(packed: Tensor, per_byte: int, row: int) -> Tensor:
    """The int32 fields of interleaved bytes in element order, shaped ``(rows, row)``: code ``j`` in field
    ``j % per_byte`` of byte ``j // per_byte`` (the decode the compiled means ran before the planar rows, a row of
    ``row`` codes at a time)."""
    width = 8 // per_byte
    j = torch.arange(row, dtype=torch.int32, device=packed.device)
    words = packed.view(-1, row // per_byte)[:, j // per_byte].to(torch.int32)
    return (words >> ((j & (per_byte - 1)) * width)) & ((1 << width) - 1)


def interleaved_levels_mean_(out: Tensor, packs: list[Tensor], scales: list[Tensor]) -> None:
    """The mean of the ranks' interleaved 4-bit levels times their block scales, summed and divided as
    ``mean_of_fields_`` does."""
    total = None
    for packed, scale in zip(packs, scales, strict=True):
        values = (interleaved_fields(packed, 2, BLOCK) - BIAS).to(torch.float32) * scale[:, None]
        total = values if total is None else total + values
    assert total is not None
    out.view(total.shape).copy_(total / len(packs))


def interleaved_ternary_mean_(out: Tensor, packs: list[Tensor], scale: Tensor) -> None:
    """The mean of the ranks' interleaved ternary codes under one shared scale: the codes summed as integers, scaled
    once, divided (``mean_of_summed_fields_``'s arithmetic)."""
    total = None
    for packed in packs:
        codes = interleaved_fields(packed, 4, 512) - 1
        total = codes if total is None else total + codes
    assert total is not None
    out.view(total.shape).copy_(total.to(scale.dtype) * scale / len(packs))


def interleaved_signs_mean_(out: Tensor, packs: list[Tensor], scales: list[Tensor], table: Tensor) -> None:
    """The mean of the ranks' scaled signs packed interleaved (byte ``b`` holds signs ``8 b .. 8 b + 7``): row ``b`` of
    ``table`` is byte ``b``'s eight signs; the kernel as it was before the planar rows."""
    total = table[packs[0].to(torch.int32)] * scales[0]
    for rank in range(1, len(packs)):
        total = total + table[packs[rank].to(torch.int32)] * scales[rank]
    out.view(total.shape).copy_(total / len(packs))


def interleaved_draw(g: Tensor, multipliers: Tensor, block: Tensor) -> Tensor:
    """QSGD's 4-bit levels of ``g`` (whole blocks of ``BLOCK``) drawn as ``draw_packed_codes`` draws them (element
    ``j`` from counter ``j``), packed interleaved, each byte's two codes drawn side by side (the kernel as it was)."""
    blocks, per_row = g.numel() // BLOCK, BLOCK // 2
    columns = g.view(blocks, per_row, 2)
    starts = BLOCK * torch.arange(blocks, dtype=torch.int32, device=g.device)
    rows = starts[:, None] + 2 * torch.arange(per_row, dtype=torch.int32, device=g.device)
    column = multipliers[:, None]
    packed = None
    for p in range(2):
        codes = _codes_of(columns[..., p], lambda v: v * column, hash_at(block, rows + p), None, True)
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
    args = kernel_parser(__doc__.splitlines()[0], json=True).parse_args()
    device = kernel_device(args)
    set_codec_mode("compiled")
    generator = torch.Generator().manual_seed(0)
    out, floor_out = torch.empty(LAYER, device=device), torch.empty(LAYER, device=device)

    fields = [torch.randint(1, 16, (LAYER,), dtype=torch.int32, generator=generator).to(device) for _ in range(2)]
    scales = [torch.rand(LAYER // BLOCK, generator=generator).to(device) for _ in range(2)]
    old_levels = [interleaved(f, 2) for f in fields]
    wire_levels = [pack_fields(f, 2, 0) for f in fields]
    ternary = [torch.randint(0, 3, (LAYER,), dtype=torch.int32, generator=generator).to(device) for _ in range(2)]
    old_ternary = [interleaved(f, 4) for f in ternary]
    wire_ternary = [pack_fields(f, 4, 1) for f in ternary]
    shared = torch.rand((), generator=generator).to(device)
    signed = [torch.randn(LAYER, generator=generator).to(device) for _ in range(2)]
    magnitudes = [torch.rand((), generator=generator).to(device) for _ in range(2)]
    old_signs = [interleaved((x >= 0).to(torch.uint8), 8) for x in signed]
    wire_signs = [pack_signs(x) for x in signed]
    bits = (torch.arange(256, device=device).unsqueeze(1) >> torch.arange(8, device=device)) & 1
    table = (2 * bits - 1).to(torch.float32)

    levels_interleaved = torch.compile(interleaved_levels_mean_, dynamic=False, fullgraph=True)
    ternary_interleaved = torch.compile(interleaved_ternary_mean_, dynamic=False, fullgraph=True)
    signs_interleaved = torch.compile(interleaved_signs_mean_, dynamic=False, fullgraph=True)
    fill = torch.compile(lambda o, s: o.copy_(s.expand(o.shape) * 2), dynamic=False, fullgraph=True)

    check = torch.empty_like(out)
    mean_of_fields_(out, wire_levels, scales, 2, BIAS)
    levels_interleaved(check, old_levels, scales)
    assert torch.equal(out, check), "the interleaved levels' mean differs from the wire's"
    mean_of_summed_fields_(out, wire_ternary, shared, 4, 1)
    ternary_interleaved(check, old_ternary, shared)
    assert torch.equal(out, check), "the interleaved ternary mean differs from the wire's"
    mean_of_signs_(out, wire_signs, magnitudes)
    signs_interleaved(check, old_signs, magnitudes, table)
    assert torch.equal(out, check), "the interleaved signs' mean differs from the wire's"

    gradient = torch.randn(LAYER, generator=generator).to(device)
    multipliers = 7 / gradient.view(-1, BLOCK).norm(dim=1)
    block = CounterStream(3, device).block(LAYER)
    draw_interleaved = torch.compile(interleaved_draw, dynamic=False, fullgraph=True)
    wire = fields_of_rows(draw_packed_codes(gradient, multipliers, block, None, 0, BLOCK, True, BIAS, 2, 0), 2, STRIPE)
    old = interleaved_fields(draw_interleaved(gradient, multipliers, block), 2, BLOCK).reshape(-1)
    assert torch.equal(wire.reshape(-1), old), "the interleaved draw differs"

    rows = {
        "floor: a compiled fill of the layer": best_ms(lambda: fill(floor_out, magnitudes[0]), args.repeats, device),
        "4-bit levels, mean of 2 ranks, interleaved prototype (the wire before)": best_ms(
            lambda: levels_interleaved(out, old_levels, scales), args.repeats, device
        ),
        "4-bit levels, mean of 2 ranks, wire (planar rows)": best_ms(
            lambda: mean_of_fields_(out, wire_levels, scales, 2, BIAS), args.repeats, device
        ),
        "ternary codes, mean of 2 ranks, interleaved prototype (the wire before)": best_ms(
            lambda: ternary_interleaved(out, old_ternary, shared), args.repeats, device
        ),
        "ternary codes, mean of 2 ranks, wire (planar rows)": best_ms(
            lambda: mean_of_summed_fields_(out, wire_ternary, shared, 4, 1), args.repeats, device
        ),
        "scaled signs, mean of 2 ranks, interleaved prototype (the wire before)": best_ms(
            lambda: signs_interleaved(out, old_signs, magnitudes, table), args.repeats, device
        ),
        "scaled signs, mean of 2 ranks, wire (planar rows)": best_ms(
            lambda: mean_of_signs_(out, wire_signs, magnitudes), args.repeats, device
        ),
        "4-bit levels drawn and packed, interleaved prototype (the wire before)": best_ms(
            lambda: draw_interleaved(gradient, multipliers, block), args.repeats, device
        ),
        "4-bit levels drawn and packed, wire (planar rows)": best_ms(
            lambda: draw_packed_codes(gradient, multipliers, block, None, 0, BLOCK, True, BIAS, 2, 0),
            args.repeats,
            device,
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
