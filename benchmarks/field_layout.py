"""Why the compiled decodes of planar bytes ran at a fraction of memory speed on an AVX2 CPU, and what words buy.

In planar bytes (the wire before its words), a row of ``per_byte * 512`` codes lies in 512 bytes, field ``k`` of
byte ``b`` holding code ``b + 512 k``. Inductor's C++ loop then loads the bytes as ``uint8`` vectors, and on AVX2
torch's vector load of a count of integers goes through a buffer on the stack (its float32 load, and AVX-512's integer
loads, are single instructions). In planar words (the wire now) a row of ``4 * per_byte * 512`` codes lies in 512
little-endian 32-bit words, field ``k`` of word ``v`` holding code ``v + 512 k``, and the kernels load the words as
float32 and reinterpret them. This script times, for one 4096 x 4096 layer on one CPU thread (or ``--device cuda``),
each operation both ways, with a compiled copy of the layer as the floor (writing the mean is most of the traffic):

* the mean of two ranks' 4-bit levels, one scale per block of 512 (DIANA's and QSGD's);
* the mean of two ranks' ternary codes under one shared scale (TernGrad's);
* the mean of two ranks' scaled signs (EF-sign's), and EF-sign's residual ``p - C(p)``;
* a layer's signs packed with its magnitude (EF-sign's encoder);
* QSGD's 4-bit levels of a layer drawn (one counter hash per element) and packed.

Each planar-byte prototype (the kernel as it was) gives the library's result on the same codes, and its draw the
library's codes, element for element (checked before timing). The prototypes are not wire formats the library reads.

    python benchmarks/field_layout.py --json benchmarks/results/field_layout_words_cpu_amd_epyc.json
"""

from __future__ import annotations

import json
from collections.abc import Callable

import torch
from machine import describe
from timing import best_ms, kernel_device, kernel_parser
from torch import Tensor

from lightning_gradcomp.core.compressors.kernels import (
    _codes_of,
    _sign_magnitude,
    draw_packed_codes,
    encode_signs,
    mean_of_fields_,
    mean_of_signs_,
    mean_of_summed_fields_,
    subtract_signs_,
)
from lightning_gradcomp.core.compressors.planar import STRIPE, fields_of_rows, pack_fields
from lightning_gradcomp.core.fused import set_codec_mode
from lightning_gradcomp.core.randomness import CounterStream, hash_at

LAYER = 4096 * 4096
BLOCK, BIAS = 512, 8  # QSGD's 4-bit levels: 7 levels each side, field = level + 8
#: Bytes per row of the planar-byte prototypes (the old wire's stripe).
BYTE_STRIPE = 512


def byte_fields(packed: Tensor, per_byte: int) -> Tensor:
    """The int32 fields of planar bytes in element order, shaped ``(rows, per_byte, 512)``: the decode the compiled
    kernels ran before the words (uint8 loads)."""
    width = 8 // per_byte
    shifts = width * torch.arange(per_byte, dtype=torch.int32, device=packed.device).view(1, per_byte, 1)
    return (packed.view(-1, 1, BYTE_STRIPE).to(torch.int32) >> shifts) & ((1 << width) - 1)


def byte_rows(fields: Tensor, per_byte: int) -> Tensor:
    """Fields in element order (int32) packed into planar bytes, one OR of shifted planes per byte."""
    width = 8 // per_byte
    rows = fields.view(-1, per_byte, BYTE_STRIPE)
    packed = rows[:, 0]
    for k in range(1, per_byte):
        packed = packed | (rows[:, k] << (width * k))
    return packed.to(torch.uint8).reshape(-1)


def byte_levels_mean_(out: Tensor, packs: list[Tensor], scales: list[Tensor]) -> None:
    """The mean of the ranks' planar-byte 4-bit levels times their block scales, summed and divided as
    ``mean_of_fields_`` does."""
    total = None
    for packed, scale in zip(packs, scales, strict=True):
        values = (byte_fields(packed, 2) - BIAS).to(torch.float32).view(scale.numel(), -1) * scale[:, None]
        total = values if total is None else total + values
    assert total is not None
    out.view(total.shape).copy_(total / len(packs))


def byte_ternary_mean_(out: Tensor, packs: list[Tensor], scale: Tensor) -> None:
    """The mean of the ranks' planar-byte ternary codes under one shared scale: summed as integers, scaled once,
    divided (``mean_of_summed_fields_``'s arithmetic)."""
    total = None
    for packed in packs:
        codes = byte_fields(packed, 4) - 1
        total = codes if total is None else total + codes
    assert total is not None
    out.view(total.shape).copy_(total.to(scale.dtype) * scale / len(packs))


