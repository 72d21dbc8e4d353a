"""The parameters of a model's output layer, which ``keep_last_layer_dense`` averages densely.

The output layer is the one whose gradient every class's (every token's) error flows through: TernGrad's authors
keep it in full precision (Wen et al., NIPS 2017, Sec. 5), where it is small next to the body. A model that names
its output layer is taken at its word: Hugging Face models answer ``get_output_embeddings()`` (PEFT's wrappers hold
the model that does), which in a model with tied input and output embeddings is the embedding matrix itself,
registered (and so named, and exchanged) once, under the input embedding's name. That matrix is not small: in a
language model with a large vocabulary it can be a third of the parameters, and the setup log says what share of
the trained elements the dense output layer is. Any other model's output layer is taken to be the module holding
its last registered trainable parameter, the logits layer of a model defined in the order its forward runs.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

__all__ = ["output_layer_names"]


def output_layer_names(module: nn.Module | None, named_parameters: Sequence[tuple[str, torch.Tensor]]) -> list[str]:
    """Names (as in ``named_parameters``) of the trainable parameters of ``module``'s output layer.

    The declared output layers of ``module``'s outermost submodules that declare one (several models in one module,
    a frozen teacher beside a trained student: each declares its own), trainable ones only; an empty list when they
    are all frozen, as under LoRA, where nothing of the output layer is exchanged. Without a declaration that
    matches any of ``named_parameters``: the parameters registered in the module holding the last trainable one.
    """
    trainable = [(name, p) for name, p in named_parameters if p.requires_grad]
    declared = {id(p) for output in _declared_outputs(module) for p in output.parameters()}
    if declared & {id(p) for _, p in named_parameters}:
        return [name for name, p in trainable if id(p) in declared]
    if not trainable:
        return []
    owner = trainable[-1][0].rpartition(".")[0]
    return [name for name, _ in trainable if name.rpartition(".")[0] == owner]


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
