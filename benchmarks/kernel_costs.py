"""The kernel-level costs behind the hook's kept buffers and streamed codecs: why the hook keeps its buffers, streams
and selects as it does.

Each line times two ways of doing the same thing on a 25M-element tensor (the 25.2M MLP's gradient), a
4096 x 4096 layer (its largest) or one of its layers' gradients, best of ``--repeats``, on one CPU thread
(or ``--device cuda``):

* a multiply into a fresh tensor against the same multiply into a kept one (page faults of a new
  allocation against the arithmetic);
* PowerSGD's second product ``M^T P`` computed as written against ``(P^T M)^T``;
* Top-k's sample of 65,536 positions (its threshold's) from the counter stream, drawn and read from a tensor in two
  pieces (a unit of two layers in DDP's buckets): independent positions (one 32-bit draw each, ``floor(b d / 2^32)``)
  against the stratified ones, which come in order and are read in runs;
* Top-k's whole compress at density 0.01 of that tensor in two pieces, with the sample independent against
  stratified (this and ATOMO's compress lines: medians of ``3 * --repeats`` calls alternated with the other way's,
  and the median of their paired differences, which a slow spell of the machine cannot bend);
* Top-k's candidates ``|x| >= thr`` at density 0.01 through per-block maxima against one streamed pass,
  and the streamed pass's test on one chunk: ``abs`` then ``>=`` against ``hardshrink`` then a cast;
* the fp16 wire's summand ``x / P`` rounded to float16: one mixed-dtype multiply against ``scaled_cast``;
* the ``k`` largest of the candidates (``k`` = 250,000 of 280,000): ``torch.topk`` and a sort against
  ``ascending_top_k``;
* the cut of a gTop-k merge (the 180,000th smallest of 430,000 magnitudes): ``torch.kthvalue`` of them all against
  ``kth_smallest``'s band placed by a systematic sample;
* Elias-Fano's low bits of 250,000 indices (6 bits each, density 0.01) packed and unpacked through int64 words
  against byte columns, eight values to ``width`` bytes;
* ATOMO's atoms of a 512 x 3072 gradient of rank 32 (a linear layer's, batch 32): the exact decomposition
  against the sketched one; its compress, and a 512 x 512 one's, with every atom of the sketch formed against
  only the atoms drawn; and the atoms drawn added into a bucket through their dense matrix against one ``addmm_``;
* QSGD's 4-bit levels packed a pair at a time against as int16 lanes;
* the entries at 250,000 ascending int32 positions of the 25M-element tensor (Top-k's values): ``x[positions]``
  against ``index_select``;
* a gTop-k merge's scatter of 500,000 entries to int64 positions: ``index_put_`` against ``index_copy_``;
* what a compiled CPU loop pays to read integers (the CPU's vector extension is named in the output): a layer's
  int32 copied by a compiled kernel against the same bytes as float32; sign bits 32 to an int32 word decoded to
  ``+-s`` by a compiled kernel that loads the words as int32 against one that loads them as float32 and
  reinterprets them; and the compiled mean of two ranks' planar sign words (``mean_of_signs_``) against a copy of
  its output;

and alone: Elias-Fano's encoding and decoding of 250,000 indices, gTop-k's merge of two such sets, and
QSGD's draw of a layer's levels.

    python benchmarks/kernel_costs.py [--device cuda] [--only "Top-k's"]   # --only: the lines whose text holds it
"""

from __future__ import annotations

import torch
from timing import best_ms, kernel_device, kernel_parser, paired_ms