def byte_signs(packed: Tensor) -> Tensor:
    """The signs (+-1, float32) of planar sign bytes, shaped ``(rows, 8, 512)``."""
    return (byte_fields(packed, 8) * 2 - 1).to(torch.float32)


def byte_signs_mean_(out: Tensor, packs: list[Tensor], scales: list[Tensor]) -> None:
    """The mean of the ranks' scaled signs from planar bytes (``mean_of_signs_``'s arithmetic)."""
    total = byte_signs(packs[0]) * scales[0]
    for rank in range(1, len(packs)):
        total = total + byte_signs(packs[rank]) * scales[rank]
    out.view(total.shape).copy_(total / len(packs))


def byte_signs_residual_(out: Tensor, compensated: Tensor, packed: Tensor, scale: Tensor) -> None:
    """``out = compensated - scale * sign`` from planar sign bytes (``subtract_signs_``'s arithmetic)."""
    signs = byte_signs(packed) * scale
    out.view(signs.shape).copy_(compensated.view(signs.shape) - signs)


def byte_encode_signs(flat: Tensor) -> tuple[Tensor, Tensor]:
    """EF-sign's magnitude (today's ``encode_signs``' sum) and its signs in planar bytes: the encoder's bytes
    form, beside its words."""
    return _sign_magnitude(flat, False), byte_rows(torch.where(flat >= 0, 1, 0).to(torch.int32), 8)


def byte_draw(g: Tensor, multipliers: Tensor, block: Tensor) -> Tensor:
    """QSGD's 4-bit levels of ``g`` (whole blocks of ``BLOCK``) drawn as ``draw_packed_codes`` draws them (element
    ``j`` from counter ``j``), packed in planar bytes, each byte's two codes drawn side by side (the kernel as it
    was)."""
    rows = g.numel() // (2 * BYTE_STRIPE)
    columns = g.view(rows, 2, BYTE_STRIPE)
    index = torch.arange(BYTE_STRIPE, dtype=torch.int32, device=g.device)
    offsets = 2 * BYTE_STRIPE * torch.arange(rows, dtype=torch.int32, device=g.device)[:, None] + index
    column = multipliers[:, None]  # blocks of 512: one per plane of a row
    packed = None
    for k in range(2):
        plane = column.view(rows, 2, 1)[:, k]
        codes = _codes_of(
            columns[:, k], lambda v, m=plane: v * m, hash_at(block, offsets + k * BYTE_STRIPE), None, True
        )
        field = (codes.to(torch.int32) + BIAS) << (4 * k)
        packed = field if packed is None else packed | field
    assert packed is not None
    return packed.to(torch.uint8).reshape(-1)


