"""A plain torch DDP script with compressed gradients, complete, resumable:

    torchrun --nproc_per_node 2 -m lightning_gradcomp.examples.torchrun_train --checkpoint runs/torchrun

Each process trains a two-layer perceptron on the built-in teacher task
(:mod:`lightning_gradcomp.examples.teacher`) in a hand-made ``DistributedDataParallel`` whose gradient
exchange is the ``ddp_topk`` preset's, installed by :func:`lightning_gradcomp.make_hook`. With
``--checkpoint``, every rank saves its model, optimizer and hook state (the hook's differs per rank:
residuals, step counter) at the end and a later run starts from there.
"""

from __future__ import annotations

import argparse
import os
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler

from lightning_gradcomp import gradcomp_comm_hook, make_hook
from lightning_gradcomp.core.stats import bytes_per_compressed_step
from lightning_gradcomp.ddp.torch_ddp import destroy_process_group
from lightning_gradcomp.examples.teacher import teacher_dataset


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="ddp_topk", help="a named strategy: ddp_topk, ddp_gtopk, ddp_terngrad, ...")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--checkpoint", type=Path, help="folder of the per-rank checkpoints (resumed if present)")
    args = parser.parse_args(argv)

    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo", timeout=timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if torch.cuda.is_available() else torch.device("cpu")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 10)).to(device)
    ddp = DistributedDataParallel(model)
    hook = make_hook(ddp, args.preset)
    ddp.register_comm_hook(hook, gradcomp_comm_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    start = 0
    path = args.checkpoint / f"rank{rank:05d}-of-{world:05d}.pt" if args.checkpoint else None
    if path is not None and path.exists():
        state = torch.load(path, map_location=device, weights_only=True)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        hook.load_state_dict(state["hook"])
        start = state["step"]

    data = teacher_dataset(8192, 64, 10, seed=0)
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=32, sampler=sampler)
    step, epoch = start, start // len(loader)
    while step < start + args.steps:
        sampler.set_epoch(epoch)
        for i, (x, y) in enumerate(loader):
            if epoch * len(loader) + i < step:
                continue  # resumed mid-epoch: skip the batches already seen
            loss = nn.functional.cross_entropy(ddp(x.to(device)), y.to(device))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            step += 1
            if step == start + args.steps:
                break
        epoch += 1

    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "hook": hook.state_dict()}
        torch.save({**state, "step": step}, path)

    val = teacher_dataset(2048, 64, 10, seed=0)
    with torch.no_grad():
        accuracy = float((model(val.tensors[0].to(device)).argmax(dim=1).cpu() == val.tensors[1]).float().mean())
    sent, dense = bytes_per_compressed_step(hook.history) or (0.0, 0.0)
    if rank == 0:
        print(f"{args.preset}: step {step}, val_acc {accuracy:.4f}; bytes sent per step {sent:,.0f} "
              f"(dense {dense:,.0f})")  # fmt: skip
    del ddp, model, optimizer  # the DDP wrapper goes before the process group
    destroy_process_group()


if __name__ == "__main__":
    main()
