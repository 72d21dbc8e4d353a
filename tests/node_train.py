"""One rank of a two-node run under ``torchrun`` (tests/test_nodes.py): a Trainer with ``hierarchy="node"``.

    torchrun --nnodes 2 --nproc_per_node 2 --node_rank I ... tests/node_train.py OUT_DIR

Each rank writes what the test compares to ``OUT_DIR/<global rank>.pt``.
"""

from __future__ import annotations

import sys
from datetime import timedelta
from pathlib import Path

import lightning.pytorch as pl
import torch
from models import TinyClassifier, teacher_task
from torch.utils.data import DataLoader

from lightning_gradcomp import GradCompStrategy
from lightning_gradcomp.ddp.torch_ddp import destroy_process_group


def main(out: Path) -> None:
    torch.set_num_threads(1)
    pl.seed_everything(0, verbose=False)
    model = TinyClassifier()
    strategy = GradCompStrategy(compressor="topk", density=0.05, hierarchy="node", min_compress_numel=100,
                                timeout=timedelta(seconds=60))  # fmt: skip
    trainer = pl.Trainer(accelerator="cpu", devices=2, num_nodes=2, strategy=strategy, max_steps=10, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)  # fmt: skip
    trainer.fit(model, DataLoader(teacher_task(n=1024), batch_size=16))
    hook = strategy.gradcomp_hook
    torch.save(
        {
            "weights": model.state_dict(),
            "environment": type(strategy.cluster_environment).__name__,
            "node_rank": strategy.cluster_environment.node_rank(),
            "topology": hook.topology.describe(),
            "history": list(hook.history),
        },
        out / f"{trainer.global_rank}.pt",
    )


if __name__ == "__main__":
    main(Path(sys.argv[1]))
    # the Trainer's DDP wrapper and the hook's node groups went with main's frame; the default group goes now,
    # from Python, not from the interpreter's exit (where gloo's threads once aborted the process)
    destroy_process_group()