from lightning_gradcomp.core.comm.gtopk import SparseSet, merge
from lightning_gradcomp.core.compressors import blocks, qsgd
from lightning_gradcomp.core.compressors.atomo import AtomoCompressor
from lightning_gradcomp.core.compressors.base import STREAM_CHUNK
from lightning_gradcomp.core.compressors.blocks import MagnitudeBlocks, streamed_above
from lightning_gradcomp.core.compressors.draws import stratified_positions
from lightning_gradcomp.core.compressors.indices import (
    decode_indices,
    encode_indices,
    pack_bits,
    pack_words,
    unpack_bits,
    unpack_words,
)
from lightning_gradcomp.core.compressors.kernels import (
    encode_signs,
    mean_of_signs_,
)
from lightning_gradcomp.core.compressors.precision import scaled_cast
from lightning_gradcomp.core.compressors.segments import Segments, take
from lightning_gradcomp.core.compressors.spectral import (
    DenseAtoms,
    SketchedAtoms,
    TransposedAtoms,
    spectral_decomposition,
)
from lightning_gradcomp.core.compressors.ternary import stochastic_levels
from lightning_gradcomp.core.compressors.topk import TopKCompressor, ascending_top_k, kth_smallest
from lightning_gradcomp.core.randomness import CounterStream, unsigned_of

#: the 25.2M MLP's largest layer, 4096 x 4096
LAYER = 4096 * 4096


def independent_positions(stream: CounterStream, high: int, count: int = 1 << 16) -> torch.Tensor:
    """``count`` independent positions in ``[0, high)``, ``floor(b high / 2^32)`` of one 32-bit draw ``b`` each: Top-k's
    sample before it was stratified."""
    return unsigned_of(stream.bits(count)).mul_(high).bitwise_right_shift_(32)


class EveryAtomFormed(AtomoCompressor):
    """ATOMO forming all ``m`` atoms of a sketch into buffers kept per shape, the payload copying the kept ones out:
    the compress before the atoms were kept in factors (the same atoms)."""

    def __init__(self, budget: float) -> None:
        super().__init__(budget)
        self._formed: dict[int, torch.Tensor] = {}

    def _decompose(self, x: torch.Tensor, reuse: bool) -> object:
        atoms = super()._decompose(x, reuse)
        if isinstance(atoms, TransposedAtoms):  # a tall layer: its transpose's atoms, formed, then traded back
            return TransposedAtoms(self._formed_in_full(atoms.atoms))
        return self._formed_in_full(atoms)

    def _formed_in_full(self, atoms: object) -> object:
        if not isinstance(atoms, SketchedAtoms):
            return atoms
        m, r = atoms.vectors.shape
        if m not in self._formed:
            self._formed[m] = torch.empty(m, m, dtype=atoms.vectors.dtype, device=atoms.vectors.device)
        u = torch.eye(m, out=self._formed[m])
        u.addmm_(atoms.weights, atoms.vectors.T, alpha=-1)
        u[:, :r] = u[:, :r] @ atoms.top_u
        vh, residual_sigma = atoms.coordinates, atoms.sigma[r:]
        vh[:r] = atoms.top_vh
        vh[r:] /= torch.where(residual_sigma > 0, residual_sigma, 1.0).unsqueeze(1)
        return DenseAtoms(u, atoms.sigma, vh)


class IndependentSample(TopKCompressor):
    """Top-k with its threshold's sample at independent positions (:func:`independent_positions`), read in their
    random order: the selection before the sample was stratified (the same entries, found more slowly)."""

    def sampled_magnitudes(self, flat: Segments, count: int, generator: CounterStream) -> torch.Tensor:
        return take(flat, independent_positions(generator, flat.numel(), count)).abs()


def blocks_copied_out(x: torch.Tensor, thr: float) -> torch.Tensor:
    """``MagnitudeBlocks.above`` with its switch to a streamed pass turned off: every passing block copied out."""
    switch = blocks.STREAM_FRACTION
    blocks.STREAM_FRACTION = 0
    try:
        return MagnitudeBlocks(x).above(thr, inclusive=True)
    finally:
        blocks.STREAM_FRACTION = switch


