"""The shared core: what every front end (the DDP hook, DiLoCo's outer step, HSDP's replica exchange) builds on, and
which imports none of them.

* :mod:`~lightning_gradcomp.core.compressors`: pure tensor math, ``compress(x) -> Payload`` and back, with exact wire
  sizes; no ``torch.distributed``.
* :mod:`~lightning_gradcomp.core.comm`: moving payloads between ranks (allreduce, allgather, the gTop-k butterfly,
  the node hierarchy), every byte handed to a collective counted.
* :mod:`~lightning_gradcomp.core.memory`: state carried between steps per unit (error feedback, DIANA's shifts).
* :mod:`~lightning_gradcomp.core.pipeline_arguments`: the compressor, wire precision, memory and aggregator built from
  a front end's arguments and checked against each other.
* :mod:`~lightning_gradcomp.core.flat_average`: flat tensors averaged over a group of ranks through that pipeline
  (DiLoCo's pseudo-gradients, HSDP's gradient shards).
* :mod:`~lightning_gradcomp.core.units`, :mod:`~lightning_gradcomp.core.schedule`,
  :mod:`~lightning_gradcomp.core.adaptive`, :mod:`~lightning_gradcomp.core.randomness`,
  :mod:`~lightning_gradcomp.core.warm_start`, :mod:`~lightning_gradcomp.core.workspace`: units of compression, the
  warm-ups and Accordion's adaptive rule, random streams, warm starts and kept buffers.
* :mod:`~lightning_gradcomp.core.checkpoint`, :mod:`~lightning_gradcomp.core.stats`,
  :mod:`~lightning_gradcomp.core.presets`, :mod:`~lightning_gradcomp.core.validation`: per-rank checkpoint shards,
  per-step statistics, the presets' merge rules, and argument checks.
"""
