"""What the package registers, described for help texts: strategies, compressors, memories, aggregators."""

from __future__ import annotations

from lightning.pytorch.strategies import StrategyRegistry

from lightning_gradcomp.comm import AGGREGATORS
from lightning_gradcomp.compressors import COMPRESSORS
from lightning_gradcomp.diloco import GradCompDiLoCoStrategy
from lightning_gradcomp.hsdp import GradCompHSDPStrategy
from lightning_gradcomp.memory import MEMORIES
from lightning_gradcomp.presets import DDP_VARIANTS
from lightning_gradcomp.strategy import GradCompStrategy

#: The command's name.
PROG = "gradcomp"


def _first_line(obj: object) -> str:
    return ((obj.__doc__ or "").strip().splitlines() or [""])[0].rstrip(".").replace("``", "")


def gradcomp_strategies() -> dict[str, str]:
    """Names and descriptions of the registered strategies built on :class:`GradCompStrategy`,
    :class:`~lightning_gradcomp.diloco.GradCompDiLoCoStrategy` and
    :class:`~lightning_gradcomp.hsdp.GradCompHSDPStrategy`."""
    out = {}
    for name in sorted(StrategyRegistry.available_strategies()):
        entry = StrategyRegistry[name]
        ours = (GradCompStrategy, GradCompDiLoCoStrategy, GradCompHSDPStrategy)
        if isinstance(entry["strategy"], type) and issubclass(entry["strategy"], ours):
            out[name] = entry.get("description", "")
    return out


def registry_help() -> str:
    """What is registered: strategies, compressors, memories and aggregators, for ``gradcomp --help``."""
    # the presets' DDP variants (``<preset>_find_unused_parameters_true``) as one line each, not one per preset
    named = {n: d for n, d in gradcomp_strategies().items() if not any(n.endswith(f"_{s}") for s in DDP_VARIANTS)}
    variants = {f"<preset>_{suffix}": f"any preset above with {options}" for suffix, options in DDP_VARIANTS.items()}
    strategies = {"ddp": "Lightning's DDP, uncompressed: the dense baseline", **named, **variants}
    width = max(map(len, [*strategies, *COMPRESSORS])) + 2
    lines = ["registered strategies (--trainer.strategy=NAME):"]
    lines += [f"  {name:<{width}}{desc}" for name, desc in strategies.items()]
    lines += ["", "compressors (--trainer.strategy.init_args.compressor=NAME):"]
    lines += [f"  {name:<{width}}{_first_line(cls)}" for name, cls in sorted(COMPRESSORS.items())]
    lines += [
        "",
        f"memories (init_args.memory): {', '.join(sorted(MEMORIES))}",
        f"aggregators (init_args.aggregator): {', '.join([*sorted(AGGREGATORS), 'auto'])}",
        "",
        "more commands:",
        f"  {PROG} compare --config RECIPE --strategies ddp,ddp_topk,...",
        "        run a recipe once per strategy; table, CSV, JSON and a PNG of the accuracy curves",
        f"  {PROG} demo   a short Top-k run on 2 CPU processes, no recipe needed",
        "",
        "examples:",
        f"  {PROG} fit --config recipes/quickstart.yaml",
        f"  {PROG} fit --config recipes/resnet20_cifar10_topk.yaml --data.init_args.data_dir=DIR --trainer.devices=4",
        f"  {PROG} fit --config recipes/quickstart.yaml --trainer.strategy.init_args.density=0.001",
        f"  {PROG} fit --config recipes/quickstart.yaml --trainer.strategy=ddp_terngrad",
        f"  {PROG} compare --config recipes/quickstart.yaml --strategies ddp,ddp_topk",
    ]
    return "\n".join(lines)
