"""A byte-level GPT (Radford et al., 2019): learned token and position embeddings, pre-norm causal self-attention
blocks with GELU MLPs, a final norm and a linear head over the 256 byte values; and a LightningModule that trains it
with AdamW, a linear warm-up and a cosine decay, as such models are trained.

At its defaults (4 layers, width 128, 4 heads, 128 bytes of context) it has 0.88M parameters, and on 4 CPU ranks of
this project's 2-core machine 600 steps of 16 windows per rank take about five minutes, which brings the validation
loss on the standard library's source (:mod:`lightning_gradcomp.examples.stdlib_corpus`) from 5.5 nats per byte to
about 1.5.
"""

from __future__ import annotations

import math

import lightning.pytorch as pl
import torch
from torch import Tensor, nn
from torch.nn import functional as F

from lightning_gradcomp.core.validation import check_int, check_number

__all__ = ["VOCAB", "ByteGPT", "LanguageModel", "warmup_cosine"]

#: Byte values.
VOCAB = 256


class _Block(nn.Module):
    """Pre-norm causal self-attention, then a pre-norm MLP of four times the width, each on a residual."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.attention_norm = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.projection = nn.Linear(width, width)
        self.mlp_norm = nn.LayerNorm(width)
        self.expand = nn.Linear(width, 4 * width)
        self.contract = nn.Linear(4 * width, width)

    def forward(self, x: Tensor) -> Tensor:
        batch, length, width = x.shape
        qkv = self.qkv(self.attention_norm(x)).view(batch, length, 3, self.heads, width // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.projection(attended.transpose(1, 2).reshape(batch, length, width))
        return x + self.contract(F.gelu(self.expand(self.mlp_norm(x))))


class ByteGPT(nn.Module):
    """A causal language model over bytes: ``[batch, length]`` byte values in, ``[batch, length, 256]`` logits out.

    Args:
        context: positions it can read (at most).
        width: the residual stream's width (a multiple of ``heads``).
        heads: attention heads per block.
        layers: blocks.
    """

    def __init__(self, context: int = 128, width: int = 128, heads: int = 4, layers: int = 4) -> None:
        super().__init__()
        self.context = check_int("context", context, 1)
        check_int("heads", heads, 1)
        check_int("width", width, heads)
        if width % heads:
            raise ValueError(f"width must be a multiple of heads ({heads}), got {width}")
        check_int("layers", layers, 1)
        self.tokens = nn.Embedding(VOCAB, width)
        self.positions = nn.Embedding(context, width)
        self.blocks = nn.ModuleList(_Block(width, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, VOCAB, bias=False)

    def forward(self, ids: Tensor) -> Tensor:
        ids = ids.long()
        x = self.tokens(ids) + self.positions(torch.arange(ids.shape[1], device=ids.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))

    def get_output_embeddings(self) -> nn.Module:
        """The output layer (Hugging Face's name for it), which ``keep_last_layer_dense`` keeps dense."""
        return self.head


def warmup_cosine(step: int, warmup: int, total: int, floor: float = 0.1) -> float:
    """The learning rate's factor at ``step``: linear from ``1 / warmup`` to 1 over ``warmup`` steps, then a cosine to
    ``floor`` at ``total`` (Loshchilov and Hutter, 2017; the warm-up of Goyal et al., 2017)."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))


class LanguageModel(pl.LightningModule):
    """:class:`ByteGPT` trained with AdamW (betas 0.9 and 0.95, weight decay 0.1 on matrices only), a ``warmup``-step
    linear warm-up and a cosine decay to a tenth of ``lr`` at ``steps``; logs ``train_loss`` and ``val_loss``
    (nats per byte)."""

    def __init__(
        self,
        lr: float = 3e-3,
        steps: int = 600,
        warmup: int = 60,
        weight_decay: float = 0.1,
        context: int = 128,
        width: int = 128,
        heads: int = 4,
        layers: int = 4,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        check_number("lr", lr, 0, open_min=True)
        check_int("steps", steps, 1)
        check_int("warmup", warmup, 0)
        check_number("weight_decay", weight_decay, 0)
        self.model = ByteGPT(context, width, heads, layers)

    def forward(self, ids: Tensor) -> Tensor:
        return self.model(ids)

    def _loss(self, batch: tuple[Tensor, Tensor]) -> Tensor:
        x, y = batch
        logits = self.model(x)
        return F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch), sync_dist=True, prog_bar=True)

    def get_output_embeddings(self) -> nn.Module:
        return self.model.head

    def configure_optimizers(self) -> dict:
        decayed = [p for p in self.parameters() if p.dim() >= 2]
        kept = [p for p in self.parameters() if p.dim() < 2]
        groups = [{"params": decayed, "weight_decay": self.hparams.weight_decay}, {"params": kept, "weight_decay": 0.0}]
        optimizer = torch.optim.AdamW(groups, lr=self.hparams.lr, betas=(0.9, 0.95))
        schedule = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: warmup_cosine(step, self.hparams.warmup, self.hparams.steps)
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}
