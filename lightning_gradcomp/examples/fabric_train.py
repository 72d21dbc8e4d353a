"""A Lightning Fabric loop with compressed gradients, complete: ``python -m lightning_gradcomp.examples.fabric_train``.

Two CPU processes (Fabric starts them) train a two-layer perceptron on the built-in teacher task
(:mod:`lightning_gradcomp.examples.teacher`, nothing downloaded) with ``strategy="ddp_topk"``, then print
the validation accuracy and the bytes each process handed to collectives per step against what plain
DDP hands. ``--strategy ddp`` runs plain DDP for comparison; any named strategy works.
"""

from __future__ import annotations

import argparse

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader

import lightning_gradcomp  # noqa: F401  (registers the named strategies with Fabric)
from lightning_gradcomp.core.stats import bytes_per_compressed_step
from lightning_gradcomp.ddp.torch_ddp import destroy_process_group
from lightning_gradcomp.examples.teacher import teacher_dataset


def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--strategy", default="ddp_topk", help="ddp, ddp_topk, ddp_gtopk, ddp_terngrad, ...")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args(argv)

    fabric = L.Fabric(accelerator=args.accelerator, devices=args.devices, strategy=args.strategy)
    fabric.launch()
    fabric.seed_everything(0)
    model = nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model, optimizer = fabric.setup(model, optimizer)
    train = fabric.setup_dataloaders(DataLoader(teacher_dataset(8192, 64, 10, seed=0), batch_size=32, shuffle=True))
    val = fabric.setup_dataloaders(DataLoader(teacher_dataset(2048, 64, 10, seed=0), batch_size=256))

    step = 0
    while step < args.steps:
        for x, y in train:
            loss = nn.functional.cross_entropy(model(x), y)
            optimizer.zero_grad()
            fabric.backward(loss)
            optimizer.step()
            step += 1
            if step == args.steps:
                break

    model.eval()
    with torch.no_grad():
        counts = torch.tensor([0.0, 0.0])
        for x, y in val:
            counts += torch.tensor([float((model(x).argmax(dim=1) == y).sum()), float(len(y))])
    correct, seen = fabric.all_reduce(counts, reduce_op="sum").tolist()
    accuracy = correct / seen
    hook = getattr(fabric.strategy, "gradcomp_hook", None)
    per_step = bytes_per_compressed_step(hook.history) if hook is not None else None
    if per_step is not None:
        sent, dense = per_step
        fabric.print(f"{args.strategy}: val_acc {accuracy:.4f}; bytes sent per step {sent:,.0f} (dense {dense:,.0f})")
    else:
        fabric.print(f"{args.strategy}: val_acc {accuracy:.4f} (no compressed step)")
    del model, optimizer  # the DDP wrapper goes before the process group
    destroy_process_group()
    return accuracy


if __name__ == "__main__":
    main()
