"""The methods the benchmarks compare, and how each is attached to a ``DistributedDataParallel``.

* ``dense``: plain DDP (no hook); ``fp16`` and ``powersgd``: PyTorch's own comm hooks (PowerSGD at
  rank 4), each bucket completed inside the hook as ours are (see :func:`completed`);
* every named strategy (``ddp_topk``, ...), with the hook ``GradCompStrategy`` installs for it
  (``build_hook``): the same compressor, memory, aggregator and defaults;
* variants, ``preset:what``, a named strategy with some of its arguments changed (:data:`VARIANTS`),
  for the ablations in the convergence and time-to-accuracy tables.
"""

from __future__ import annotations

from typing import Any

#: The named strategies, as registered.
OURS = (
    "ddp_gradcomp_dense",
    "ddp_terngrad",
    "ddp_topk",
    "ddp_gaussiank",
    "ddp_gtopk",
    "ddp_diana",
    "ddp_atomo",
    "ddp_efsign",
    "ddp_powersgd",
    "ddp_fp16",
    "ddp_bf16",
    "ddp_int8",
    "ddp_fp8",
)
TORCH_METHODS = ("dense", "fp16", "powersgd", "powersgd:start-10pct")
#: PyTorch's advice for ``start_powerSGD_iter``: "start with 10% of total training steps" (powerSGD_hook.py).
POWERSGD_DOCUMENTED_START = 0.1
#: The presets' arguments before the adaptive presets (Accordion, density 0.01, bfloat16 values) that differ now: the
#: Top-k family at density 0.001 with a 200-step density warm-up from 25%, float32 values; PowerSGD and ATOMO after
#: 100 dense steps. The tables' earlier rows
#: (and the variants built on them) were measured with these.
PREVIOUS_SPARSIFIER = {"density": 0.001, "adaptive": "none", "density_warmup_steps": 200, "wire_precision": None}
PREVIOUS_DENSE_START = {"adaptive": "none", "warmup_steps": 100}
#: ``name -> (named strategy, arguments that replace the preset's)``.
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    # the presets as they were before the adaptive presets
    **{f"{preset}:previous": (preset, PREVIOUS_SPARSIFIER) for preset in ("ddp_topk", "ddp_gaussiank", "ddp_gtopk")},
    **{f"{preset}:previous": (preset, PREVIOUS_DENSE_START) for preset in ("ddp_powersgd", "ddp_atomo")},
    # the first Top-k presets: density 0.001 from the first compressed step, logits compressed
    "ddp_topk:no-warmup": (
        "ddp_topk",
        {**PREVIOUS_SPARSIFIER, "density_warmup_steps": 0, "keep_last_layer_dense": False},
    ),
    "ddp_gtopk:no-warmup": (
        "ddp_gtopk",
        {**PREVIOUS_SPARSIFIER, "density_warmup_steps": 0, "keep_last_layer_dense": False},
    ),
    # DGC's momentum correction (momentum 0.9 on each rank before sparsifying; the optimizer adds none to
    # the compressed parameters), on the preset before the adaptive presets
    "ddp_topk:momentum-correction": ("ddp_topk", {**PREVIOUS_SPARSIFIER, "memory_kwargs": {"momentum": 0.9}}),
    # DIANA's QSGD without the shifts h_i: the memoryless baseline of Mishchenko et al.'s comparison (QSGD alone)
    "ddp_diana:no-memory": ("ddp_diana", {"memory": "none"}),
    # the first DIANA preset: inf-norm ternary quantizer, blocks of 1024 (omega = 15.5); without the
    # shifts, and with smaller blocks (omega 5.2 and 2.3)
    "ddp_diana:ternary": ("ddp_diana", {"compressor": "quantizer"}),
    "ddp_diana:ternary-no-memory": ("ddp_diana", {"compressor": "quantizer", "memory": "none"}),
    "ddp_diana:ternary-block-128": ("ddp_diana", {"compressor": "quantizer", "compressor_kwargs": {"block_size": 128}}),
    "ddp_diana:ternary-block-32": ("ddp_diana", {"compressor": "quantizer", "compressor_kwargs": {"block_size": 32}}),
    # DIANA's QSGD in blocks of 64 (omega bound 1.14 instead of 3.2; 4.5 bits per element instead of 4.06):
    # what closed the quickstart's gap (2 ranks, flat teacher-task gradients)
    "ddp_diana:block-64": ("ddp_diana", {"compressor_kwargs": {"block_size": 64}}),
    # the first ATOMO preset: compressed from step 2 on; and with a larger budget instead
    # (expected atoms per layer; the preset's 3 is the authors' ResNet-18 setting), on the preset before the
    # adaptive presets
    "ddp_atomo:no-dense-warmup": ("ddp_atomo", {"adaptive": "none", "warmup_steps": 1}),
    "ddp_atomo:no-dense-warmup-budget-8": (
        "ddp_atomo",
        {"adaptive": "none", "warmup_steps": 1, "compressor_kwargs": {"budget": 8}},
    ),
    "ddp_atomo:budget-16": ("ddp_atomo", {**PREVIOUS_DENSE_START, "compressor_kwargs": {"budget": 16}}),
    # random-k at Top-k's density and warm-up before the adaptive presets, unscaled with error feedback (Stich et al.,
    # 2018)
    "ddp_topk:randomk": (
        "ddp_topk",
        {**PREVIOUS_SPARSIFIER, "compressor": "randomk", "compressor_kwargs": {"scaled": False}},
    ),
    # hierarchy="node" (dense inside a node, compressed between nodes; network.py --nodes): the node's local
    # ranks share the units (sharded), or local rank 0 compresses them all (leader)
    **{
        f"{preset}:node{suffix}": (preset, {"hierarchy": "node", "hierarchy_scheme": scheme})
        for preset in ("ddp_gradcomp_dense", "ddp_topk", "ddp_gtopk", "ddp_terngrad")
        for suffix, scheme in (("", "sharded"), ("-leader", "leader"))
    },
    # TernGrad under Accordion (dense critical regimes): what reaching dense's accuracy on every seed costs
    "ddp_terngrad:accordion": ("ddp_terngrad", {"warmup_steps": 1, "adaptive": "accordion"}),
    # PowerSGD compressed from step 2 on, as the PyTorch peer here is (start_powerSGD_iter=2): for timing side by side
    "ddp_powersgd:start-2": ("ddp_powersgd", {"adaptive": "none", "warmup_steps": 2}),
    # the same, each matrix in units of its own: two collectives per matrix instead of two per group
    "ddp_powersgd:start-2-layer": ("ddp_powersgd", {"adaptive": "none", "warmup_steps": 2, "granularity": "layer"}),
}
DEFAULT_METHODS = ",".join((*TORCH_METHODS, *OURS))
#: Methods with no named strategy of their own, measured as variants next to the presets (DIANA's
#: ternary quantizer, random-k).
UNNAMED_METHODS = ("ddp_diana:ternary", "ddp_topk:randomk")
#: What makes a preset start in its steady compressed state: compressed from step 2, at its final density.
AFTER_WARMUPS: dict[str, Any] = {"warmup_steps": 1, "density_warmup_steps": 0, "adaptive": "none"}


