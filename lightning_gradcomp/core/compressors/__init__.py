"""Compressors: pure tensor math (``compress``, ``unpack``, ``accumulate``) and their registry."""

from __future__ import annotations

from typing import Any

from lightning_gradcomp.core.compressors.atomo import AtomoCompressor, AtomoPayload
from lightning_gradcomp.core.compressors.base import Compressor, Entries, Payload, all_finite
from lightning_gradcomp.core.compressors.blockwise import BlockScaledPayload, FP8Compressor, Int8Compressor
from lightning_gradcomp.core.compressors.chunked import ChunkedPayload, ChunkedTopKCompressor
from lightning_gradcomp.core.compressors.dgc import DGCCompressor
from lightning_gradcomp.core.compressors.gaussiank import GaussianKCompressor
from lightning_gradcomp.core.compressors.identity import DensePayload, IdentityCompressor
from lightning_gradcomp.core.compressors.lowbit import TwoBitPayload, TwoBitValues
from lightning_gradcomp.core.compressors.powersgd import LowRankPayload, PowerSGDCompressor
from lightning_gradcomp.core.compressors.precision import WIRE_PRECISIONS, CastPayload, WirePrecision
from lightning_gradcomp.core.compressors.qsgd import LevelsPayload, QSGDCompressor
from lightning_gradcomp.core.compressors.quantizer import BlockQuantizer
from lightning_gradcomp.core.compressors.randomk import RandomKCompressor
from lightning_gradcomp.core.compressors.sign import ScaledSignCompressor, SignPayload
from lightning_gradcomp.core.compressors.sparse import SparseEntries, SparsePayload
from lightning_gradcomp.core.compressors.ternary import TernaryPayload, TernarySlice
from lightning_gradcomp.core.compressors.terngrad import TernGradCompressor
from lightning_gradcomp.core.compressors.topk import TopKCompressor

COMPRESSORS: dict[str, type[Compressor]] = {
    cls.name: cls
    for cls in (
        IdentityCompressor,
        TopKCompressor,
        ChunkedTopKCompressor,
        GaussianKCompressor,
        DGCCompressor,
        RandomKCompressor,
        ScaledSignCompressor,
        TernGradCompressor,
        BlockQuantizer,
        QSGDCompressor,
        AtomoCompressor,
        PowerSGDCompressor,
        Int8Compressor,
        FP8Compressor,
    )
}


def build_compressor(spec: str | Compressor, **kwargs: Any) -> Compressor:
    """A compressor from a registry name (with its keyword arguments) or an instance as is."""
    if isinstance(spec, Compressor):
        if kwargs:
            raise ValueError(
                f"compressor arguments {sorted(kwargs)} were given with a Compressor instance ({spec!r}); "
                "set them on the instance instead"
            )
        return spec
    if not isinstance(spec, str) or spec not in COMPRESSORS:
        raise ValueError(f"compressor must be one of {sorted(COMPRESSORS)} or a Compressor instance, got {spec!r}")
    try:
        return COMPRESSORS[spec](**kwargs)
    except TypeError as err:
        raise ValueError(f"compressor {spec!r} does not take the arguments {sorted(kwargs)}: {err}") from None


__all__ = [
    "COMPRESSORS",
    "WIRE_PRECISIONS",
    "AtomoCompressor",
    "AtomoPayload",
    "BlockQuantizer",
    "BlockScaledPayload",
    "CastPayload",
    "ChunkedPayload",
    "ChunkedTopKCompressor",
    "Compressor",
    "DGCCompressor",
    "DensePayload",
    "Entries",
    "FP8Compressor",
    "GaussianKCompressor",
    "IdentityCompressor",
    "Int8Compressor",
    "LevelsPayload",
    "LowRankPayload",
    "Payload",
    "PowerSGDCompressor",
    "QSGDCompressor",
    "RandomKCompressor",
    "ScaledSignCompressor",
    "SignPayload",
    "SparseEntries",
    "SparsePayload",
    "TernGradCompressor",
    "TernaryPayload",
    "TernarySlice",
    "TopKCompressor",
    "TwoBitPayload",
    "TwoBitValues",
    "WirePrecision",
    "all_finite",
    "build_compressor",
]