def main() -> None:
    parser = kernel_parser(__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=25_000_000)
    parser.add_argument("--only", default="", help="time only the lines whose description contains this")
    args = parser.parse_args()
    device = kernel_device(args)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(args.numel, generator=generator).to(device)
    kept = torch.empty_like(x)
    half = torch.empty_like(x, dtype=torch.float16)
    matrix = torch.randn(4096, 4096, generator=generator).to(device)
    p = torch.randn(4096, 4, generator=generator).to(device)
    thr = TopKCompressor(0.01).sample_threshold(x.cpu(), generator)
    pieces = Segments([x[: 2 * args.numel // 3], x[2 * args.numel // 3 :]])  # two layers' gradients
    numel = pieces.numel()
    assert thr is not None
    chunk, shrunk = x[:STREAM_CHUNK], torch.empty(STREAM_CHUNK, device=device)
    mask = torch.empty(STREAM_CHUNK, dtype=torch.bool, device=device)
    candidates = torch.rand(280_000, generator=generator).to(device)
    merged = torch.rand(430_000, generator=generator).to(device)
    lows = torch.randint(0, 64, (250_000,), generator=generator).to(device)
    lows_packed = pack_bits(lows, 6, (250_000 * 6 + 7) // 8)
    layer = (torch.randn(512, 32, generator=generator) @ torch.randn(32, 3072, generator=generator)).to(device)
    atomo = AtomoCompressor(3)
    atoms = atomo.compress(layer, torch.Generator(device=device).manual_seed(1))
    every_atom = EveryAtomFormed(3)
    square = (torch.randn(512, 32, generator=generator) @ torch.randn(32, 512, generator=generator)).to(device)
    bucket = torch.zeros(layer.numel(), device=device)
    pairs = [
        (
            f"multiply {args.numel} floats",
            ("into a fresh tensor", lambda: x * 0.5),
            ("into a kept tensor", lambda: torch.mul(x, 0.5, out=kept)),
        ),
        (
            "PowerSGD's M^T P, 4096 x 4096, rank 4",
            ("torch.matmul(M.T, P)", lambda: torch.matmul(matrix.T, p)),
            ("torch.matmul(P.T, M).T", lambda: torch.matmul(p.T, matrix).T.contiguous()),
        ),
        (
            f"Top-k's sample of 65,536 of {args.numel} entries in two pieces, drawn and read",
            ("independent positions", lambda: take(pieces, independent_positions(CounterStream(7, device), numel))),
            (
                "stratified, read in runs",
                lambda: take(pieces, stratified_positions(CounterStream(7, device), numel, 1 << 16, device), True),
            ),
        ),
        (
            "Top-k candidates |x| >= thr at density 0.01",
            ("block maxima, blocks copied out", lambda: blocks_copied_out(x, thr)),
            ("one streamed pass", lambda: streamed_above(x, thr, inclusive=True)),
        ),
        (
            f"the candidates' test on one chunk of {STREAM_CHUNK}",
            ("abs, then >=", lambda: torch.ge(torch.abs(chunk, out=shrunk), thr, out=mask)),
            ("hardshrink, then a cast", lambda: mask.copy_(torch.ops.aten.hardshrink.out(chunk, thr, out=shrunk))),
        ),
        (
            f"x / 2 rounded to float16, {args.numel} floats",
            ("one mixed-dtype multiply", lambda: torch.mul(x, 0.5, out=half)),
            ("scaled_cast", lambda: scaled_cast(x, 0.5, half)),
        ),
        (
            "the 250,000 largest of 280,000 candidates, ascending",
            ("torch.topk, then a sort", lambda: torch.topk(candidates, 250_000, sorted=False).indices.sort()),
            ("ascending_top_k", lambda: ascending_top_k(candidates, 250_000)),
        ),
        (
            "the 180,000th smallest of 430,000 magnitudes",
            ("torch.kthvalue", lambda: torch.kthvalue(merged, 180_000)),
            ("kth_smallest (a sampled band)", lambda: kth_smallest(merged, 180_000)),
        ),
        (
            "250,000 values of 6 bits packed",
            ("int64 words", lambda: pack_words(lows, 6, lows_packed.numel())),
            ("pack_bits (byte columns on the CPU)", lambda: pack_bits(lows, 6, lows_packed.numel())),
        ),
        (
            "250,000 values of 6 bits unpacked",
            ("int64 words", lambda: unpack_words(lows_packed, 250_000, 6)),
            ("unpack_bits (byte columns on the CPU)", lambda: unpack_bits(lows_packed, 250_000, 6)),
        ),
        (
            "ATOMO's atoms of a 512 x 3072 gradient of rank 32",
            ("exact (Gram eigh)", lambda: spectral_decomposition(layer)),
            ("sketched (rank 32)", lambda: atomo.decompose(layer)),
        ),
        (
            f"ATOMO's {atoms.atoms} atoms of that gradient added into a bucket",
            ("through their dense matrix", lambda: bucket.add_(atoms.dense().reshape(-1))),
            ("accumulate (one addmm_)", lambda: atomo.accumulate(atoms, bucket)),
        ),
    ]
    levels = torch.randint(-7, 8, (LAYER,), dtype=torch.int8, generator=generator).to(device)
    pairs.append(
        (
            f"QSGD's 4-bit levels packed, {LAYER} of them",
            ("a pair per byte, eagerly", lambda: paired_levels(levels)),
            ("planar rows, eagerly (the wire)", lambda: qsgd.pack_levels(levels, 7)),
        )
    )
    positions = torch.randperm(args.numel, generator=generator)[:250_000].sort().values.int().to(device)
    order = torch.randperm(500_000, generator=generator).to(device)
    places = torch.arange(500_000, dtype=torch.int32, device=device)
    moved = torch.empty(500_000, dtype=torch.int32, device=device)
    pairs.append(
        (
            f"the entries at 250,000 ascending int32 positions of {args.numel}",
            ("x[positions]", lambda: x[positions]),
            ("index_select", lambda: x.index_select(0, positions)),
        )
    )
    pairs.append(
        (
            "500,000 entries scattered to int64 positions",
            ("index_put_", lambda: moved.index_put_((order,), places)),
            ("index_copy_", lambda: moved.index_copy_(0, order, places)),
        )
    )
    if device.type == "cpu":
        pairs += integer_load_pairs(generator)
    indices = torch.randperm(args.numel, generator=generator)[:250_000].sort().values.to(device)
    encoded = encode_indices(indices, args.numel)
    others = torch.randperm(args.numel, generator=generator)[:250_000].sort().values.to(device)
    sets = [SparseSet(i, torch.randn(i.numel(), generator=generator).to(device)) for i in (indices, others)]
    gradient = torch.randn(LAYER, generator=generator).to(device)
    multipliers = torch.rand(LAYER // 512, generator=generator).to(device) * 10
    draws = torch.Generator(device=device).manual_seed(1)
    singles = [
        (f"Elias-Fano encode, 250,000 indices of {args.numel}", lambda: encode_indices(indices, args.numel)),
        (f"Elias-Fano decode, 250,000 indices of {args.numel}", lambda: decode_indices(encoded, args.numel, 250_000)),
        ("gTop-k's merge of two sets of 250,000 entries", lambda: merge(*sets, 250_000)),
        (f"QSGD's levels drawn, {LAYER} entries", lambda: stochastic_levels(gradient, multipliers, 512, draws)),
    ]
    paired = [
        (
            f"Top-k's compress at density 0.01 of {args.numel} entries in two pieces",
            ("independent sample", lambda: IndependentSample(0.01).compress(pieces, CounterStream(7, device))),
            ("stratified sample", lambda: TopKCompressor(0.01).compress(pieces, CounterStream(7, device))),
        ),
        (
            "ATOMO's compress of a 512 x 3072 gradient of rank 32",
            ("every atom formed", lambda: every_atom.compress(layer, torch.Generator(device=device).manual_seed(1))),
            ("the atoms drawn formed", lambda: atomo.compress(layer, torch.Generator(device=device).manual_seed(1))),
        ),
        (
            "ATOMO's compress of a 512 x 512 gradient of rank 32",
            ("every atom formed", lambda: every_atom.compress(square, torch.Generator(device=device).manual_seed(1))),
            ("the atoms drawn formed", lambda: atomo.compress(square, torch.Generator(device=device).manual_seed(1))),
        ),
    ]
    where = f"one CPU thread ({vector_isa()})" if device.type == "cpu" else torch.cuda.get_device_name(device)
    print(f"{where}, best of {args.repeats} (ms)")
    pairs = [pair for pair in pairs if args.only in pair[0]]
    paired = [pair for pair in paired if args.only in pair[0]]
    singles = [single for single in singles if args.only in single[0]]
    for what, (slow_name, slow), (fast_name, fast) in pairs:
        slow_ms, fast_ms = best_ms(slow, args.repeats, device), best_ms(fast, args.repeats, device)
        print(f"{what}: {slow_name} {slow_ms:.2f}, {fast_name} {fast_ms:.2f} ({slow_ms / fast_ms:.1f}x)")
    for what, (slow_name, slow), (fast_name, fast) in paired:
        slow_ms, fast_ms, saved = paired_ms(slow, fast, 3 * args.repeats, device)
        print(
            f"{what}, medians of {3 * args.repeats} alternated calls: {slow_name} {slow_ms:.2f}, {fast_name} "
            f"{fast_ms:.2f}, paired difference {saved:.2f}"
        )
    for what, fn in singles:
        print(f"{what}: {best_ms(fn, args.repeats, device):.2f}")


#: Words of a row in :func:`word_signs`: 32 planes of 128 words, as many signs as a planar row of bytes holds.
WORDS_PER_PLANE = 128


def vector_isa() -> str:
    """The vector extension inductor compiles CPU loops for (``VecAVX512``, ``VecAVX2``, ...)."""
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    return type(pick_vec_isa()).__name__


def word_signs(out: torch.Tensor, words: torch.Tensor, scale: torch.Tensor) -> None:
    """``out`` set to ``+-scale`` from sign bits 32 to an int32 word: bit ``k`` of word ``w`` of a row is the sign of
    its element ``w + k * 128``. ``words`` may come as float32: its bits are read as int32 inside the kernel."""
    words = words.view(torch.int32) if words.dtype == torch.float32 else words
    shifts = torch.arange(32, dtype=torch.int32, device=words.device).view(1, 32, 1)
    bits = (words.view(-1, 1, WORDS_PER_PLANE) >> shifts) & 1
    out.view(-1, 32, WORDS_PER_PLANE).copy_(torch.where(bits != 0, scale, -scale))


def integer_load_pairs(generator: torch.Generator) -> list:
    """The rows of what a compiled CPU loop pays to read integers (see the module's list)."""
    copy = torch.compile(torch.Tensor.copy_, dynamic=False, fullgraph=True)
    signs = torch.compile(word_signs, dynamic=False, fullgraph=True)
    ints = torch.randint(-(2**31), 2**31 - 1, (LAYER,), dtype=torch.int32, generator=generator)
    ints_out = torch.empty_like(ints)
    words = ints[: LAYER // 32]
    signs_out = torch.empty(LAYER)
    scale = torch.tensor(0.5)
    flats = [torch.randn(LAYER, generator=generator) for _ in range(2)]
    bits = [encode_signs(flat, False)[1].view(torch.uint8) for flat in flats]
    scales = [torch.tensor(0.7), torch.tensor(0.3)]
    return [
        (
            f"{LAYER} int32 copied by a compiled kernel",
            ("loaded as int32", lambda: copy(ints_out, ints)),
            (
                "loaded as float32",
                lambda: copy(ints_out.view(torch.float32), ints.view(torch.float32)),
            ),
        ),
        (
            f"{LAYER} signs, 32 to an int32 word, decoded by a compiled kernel",
            ("words loaded as int32", lambda: signs(signs_out, words, scale)),
            (
                "loaded as float32, bits reinterpreted",
                lambda: signs(signs_out, words.view(torch.float32), scale),
            ),
        ),
        (
            f"the mean of two ranks' planar sign words of {LAYER}, compiled",
            ("mean_of_signs_", lambda: mean_of_signs_(signs_out, bits, scales)),
            ("a copy of its output's size", lambda: signs_out.copy_(flats[0])),
        ),
    ]


def paired_levels(levels: torch.Tensor) -> torch.Tensor:
    """4-bit levels (``c + 7``) packed two consecutive ones to a byte, the low nibble first: the layout the planar
    rows replaced, for comparison."""
    pairs = (levels + 7).view(torch.uint8).view(-1, 2)
    return pairs[:, 0] | (pairs[:, 1] << 4)


if __name__ == "__main__":
    main()