def strategy_arguments(method: str) -> dict[str, Any]:
    """The ``GradCompStrategy`` arguments of one of our methods (a named strategy or a variant)."""
    from lightning_gradcomp import NAMED_STRATEGIES
    from lightning_gradcomp.ddp.presets import preset_arguments

    if method in VARIANTS:
        preset, changes = VARIANTS[method]
        return preset_arguments(preset, changes)
    if method in NAMED_STRATEGIES:
        return dict(NAMED_STRATEGIES[method][1])
    raise KeyError(f"unknown method {method!r}; choose from {[*TORCH_METHODS, *NAMED_STRATEGIES, *VARIANTS]}")


def check_methods(methods: list[str]) -> None:
    """Raise ``SystemExit`` naming the methods that are neither PyTorch's, named strategies, variants nor DiLoCo's."""
    unknown = []
    for method in methods:
        if (
            method not in TORCH_METHODS
            and not is_local_sgd(method)
            and method not in HSDP_METHODS
            and not (is_compressed_adam(method))
        ):
            try:
                strategy_arguments(method)
            except KeyError:
                unknown.append(method)
    if unknown:
        known = [*TORCH_METHODS, *OURS, *VARIANTS, *LOCAL_SGD, *LOCAL_SGD_VARIANTS, *LOCAL_SGD_WIRES, *HSDP_METHODS,
                 *COMPRESSED_ADAM, *COMPRESSED_ADAM_VARIANTS]  # fmt: skip
        raise SystemExit(f"unknown methods {unknown}; choose from {known}")


