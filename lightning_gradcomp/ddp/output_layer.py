"""The parameters of a model's output layer, which ``keep_last_layer_dense`` averages densely.

The output layer is the one whose gradient every class's (every token's) error flows through: TernGrad's authors
keep it in full precision (Wen et al., NIPS 2017, Sec. 5), where it is small next to the body. A model that names
its output layer is taken at its word: Hugging Face models answer ``get_output_embeddings()`` (PEFT's wrappers hold
the model that does), which in a model with tied input and output embeddings is the embedding matrix itself,
registered (and so named, and exchanged) once, under the input embedding's name. That matrix is not small: in a
language model with a large vocabulary it can be a third of the parameters, and the log says what share of the
trained elements the dense output layer is.

Any other model's output layer is found from what it does (:class:`OutputLayerWatch`): on the first forward pass
whose output carries an autograd graph (the first training step), the graph is walked back from the output (the
loss, under the Trainer) to the nearest module output or parameter; that module is the output layer, wherever it
was registered. Until then, and where the graph hides the modules (a compiled model), it is taken to be the module
holding the last registered trainable parameter, the logits layer of a model defined in the order its forward runs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

__all__ = ["OutputLayerWatch", "declared_output_layer", "output_layer_names", "registered_last"]


def output_layer_names(module: nn.Module | None, named_parameters: Sequence[tuple[str, torch.Tensor]]) -> list[str]:
    """Names (as in ``named_parameters``) of the trainable parameters of ``module``'s output layer, as known before
    a forward pass: :func:`declared_output_layer`, else :func:`registered_last`."""
    declared = declared_output_layer(module, named_parameters)
    return declared if declared is not None else registered_last(named_parameters)


def declared_output_layer(
    module: nn.Module | None, named_parameters: Sequence[tuple[str, torch.Tensor]]
) -> list[str] | None:
    """The trainable parameters of the output layers declared through ``get_output_embeddings()`` by ``module``'s
    outermost submodules that declare one (several models in one module, a frozen teacher beside a trained
    student: each declares its own); an empty list when they are all frozen, as under LoRA, where nothing of the
    output layer is exchanged; ``None`` when no declaration matches any of ``named_parameters``."""
    declared = {id(p) for output in _declared_outputs(module) for p in output.parameters()}
    if not declared & {id(p) for _, p in named_parameters}:
        return None
    return [name for name, p in named_parameters if p.requires_grad and id(p) in declared]


def registered_last(named_parameters: Sequence[tuple[str, torch.Tensor]]) -> list[str]:
    """The trainable parameters registered directly in the module holding the last trainable one."""
    trainable = [name for name, p in named_parameters if p.requires_grad]
    return _held_by(_owner(trainable[-1]), trainable) if trainable else []


class OutputLayerWatch:
    """Finds the output layer of a model that declares none from its first forward pass with an autograd graph.

    Forward hooks note the output of every module holding trainable parameters; when ``module``'s outermost forward
    (a forward called inside it, as Lightning's ``training_step`` calls ``self(x)``, is passed by, its finding kept
    as :attr:`nested_found`) returns an output that carries a graph, the graph is walked back breadth first from its
    loss (a ``"loss"`` entry, else all of its tensors), and the first step that reaches a noted module output or a
    trainable parameter decides: a parameter reached there (a weight used in the forward itself, as a tied embedding
    projecting to the logits) names its module, else the module whose output it is. Several modules at the same
    distance (two heads summed into one loss; a compiled model, whose graph holds its parameters but no module
    outputs): the one registered last. :attr:`found` then holds that module's trainable parameters (a weight shared
    with a module registered earlier, under the name it is registered by) and the hooks are removed. A forward
    without a graph (validation, a sanity check) is passed by, and so is any hook call that ``torch.compile`` or
    ``torch.jit.trace`` traces (it reads no ``grad_fn``, which would break the graph; a logger drawing the graph
    traces it): a model compiled as a whole, ``module`` included, keeps the registration-order rule. The finding is
    this rank's alone; the caller makes it every rank's.
    """

    def __init__(self, module: nn.Module, named_parameters: Sequence[tuple[str, torch.Tensor]]) -> None:
        self._trainable = {id(p): name for name, p in named_parameters if p.requires_grad}
        self._order = {name: i for i, name in enumerate(self._trainable.values())}
        #: the names of the output layer's trainable parameters, once found at the outermost forward
        self.found: list[str] | None = None
        #: what a forward inside the outermost one found (under Lightning's manual optimization the gradients,
        #: and with them the first bucket, come before the outermost forward returns): used without ``found``
        self.nested_found: list[str] | None = None
        self._noted: dict[Any, list[str]] = {}
        self._depth = 0
        holders = [
            (sub, [self._trainable[id(p)] for p in sub.parameters(recurse=False) if id(p) in self._trainable])
            for sub in module.modules()
        ]
        self._handles: list[RemovableHandle] = [
            sub.register_forward_hook(self._noter(own)) for sub, own in holders if own
        ]
        self._handles.append(module.register_forward_pre_hook(self._enter))
        self._handles.append(module.register_forward_hook(self._decide, always_call=True))  # a raising one too

    @property
    def watching(self) -> bool:
        """Whether the output layer is still to be found."""
        return bool(self._handles)

    def remove(self) -> None:
        """Stop watching (the hooks are removed)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._noted = {}

    def _noter(self, own: list[str]) -> Callable[[nn.Module, Any, Any], None]:
        def note(_module: nn.Module, _inputs: Any, output: Any) -> None:
            if torch.compiler.is_compiling():  # a compiled graph has no module outputs to note (nor grad_fn to read)
                return
            for tensor in _tensors(output):
                if tensor.grad_fn is not None:
                    self._noted.setdefault(tensor.grad_fn, own)

        return note

    def _enter(self, _module: nn.Module, _inputs: Any) -> None:
        self._depth += 1

    def _decide(self, _module: nn.Module, _inputs: Any, output: Any) -> None:
        self._depth = max(0, self._depth - 1)  # a pre-hook that raised before ours leaves nothing counted
        if torch.compiler.is_compiling() or torch.jit.is_tracing():  # a traced call (a logger drawing the graph)
            return
        roots = [t.grad_fn for t in _loss_tensors(output) if t.grad_fn is not None]
        if self._depth:  # a call inside the outermost one (``self(x)`` in ``training_step``): a fallback only
            if roots and self.nested_found is None:
                self.nested_found = self._last_registered(self._nearest(roots))
            return
        if not roots:
            self._noted = {}
            return
        candidates = self._nearest(roots)
        self.remove()
        self.found = self._last_registered(candidates)

    def _last_registered(self, candidates: list[list[str]]) -> list[str] | None:
        """Of several modules at the same distance, the one registered last."""
        return max(candidates, key=lambda names: max(self._order[n] for n in names)) if candidates else None

    def _nearest(self, roots: list[Any]) -> list[list[str]]:
        """The trainable parameters of each module owning the first parameters reached from ``roots``, else of each
        module whose output is reached first."""
        frontier, seen = list(dict.fromkeys(roots)), set(roots)
        while frontier:
            reached = [self._trainable.get(id(getattr(node, "variable", None))) for node in frontier]
            owners = dict.fromkeys(_owner(name) for name in reached if name is not None)
            if owners:
                return [_held_by(owner, list(self._order)) for owner in owners]
            outputs = [self._noted[node] for node in frontier if node in self._noted]
            if outputs:
                return outputs
            following = [after for node in frontier for after, _ in node.next_functions if after is not None]
            frontier = [node for node in dict.fromkeys(following) if node not in seen]
            seen.update(frontier)
        return []


