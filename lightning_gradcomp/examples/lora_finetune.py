"""LoRA fine-tuning of a small language model, compressed: ``python -m lightning_gradcomp.examples.lora_finetune``.

Hugging Face's GPT-2, built from a config with random weights (nothing is downloaded; a real run starts from
``GPT2LMHeadModel.from_pretrained(...)`` instead), gets LoRA adapters on its attention and MLP projections
through PEFT and learns, on 2 CPU processes under ``strategy="ddp_topk"``, to continue token sequences that
follow a fixed successor rule. Only the adapters are trained, so only they are compressed and exchanged: the
frozen base, its tied input/output embedding included, gets no unit, state or byte. The script prints the loss
before and after, and the bytes each process handed to collectives per compressed step against what plain DDP
hands. ``--strategy ddp`` runs plain DDP for comparison; any named strategy works. Needs ``pip install
transformers peft`` (both in the ``test`` extra).
"""

from __future__ import annotations

import argparse
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_gradcomp import NAMED_STRATEGIES, GradCompStrategy
from lightning_gradcomp.core.stats import bytes_per_compressed_step

#: Tokens of the built-in task.
VOCAB = 128


def lora_gpt2(
    vocab: int = VOCAB, width: int = 64, layers: int = 2, context: int = 32, rank: int = 8
) -> torch.nn.Module:
    """A small GPT-2 (tied embeddings) with rank-``rank`` LoRA adapters on its attention and MLP projections."""
    try:
        import peft
        import transformers
    except ImportError as err:
        raise ImportError("this example needs transformers and peft: pip install transformers peft") from err
    # embeddings wider than GPT-2's 0.02: through the frozen final norm, logits of a random 0.02 embedding stay too
    # small for any adapter to make a confident prediction (pretrained weights do not have this problem)
    config = transformers.GPT2Config(
        vocab_size=vocab, n_positions=context, n_embd=width, n_layer=layers, n_head=4, initializer_range=0.3
    )
    model = transformers.GPT2LMHeadModel(config)
    lora = peft.LoraConfig(
        r=rank, lora_alpha=2 * rank, target_modules=["c_attn", "c_proj", "c_fc"], fan_in_fan_out=True
    )
    return peft.get_peft_model(model, lora)


def successor_tokens(sequences: int, context: int, vocab: int, seed: int = 0) -> torch.Tensor:
    """Sequences of ``context`` tokens from a random first token, each next token ``(5 t + 1) mod vocab``: a rule
    the adapters can learn from the current token alone."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.empty(sequences, context, dtype=torch.int64)
    tokens[:, 0] = torch.randint(0, vocab, (sequences,), generator=gen)
    for i in range(1, context):
        tokens[:, i] = (5 * tokens[:, i - 1] + 1) % vocab
    return tokens


class LoRALanguageModel(pl.LightningModule):
    """Next-token loss of a causal language model; the optimizer sees only what is trainable (the adapters)."""

    def __init__(self, model: torch.nn.Module, lr: float = 0.05) -> None:
        super().__init__()
        self.model = model
        self.lr = lr

    def training_step(self, batch: tuple[torch.Tensor], batch_idx: int) -> torch.Tensor:
        (tokens,) = batch
        loss = self.model(input_ids=tokens, labels=tokens).loss
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        trainable = [p for p in self.parameters() if p.requires_grad]
        return torch.optim.AdamW(trainable, lr=self.lr)


def finetune(strategy: Any = "ddp_topk", devices: int = 2, steps: int = 200, seed: int = 0) -> dict[str, Any]:
    """Fine-tune the adapters for ``steps`` steps; the loss before and after, on every process, and the hook's
    bytes per compressed step (``None`` for plain DDP or a run that compressed nothing).

    A preset given by name compresses every adapter: LoRA's matrices (512 elements each here) are below the
    presets' ``min_compress_numel`` of 1024, which keeps biases and norms dense.
    """
    if isinstance(strategy, str) and strategy in NAMED_STRATEGIES:
        strategy = GradCompStrategy.from_preset(strategy, min_compress_numel=256)
    pl.seed_everything(seed, verbose=False)
    module = LoRALanguageModel(lora_gpt2())
    tokens = successor_tokens(1024, 32, VOCAB, seed)
    before = _loss(module, tokens[:256])
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
    )
    trainer.fit(module, DataLoader(TensorDataset(tokens), batch_size=16, shuffle=True))
    hook = getattr(trainer.strategy, "gradcomp_hook", None)
    return {
        "before": before,
        "after": _loss(module, tokens[:256]),
        "per_step": bytes_per_compressed_step(hook.history) if hook is not None else None,
        "trainer": trainer,
    }


def _loss(module: LoRALanguageModel, tokens: torch.Tensor) -> float:
    with torch.no_grad():
        return float(module.model(input_ids=tokens, labels=tokens).loss)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--strategy", default="ddp_topk", help="ddp, ddp_topk, ddp_terngrad, ddp_diana, ...")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args(argv)
    result = finetune(args.strategy, args.devices, args.steps)
    if result["trainer"].is_global_zero:
        line = f"{args.strategy}: loss {result['before']:.3f} -> {result['after']:.3f}"
        if result["per_step"] is not None:
            sent, dense = result["per_step"]
            line += f"; bytes sent per step {sent:,.0f} (dense {dense:,.0f})"
        print(line)
    return result


if __name__ == "__main__":
    main()