def main() -> None:
    args = kernel_parser(__doc__.splitlines()[0], json=True).parse_args()
    device = kernel_device(args)
    set_codec_mode("compiled")
    generator = torch.Generator().manual_seed(0)
    out = torch.empty(LAYER, device=device)

    def compiled(fn: Callable[..., object]) -> Callable[..., object]:
        return torch.compile(fn, dynamic=False, fullgraph=True)

    levels_bytes, ternary_bytes, signs_bytes = (
        compiled(f) for f in (byte_levels_mean_, byte_ternary_mean_, byte_signs_mean_)
    )
    residual_bytes, encode_bytes, draw_bytes = (
        compiled(f) for f in (byte_signs_residual_, byte_encode_signs, byte_draw)
    )
    pack_bytes = compiled(byte_rows)
    copy = compiled(lambda o, s: o.copy_(s))

    fields = [torch.randint(1, 16, (LAYER,), dtype=torch.int32, generator=generator).to(device) for _ in range(2)]
    scales = [torch.rand(LAYER // BLOCK, generator=generator).to(device) for _ in range(2)]
    ternary = [torch.randint(0, 3, (LAYER,), dtype=torch.int32, generator=generator).to(device) for _ in range(2)]
    shared = torch.rand((), generator=generator).to(device)
    signed = [torch.randn(LAYER, generator=generator).to(device) for _ in range(2)]
    magnitudes = [torch.rand((), generator=generator).to(device) for _ in range(2)]
    bits = [torch.where(x >= 0, 1, 0).to(torch.int32) for x in signed]
    levels = {
        "bytes": [pack_bytes(f, 2) for f in fields],
        "words": [pack_fields(f, 2, 0).view(torch.uint8) for f in fields],
    }
    codes = {
        "bytes": [pack_bytes(f, 4) for f in ternary],
        "words": [pack_fields(f, 4, 1).view(torch.uint8) for f in ternary],
    }
    signs = {
        "bytes": [pack_bytes(b, 8) for b in bits],
        "words": [encode_signs(x, False)[1].view(torch.uint8) for x in signed],
    }

    check = torch.empty_like(out)
    mean_of_fields_(out, levels["words"], scales, 2, BIAS)
    levels_bytes(check, levels["bytes"], scales)
    assert torch.equal(out, check), "the planar-byte levels' mean differs from the wire's"
    mean_of_summed_fields_(out, codes["words"], shared, 4, 1)
    ternary_bytes(check, codes["bytes"], shared)
    assert torch.equal(out, check), "the planar-byte ternary mean differs from the wire's"
    mean_of_signs_(out, signs["words"], magnitudes)
    signs_bytes(check, signs["bytes"], magnitudes)
    assert torch.equal(out, check), "the planar-byte signs' mean differs from the wire's"
    subtract_signs_(out, signed[1], signs["words"][0], magnitudes[0])
    residual_bytes(check, signed[1], signs["bytes"][0], magnitudes[0])
    assert torch.equal(out, check), "the planar-byte residual differs from the wire's"
    assert torch.equal(encode_bytes(signed[0])[1], signs["bytes"][0]), "the planar-byte sign encoder differs"

    gradient = torch.randn(LAYER, generator=generator).to(device)
    multipliers = 7 / gradient.view(-1, BLOCK).norm(dim=1)
    block = CounterStream(3, device).block(LAYER)
    drawn = draw_packed_codes(gradient, multipliers, block, None, 0, BLOCK, True, BIAS, 2, 0).view(torch.uint8)
    wire = fields_of_rows(drawn, 2, STRIPE).reshape(-1)
    old = byte_fields(draw_bytes(gradient, multipliers, block), 2).reshape(-1)
    assert torch.equal(wire, old), "the planar-byte draw differs"

    repeats = args.repeats
    rows = {
        "floor: a compiled copy of the layer": best_ms(lambda: copy(out, signed[0]), repeats, device),
        "4-bit levels, mean of 2 ranks, planar bytes (the wire before)": best_ms(
            lambda: levels_bytes(out, levels["bytes"], scales), repeats, device
        ),
        "4-bit levels, mean of 2 ranks, planar words (the wire)": best_ms(
            lambda: mean_of_fields_(out, levels["words"], scales, 2, BIAS), repeats, device
        ),
        "ternary codes, mean of 2 ranks, planar bytes (the wire before)": best_ms(
            lambda: ternary_bytes(out, codes["bytes"], shared), repeats, device
        ),
        "ternary codes, mean of 2 ranks, planar words (the wire)": best_ms(
            lambda: mean_of_summed_fields_(out, codes["words"], shared, 4, 1), repeats, device
        ),
        "scaled signs, mean of 2 ranks, planar bytes (the wire before)": best_ms(
            lambda: signs_bytes(out, signs["bytes"], magnitudes), repeats, device
        ),
        "scaled signs, mean of 2 ranks, planar words (the wire)": best_ms(
            lambda: mean_of_signs_(out, signs["words"], magnitudes), repeats, device
        ),
        "EF-sign's residual, planar bytes (the wire before)": best_ms(
            lambda: residual_bytes(out, signed[1], signs["bytes"][0], magnitudes[0]), repeats, device
        ),
        "EF-sign's residual, planar words (the wire)": best_ms(
            lambda: subtract_signs_(out, signed[1], signs["words"][0], magnitudes[0]), repeats, device
        ),
        "signs encoded with their magnitude, planar bytes (the wire before)": best_ms(
            lambda: encode_bytes(signed[0]), repeats, device
        ),
        "signs encoded with their magnitude, planar words (the wire)": best_ms(
            lambda: encode_signs(signed[0], False), repeats, device
        ),
        "4-bit levels drawn and packed, planar bytes (the wire before)": best_ms(
            lambda: draw_bytes(gradient, multipliers, block), repeats, device
        ),
        "4-bit levels drawn and packed, planar words (the wire)": best_ms(
            lambda: draw_packed_codes(gradient, multipliers, block, None, 0, BLOCK, True, BIAS, 2, 0), repeats, device
        ),
    }
    machine = describe(device.type)
    print(f"{LAYER} elements, one thread of {machine['device']}, torch {torch.__version__}, best of {repeats} (ms)")
    for what, ms in rows.items():
        print(f"{what}: {ms:.2f}")
    if args.json:
        args.json.write_text(json.dumps({"elements": LAYER, "machine": machine, "ms": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
