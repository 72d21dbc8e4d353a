"""The models the benchmarks train, by name, with the shape of one input and how a batch's loss is taken.

Image classifiers take ``(batch, *shape)`` float inputs and integer labels. The language model
``lm`` takes ``(batch, CONTEXT)`` token ids and predicts each next token; its text is generated
here (:func:`markov_corpus`), so that nothing is downloaded. ``stdlib-lm``, a byte-level GPT
(:mod:`lightning_gradcomp.examples.gpt`), reads real text that ships with every Python: the standard
library's own source (:mod:`lightning_gradcomp.examples.stdlib_corpus`).
"""

from __future__ import annotations

import math

#: ``name -> (description, input shape)``.
MODELS: dict[str, tuple[str, tuple[int, ...]]] = {
    "mlp": ("MLP on 3x32x32 inputs, 3072-W-W-10 (1.84M parameters at width 512)", (3, 32, 32)),
    "lenet": ("LeNet-5 on 1x28x28 MNIST images (61,706 parameters)", (1, 28, 28)),
    "mnist-mlp": ("MLP on 1x28x28 MNIST images, 784-1024-1024-10 (1.86M parameters)", (1, 28, 28)),
    "lm": ("causal Transformer language model: 2 layers, width 128, 4 heads, 64 tokens of context, a vocabulary "
           "of 64 (0.42M parameters)", (64,)),
    "stdlib-lm": ("byte-level GPT on the CPython standard library's source: 4 layers, width 128, 4 heads, 128 bytes "
                  "of context (0.88M parameters)", (128,)),
}  # fmt: skip
#: The language models: validated by their loss (nats per token), trained with AdamW.
LANGUAGE_MODELS = ("lm", "stdlib-lm")
#: The byte-level GPT's context.
STDLIB_CONTEXT = 128

#: The language model's vocabulary and context.
VOCAB = 64
CONTEXT = 64


def build_model(name: str, width: int = 512):
    """A fresh model ``name`` (``width`` sizes the ``mlp``), initialised from torch's current seed."""
    from torch import nn

    def mlp(inputs: int, width: int) -> nn.Module:
        return nn.Sequential(
            nn.Flatten(), nn.Linear(inputs, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10)
        )

    if name == "mlp":
        return mlp(3072, width)
    if name == "lenet":
        from lightning_gradcomp.examples.models import LeNet5

        return LeNet5()
    if name == "mnist-mlp":
        return mlp(784, 1024)
    if name == "lm":
        return CausalTransformer()
    if name == "stdlib-lm":
        from lightning_gradcomp.examples.gpt import ByteGPT

        return ByteGPT(context=STDLIB_CONTEXT)
    raise KeyError(f"unknown model {name!r}; choose from {list(MODELS)}")


def loss(name: str, output, target):
    """The training loss of model ``name``'s ``output``: cross-entropy over classes, or over every next token."""
    from torch import nn

    if name in LANGUAGE_MODELS:
        return nn.functional.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1).long())
    return nn.functional.cross_entropy(output, target)


def random_batch(name: str, batch: int, generator):
    """Random inputs and targets of model ``name``'s shapes (what a step costs does not depend on the values)."""
    import torch

    if name in LANGUAGE_MODELS:
        vocab, context = (VOCAB, CONTEXT) if name == "lm" else (256, STDLIB_CONTEXT)
        tokens = torch.randint(0, vocab, (batch, context + 1), generator=generator)
        return tokens[:, :-1], tokens[:, 1:]
    shape = MODELS[name][1]
    return torch.randn(batch, *shape, generator=generator), torch.randint(0, 10, (batch,), generator=generator)


def CausalTransformer():
    """A GPT-style decoder: token and position embeddings, pre-norm causal self-attention blocks, a linear head.

    (Lightning's demo ``Transformer`` is an encoder-decoder whose decoder is fed the very tokens it must
    predict under its causal mask, so its loss says little about language modelling.)
    """
    import torch
    from torch import nn

    class _CausalTransformer(nn.Module):
        def __init__(self, width: int = 128, heads: int = 4, layers: int = 2) -> None:
            super().__init__()
            self.tokens = nn.Embedding(VOCAB, width)
            self.positions = nn.Embedding(CONTEXT, width)
            block = nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0, batch_first=True, norm_first=True)
            self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
            self.norm = nn.LayerNorm(width)
            self.head = nn.Linear(width, VOCAB)
            self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(CONTEXT), persistent=False)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            length = ids.shape[1]
            x = self.tokens(ids) + self.positions(torch.arange(length, device=ids.device))
            x = self.blocks(x, mask=self.mask[:length, :length], is_causal=True)
            return self.head(self.norm(x))

    return _CausalTransformer()


def markov_corpus(tokens: int, seed: int = 0, successors: int = 4):
    """``tokens`` token ids drawn from a fixed random second-order Markov chain over :data:`VOCAB` ids.

    Each pair of preceding tokens allows ``successors`` next tokens, with probabilities proportional to
    ``1, 1/2, ..., 1/successors`` (Zipf's law); which ones is drawn once from ``seed``. A model that
    learns the chain reaches its entropy rate, :func:`markov_entropy` nats per token (1.2 for 4
    successors), from ``log(VOCAB)`` = 4.16 at the start.
    """
    import torch

    generator = torch.Generator().manual_seed(seed)
    table = torch.randint(0, VOCAB, (VOCAB, VOCAB, successors), generator=generator).tolist()
    weights = torch.tensor([1.0 / (r + 1) for r in range(successors)])
    choices = torch.multinomial(weights, tokens, replacement=True, generator=generator).tolist()
    out = [0, 1]
    for choice in choices[2:]:
        out.append(table[out[-2]][out[-1]][choice])
    return torch.tensor(out[:tokens], dtype=torch.long)


def markov_entropy(successors: int = 4) -> float:
    """The chain's entropy rate in nats per token (the best validation loss a model can reach)."""
    weights = [1.0 / (r + 1) for r in range(successors)]
    total = sum(weights)
    return -sum(w / total * math.log(w / total) for w in weights)
