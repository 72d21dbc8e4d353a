"""Where HSDP's units come from: the (replicate, shard) device mesh, and ``fully_shard`` applied block by block over
its shard dimension.

A unit is what FSDP2 all-gathers before its forward and reduce-scatters after its backward, and what the replica
exchange compresses as one flat shard (:class:`~lightning_gradcomp.hsdp.ReplicaExchange`). By default the blocks are
the elements of the model's ``nn.ModuleList``\\s (a transformer's layers, as torchtitan shards them), or the module
classes named in ``unit_modules`` (as Lightning's ``FSDPStrategy`` takes ``auto_wrap_policy={Block}``); what is left
goes to a root unit. Ranks are laid out node by node (``global_rank = node_rank * devices + local_rank``), so the
shard dimension is a node's ranks and the replicate dimension crosses the nodes.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

__all__ = [
    "check_tied",
    "check_unit_modules",
    "hsdp_mesh",
    "is_unit",
    "plan_units",
    "shard_model",
    "unsharded_parameters",
]

#: The mesh's dimension names.
REPLICATE, SHARD = "replicate", "shard"
#: What ``unit_modules`` holds once checked: class names and ``nn.Module`` subclasses.
UnitModules = tuple[str | type[nn.Module], ...]
#: Containers without a ``forward``, which ``fully_shard`` refuses.
CONTAINERS = (nn.ModuleList, nn.ModuleDict)


def check_unit_modules(unit_modules: Sequence[str | type[nn.Module]] | None) -> UnitModules | None:
    """``unit_modules`` as a tuple of class names and ``nn.Module`` subclasses, or a ``ValueError`` naming it."""
    if unit_modules is None:
        return None
    entries = (unit_modules,) if isinstance(unit_modules, (str, type)) else tuple(unit_modules)
    bad = [
        e for e in entries if not (isinstance(e, str) and e) and not (isinstance(e, type) and issubclass(e, nn.Module))
    ]
    if bad or not entries:
        raise ValueError(
            f"unit_modules must be None or a non-empty list of module class names (e.g. ['TransformerBlock']) or "
            f"nn.Module subclasses, got {unit_modules!r}"
        )
    return entries


def hsdp_mesh(device_type: str, world_size: int, replicas: int) -> DeviceMesh:
    """The ``(replicate, shard)`` mesh of ``world_size`` ranks in ``replicas`` replicas of ``world_size // replicas``
    shards each (a ``ValueError`` unless ``replicas`` divides the world)."""
    if replicas < 1 or world_size % replicas:
        raise ValueError(
            f"replicate_size={replicas} must divide the world size {world_size} (each replica holds the same number "
            "of shards)"
        )
    return init_device_mesh(device_type, (replicas, world_size // replicas), mesh_dim_names=(REPLICATE, SHARD))


def is_unit(module: nn.Module, unit_modules: UnitModules | None, in_module_list: bool) -> bool:
    """Whether ``module`` is a block of its own: an element of an ``nn.ModuleList`` by default, else an instance of a
    class (or a class name) in ``unit_modules``."""
    if unit_modules is None:
        return in_module_list
    return any(_matches(module, entry) for entry in unit_modules)


def _matches(module: nn.Module, entry: str | type[nn.Module]) -> bool:
    return isinstance(module, entry) if isinstance(entry, type) else type(module).__name__ == entry


def plan_units(model: nn.Module, unit_modules: UnitModules | None, shard_root: bool) -> list[tuple[str, nn.Module]]:
    r"""The units :func:`shard_model` makes, in the order it shards them: the blocks innermost first, then the root
    (or, with ``shard_root=False``, each child holding parameters). By default the blocks are the elements of the
    outermost ``nn.ModuleList``\s (a transformer's layers; lists inside a block, such as a mixture's experts, stay in
    it: an expert that no token reaches on some rank would leave FSDP's collectives unmatched). Containers without a
    ``forward`` (``nn.ModuleList``, ``nn.ModuleDict``), which FSDP2 refuses, are never units."""
    own = [name for name, _ in model.named_parameters(recurse=False)]
    if own and not shard_root:
        raise ValueError(
            f"the LightningModule holds parameters {own} itself, which no FSDP unit can gather (the Trainer calls "
            "training_step, not its forward): move them into a submodule"
        )
    listed = {id(m) for parent in model.modules() if isinstance(parent, nn.ModuleList) for m in parent}
    blocks: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if module is model or isinstance(module, CONTAINERS) or not is_unit(module, unit_modules, id(module) in listed):
            continue
        if unit_modules is None and any(name.startswith(f"{block}.") for block, _ in blocks):
            continue  # inside an outer block
        blocks.append((name, module))
    if unit_modules is not None:
        unmatched = [e for e in unit_modules if not any(_matches(m, e) for _, m in blocks)]
        if unmatched:
            raise ValueError(
                f"unit_modules {unmatched} match no block of the model (the model itself and containers without a "
                f"forward are never blocks; its classes: {sorted({type(m).__name__ for m in model.modules()})})"
            )
    chosen = {id(m) for _, m in blocks}
    roots = [("", model)] if shard_root else _root_children(model, chosen)
    return [*reversed(blocks), *roots]


def _root_children(parent: nn.Module, chosen: set[int], prefix: str = "") -> list[tuple[str, nn.Module]]:
    """Each child of ``parent`` holding parameters and not a block already, containers by their children."""
    roots = []
    for name, child in parent.named_children():
        if id(child) in chosen or not any(True for _ in child.parameters()):
            continue
        if isinstance(child, (nn.ParameterList, nn.ParameterDict)):
            raise ValueError(
                f"the LightningModule's {prefix}{name} ({type(child).__name__}) holds parameters without a forward, "
                "which no FSDP unit can gather: move them into a module whose forward uses them"
            )
        if isinstance(child, CONTAINERS):
            roots.extend(_root_children(child, chosen, f"{prefix}{name}."))
        else:
            roots.append((f"{prefix}{name}", child))
    return roots


def check_tied(model: nn.Module, units: list[tuple[str, nn.Module]]) -> None:
    """``ValueError`` naming parameters that modules of two planned units hold (tied weights): FSDP2 shards each
    unit's parameters apart, which would untie them. A module belongs to the first unit, in the order they are
    sharded, that reaches it, as FSDP2 assigns it (a module used at several places stays one module: fine)."""
    unit_of: dict[int, str] = {}
    for name, unit in units:
        for module in unit.modules():
            unit_of.setdefault(id(module), name)
    owners: dict[int, set[str]] = {}
    paths: dict[int, str] = {}
    for path, module in model.named_modules(remove_duplicate=False):
        for key, parameter in module.named_parameters(recurse=False):
            paths.setdefault(id(parameter), f"{path}.{key}" if path else key)
            if id(module) in unit_of:
                owners.setdefault(id(parameter), set()).add(unit_of[id(module)])
    tied = sorted(f"{paths[k]} (in {sorted(u or '<root>' for u in v)})" for k, v in owners.items() if len(v) > 1)
    if tied:
        raise ValueError(
            f"parameters {tied} would be held by two FSDP units (tied weights): FSDP2 shards each unit apart, which "
            "would untie them; put the modules sharing them in one unit (unit_modules naming a module that holds "
            "both, or fully_shard in configure_model)"
        )


def shard_model(
    model: nn.Module,
    mesh: DeviceMesh,
    unit_modules: UnitModules | None = None,
    reshard_after_forward: bool = True,
    shard_root: bool = True,
    mp_policy: MixedPrecisionPolicy | None = None,
) -> list[str]:
    """``fully_shard`` the units :func:`plan_units` plans over ``mesh`` (the shard dimension), once the plan is
    checked (nothing is sharded when it is refused); returns the units' names (``""``: the root). ``mp_policy``:
    ``fully_shard``'s mixed-precision policy.

    ``shard_root=False`` is for a ``LightningModule``, whose ``forward`` the Trainer does not call (FSDP2 gathers a
    unit's parameters in its forward): each of its children holding parameters becomes a root unit instead, and
    parameters held by the module itself are refused.
    """
    units = plan_units(model, unit_modules, shard_root)
    check_tied(model, units)
    policy = {"mp_policy": mp_policy} if mp_policy is not None else {}
    for _, module in units:
        fully_shard(module, mesh=mesh, reshard_after_forward=reshard_after_forward, **policy)
    return [name for name, _ in units]


def unsharded_parameters(model: nn.Module) -> list[str]:
    """The trainable parameters of ``model`` that no FSDP unit holds (they would train apart on every rank)."""
    return [name for name, p in model.named_parameters() if p.requires_grad and not isinstance(p, DTensor)]