def completed(hook):
    """``hook`` with each bucket's future waited for before the next bucket starts.

    PyTorch's fp16 and PowerSGD hooks chain further collectives from gloo's callback threads;
    with several buckets on 4 ranks those are issued in different orders on different ranks and
    gloo aborts ("Received data size doesn't match expected size"). Completing each bucket in
    the hook, as the gradcomp hook does, keeps the order identical on every rank.
    """

    def completed_hook(state, bucket):
        future = hook(state, bucket)
        future.wait()
        return future

    completed_hook.__qualname__ = f"completed_{hook.__name__}"
    return completed_hook


def powersgd_start(method: str, steps: int) -> int:
    """``start_powerSGD_iter`` of PyTorch's PowerSGD ``method`` in a run of ``steps``: 2 (compressed from the second
    step, the fastest it allows), or 10% of the run, as its documentation advises."""
    return max(2, round(POWERSGD_DOCUMENTED_START * steps)) if method == "powersgd:start-10pct" else 2


def attach(
    method: str,
    ddp,
    model,
    seed: int = 0,
    overrides: dict[str, Any] | None = None,
    steps: int = 0,
    serial: bool = True,
):
    """Register ``method``'s comm hook on ``ddp``; returns our hook (for byte counts) or None.

    ``seed`` seeds the method's random draws (our hooks' streams, PowerSGD's initial Q);
    ``overrides`` replace our methods' strategy arguments (e.g. :data:`AFTER_WARMUPS`); ``steps``, the length
    of the run, sets ``powersgd:start-10pct``'s dense start. ``serial=False`` registers PyTorch's hooks as
    they are, overlapping the backward pass (what a step-cost comparison needs), instead of
    :func:`completed`: the fp16 hook only; the PowerSGD hook, whose callbacks issue further collectives,
    is completed bucket by bucket whatever ``serial`` says (unwrapped, gloo aborts on a collective
    mismatch even on 2 ranks).
    """
    wrap = completed if serial else (lambda hook: hook)
    import torch.distributed.algorithms.ddp_comm_hooks.default_hooks as default_hooks
    import torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook as powersgd

    from lightning_gradcomp import GradCompStrategy
    from lightning_gradcomp.ddp.hook import gradcomp_comm_hook

    if method == "dense":
        return None
    if method == "fp16":
        ddp.register_comm_hook(None, wrap(default_hooks.fp16_compress_hook))
        return None
    if method.startswith("powersgd"):
        start = powersgd_start(method, steps)
        state = powersgd.PowerSGDState(
            process_group=None, matrix_approximation_rank=4, start_powerSGD_iter=start, random_seed=seed
        )
        ddp.register_comm_hook(state, completed(powersgd.powerSGD_hook))
        return None
    hook = GradCompStrategy(**{**strategy_arguments(method), **(overrides or {})}, seed=seed).build_hook(model)
    ddp.register_comm_hook(hook, gradcomp_comm_hook)
    return hook


# ---------------------------------------------------------------- local SGD: DiLoCo, ours and torchft's

#: DiLoCo's named strategies, and torchft's DiLoCo (``torchft.local_sgd.DiLoCo``, dense fp32 outer gradients: its
#: ``should_quantize`` needs Triton, GPU only) with the paper's outer SGD (lr 0.7, Nesterov momentum 0.9).
LOCAL_SGD = ("ddp_diloco", "ddp_diloco_topk", "ddp_diloco_sparseloco", "ddp_diloco_qsgd", "torchft_diloco")


#: ``name -> (DiLoCo method, (outer lr, outer Nesterov momentum))``: the paper's outer SGD (0.7, 0.9) set for H = 500
#: and AdamW; with H = 10 and an SGD-momentum inner optimizer a lower outer momentum
LOCAL_SGD_VARIANTS: dict[str, tuple[str, tuple[float, float]]] = {
    f"{method}:momentum-0.5": (method, (0.7, 0.5)) for method in ("ddp_diloco", "ddp_diloco_qsgd", "torchft_diloco")
}


def sync_interval(method: str) -> tuple[str, int | None]:
    """``(name, H)``: a DiLoCo method ``name@H`` synchronises every ``H`` steps (``None``: the run's ``--sync-every``),
    so one run can hold a method at several intervals (``ddp_diloco@30,ddp_diloco@10``)."""
    name, at, h = method.partition("@")
    if not at:
        return name, None
    if not h.isdigit() or int(h) < 1:
        raise SystemExit(f"{method!r}: the interval after '@' must be a whole number of steps >= 1")
    return name, int(h)