def _loss_tensors(output: Any) -> list[torch.Tensor]:
    """Where the graph is walked from: a ``"loss"`` entry (the Trainer's ``{"loss": ...}``, a ``ModelOutput``), else
    every tensor of the output (the loss a ``training_step`` returns, logits, an auxiliary loss beside them)."""
    if isinstance(output, dict) and isinstance(output.get("loss"), torch.Tensor):
        return [output["loss"]]
    return list(_tensors(output))


def _tensors(output: Any) -> Iterator[torch.Tensor]:
    """The tensors in a forward's output, nested in lists, tuples and dicts (a ``ModelOutput``, the Trainer's
    ``{"loss": ...}``)."""
    if isinstance(output, torch.Tensor):
        yield output
    elif isinstance(output, (list, tuple)):
        for item in output:
            yield from _tensors(item)
    elif isinstance(output, dict):
        for item in output.values():
            yield from _tensors(item)


def _owner(name: str) -> str:
    """The module path of parameter ``name``."""
    return name.rpartition(".")[0]


def _held_by(owner: str, names: Sequence[str]) -> list[str]:
    """The parameter names among ``names`` registered directly in module ``owner``."""
    return [name for name in names if _owner(name) == owner]


def _declared_outputs(module: nn.Module | None) -> list[nn.Module]:
    """The output layers declared through ``get_output_embeddings()`` by ``module`` or, where it declares none, by
    its outermost submodules that do (a declaration that needs arguments or fails counts as none)."""
    if module is None:
        return []
    declare = getattr(module, "get_output_embeddings", None)
    if callable(declare):
        try:
            output = declare()
        except (TypeError, NotImplementedError, AttributeError):
            output = None
        if isinstance(output, nn.Module):
            return [output]
    return [output for child in module.children() for output in _declared_outputs(child)]
