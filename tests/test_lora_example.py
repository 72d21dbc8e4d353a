"""The LoRA fine-tuning example (``lightning_gradcomp.examples.lora_finetune``) on 2 CPU ranks: the adapters, and
only they, are compressed and exchanged, and the loss falls (skipped without transformers and peft)."""

from __future__ import annotations

import pytest
import torch
from ranks import run_ranks

pytest.importorskip("transformers")
pytest.importorskip("peft")


def _finetune(rank: int, world_size: int) -> dict:
    from lightning_gradcomp.examples.lora_finetune import finetune

    result = finetune("ddp_topk", devices=world_size, steps=40)
    trainer = result.pop("trainer")
    hook = trainer.strategy.gradcomp_hook
    module = trainer.lightning_module
    return {
        **result,
        "unit_names": [name for unit in hook.units for name in unit.names],
        "adapters": {n: p.detach().clone() for n, p in module.named_parameters() if p.requires_grad},
    }


def test_the_lora_example_exchanges_only_compressed_adapters_and_learns() -> None:
    ranks = run_ranks(_finetune, 2, init=False, timeout=400)
    first, second = ranks
    assert first["unit_names"] and all(".lora_" in name for name in first["unit_names"])
    assert first["adapters"].keys() == set(first["unit_names"])
    for name, value in first["adapters"].items():
        assert torch.equal(value, second["adapters"][name]), name  # ranks bit-identical
    assert first["after"] < first["before"] - 0.5
    sent, dense = first["per_step"]
    assert sent < dense / 2