#: DiLoCo with its outer average on another wire (the paper's outer Nesterov SGD): ``name -> OuterSync arguments``
LOCAL_SGD_WIRES: dict[str, dict[str, Any]] = {"ddp_diloco:int8": {"compressor": "int8", "aggregator": "two_phase"}}


def is_local_sgd(method: str) -> bool:
    """Whether ``method`` trains without DDP and synchronises every H steps (DiLoCo)."""
    name, _ = sync_interval(method)
    return name in LOCAL_SGD or name in LOCAL_SGD_VARIANTS or name in LOCAL_SGD_WIRES


class LocalSGD:
    """A DiLoCo method around one rank's ``model`` and inner ``optimizer``: call :meth:`step` after each inner step,
    :meth:`close` at the end. ``history`` holds our outer loop's ``StepStats`` (torchft's DiLoCo counts nothing)."""

    def __init__(self, method: str, model, optimizer, sync_every: int, seed: int = 0) -> None:
        self.method, self.history, self._close = method, [], lambda: None
        method, interval = sync_interval(method)
        self.sync_every = sync_every = interval or sync_every
        method, (outer_lr, outer_momentum) = LOCAL_SGD_VARIANTS.get(method, (method, (0.7, 0.9)))
        if method == "torchft_diloco":
            self.sync = None
            self._close = _torchft_diloco(model, optimizer, sync_every, outer_lr, outer_momentum)
            return
        from lightning_gradcomp.diloco import DILOCO_PRESETS, OuterSync

        arguments = dict(LOCAL_SGD_WIRES.get(method) or DILOCO_PRESETS[method][1])
        arguments.pop("sync_every", None)  # the run's, or the method's @H
        if "compressor" in arguments:
            arguments["seed"] = seed
        if "outer_lr" not in arguments:
            arguments.update(outer_lr=outer_lr, outer_momentum=outer_momentum, nesterov=outer_momentum > 0)
        self.sync = OuterSync(model.named_parameters(), sync_every=sync_every, **arguments)
        self.history = self.sync.history

    def step(self) -> None:
        """After an inner step: count it (every ``sync_every``-th synchronises; torchft's hooks do so themselves)."""
        if self.sync is not None:
            self.sync.step()

    def close(self) -> None:
        self._close()


def _torchft_diloco(model, optimizer, sync_every: int, outer_lr: float, outer_momentum: float):
    """torchft's DiLoCo for this rank, one replica group of one process: a lighthouse on rank 0 (bound to its
    address, ``HOST_ADDR`` or 127.0.0.1), a ``Manager`` with its own ``TCPStore`` and ``ProcessGroupGloo``, the
    servers bound to this rank's address only. Returns what closes it all (whatever of it was built is closed if
    building fails part way)."""
    import contextlib
    import os
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    import torchft.manager
    from torchft._torchft import LighthouseServer
    from torchft.local_sgd import DiLoCo
    from torchft.process_group import ProcessGroupGloo

    host = os.environ.get("HOST_ADDR", "127.0.0.1")
    server = torchft.manager.ManagerServer
    undo = contextlib.ExitStack()
    try:
        address: list[str | None] = [None]
        if dist.get_rank() == 0:
            try:
                lighthouse = LighthouseServer(bind=f"{host}:0", min_replicas=dist.get_world_size())
                undo.callback(lighthouse.shutdown)
                address = [f"http://{host}:{lighthouse.address().rsplit(':', 1)[1]}"]
            finally:
                dist.broadcast_object_list(address, src=0)  # None tells the other ranks it failed
        else:
            dist.broadcast_object_list(address, src=0)
        if address[0] is None:
            raise RuntimeError("torchft's lighthouse did not start on rank 0")

        def on_host(*args, bind: str, **kwargs):  # torchft binds every interface ("[::]:port") by default
            return server(*args, bind=f"{host}:{bind.rsplit(':', 1)[1]}", **kwargs)

        torchft.manager.ManagerServer = on_host
        undo.callback(setattr, torchft.manager, "ManagerServer", server)
        store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False)
        undo.callback(lambda store=store: None)  # the store lives as long as the manager that serves its address
        timeout = timedelta(seconds=300)
        group = ProcessGroupGloo(timeout=timeout)
        undo.callback(group.shutdown)
        manager = torchft.manager.Manager(
            pg=group, load_state_dict=model.load_state_dict, state_dict=model.state_dict,
            min_replica_size=dist.get_world_size(), use_async_quorum=False, timeout=timeout, quorum_timeout=timeout,
            connect_timeout=timeout, rank=0, world_size=1, store_addr=host, store_port=store.port,
            lighthouse_addr=address[0], replica_id=str(dist.get_rank()), hostname=host, init_sync=False,
        )  # fmt: skip
        undo.callback(manager.shutdown, wait=False)
        outer = torch.optim.SGD(model.parameters(), lr=outer_lr, momentum=outer_momentum, nesterov=outer_momentum > 0)
        diloco = DiLoCo(manager, [model], optimizer, outer, sync_every=sync_every)
        diloco.__enter__()
        undo.callback(diloco.__exit__, None, None, None)
    except BaseException:
        undo.close()
        raise

    def close() -> None:
        dist.barrier()  # every replica past its last synchronisation before anything goes
        undo.close()  # in reverse: the hooks, the manager, the process group, the store, the patch, the lighthouse

    return close


# ---------------------------------------------------------------- compressed Adam: the optimizer step exchanges

#: Compressed Adam's named strategies; ``name@F`` freezes the variance after ``F`` optimizer steps (else the preset's).
COMPRESSED_ADAM = ("ddp_onebit_adam", "ddp_topk_adam", "ddp_qsgd_adam")
#: ``variant -> (preset, arguments that replace the preset's)``: 0/1 Adam's variance refreshed at exponentially
#: spaced steps
COMPRESSED_ADAM_VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "ddp_onebit_adam:refresh": ("ddp_onebit_adam", {"variance_refresh": "exponential"}),
}


def is_compressed_adam(method: str) -> bool:
    """Whether the optimizer step of ``method`` exchanges a compressed momentum (compressed Adam)."""
    name, _ = sync_interval(method)
    return name in COMPRESSED_ADAM or name in COMPRESSED_ADAM_VARIANTS


def compressed_adam(method: str, optimizer, ddp, seed: int = 0, freeze_step: int | None = None):
    """``method``'s :class:`~lightning_gradcomp.CompressedAdam` around ``optimizer``, installed on ``ddp``: the variance
    frozen after ``freeze_step`` steps when given (a timing of the compressed stage), else the method's ``@F``, else
    the preset's."""
    from lightning_gradcomp import COMPRESSED_ADAM_PRESETS, CompressedAdam

    name, freeze = sync_interval(method)
    preset, changes = COMPRESSED_ADAM_VARIANTS.get(name, (name, {}))
    arguments = {**COMPRESSED_ADAM_PRESETS[preset][1], **changes, "seed": seed}
    if (freeze_step or freeze) is not None:
        arguments["freeze_step"] = freeze_step or freeze
    return CompressedAdam(optimizer, **arguments).install(ddp)


# ---------------------------------------------------------------- HSDP on FSDP2: FSDP2's own, and ours compressed

#: ``hsdp``: FSDP2's own HSDP (a 2-D mesh, dense all-reduce between replicas); ``hsdp_topk``: the exchange between
#: replicas through ``ReplicaExchange`` (Top-k of 1% with error feedback, gathered).
HSDP_METHODS = ("hsdp", "hsdp_topk")


def hsdp_model(method: str, model, replicas: int, shards: int):
    """``model`` sharded inside each node and replicated across nodes (every Linear and Conv2d a unit, then the root):
    with FSDP2's own HSDP, or over the shard dimension with the compressed replica exchange (the ``hsdp_topk``
    preset). Returns the model and the exchange (``None`` for FSDP2's own)."""
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from lightning_gradcomp import HSDP_PRESETS, ReplicaExchange

    mesh = init_device_mesh("cpu", (replicas, shards), mesh_dim_names=("replicate", "shard"))
    on = mesh if method == "hsdp" else mesh["shard"]
    for unit in [m for m in model.modules() if isinstance(m, (nn.Linear, nn.Conv2d))]:
        fully_shard(unit, mesh=on)
    fully_shard(model, mesh=on)
    if method == "hsdp":
        return model, None
    return model, ReplicaExchange(model, mesh, **HSDP_PRESETS["hsdp_topk"][1])
