"""TernGrad steps of a one-process DDP whose backward pass runs on a thread of its own, as a comm hook's kernels are
called from autograd's thread: what test_fused.py (``torch.compile``) and test_ahead.py (packages) train with."""

from __future__ import annotations

import threading

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from lightning_gradcomp import gradcomp_comm_hook, make_hook
from lightning_gradcomp.core.compressors.kernels import draw_packed_codes
from lightning_gradcomp.core.fused import set_codec_mode


class Net(nn.Module):
    """Two linear layers: units of two sizes, both compressed."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(64, 1024)
        self.head = nn.Linear(1024, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.body(x)))


def train_on_a_backward_thread(group: dist.ProcessGroup, codecs: str, form: str, steps: int) -> dict:
    """``steps`` TernGrad steps under the codec mode ``codecs`` (unclipped: its scaler ``max|g|`` is exact in any order,
    where the clipped one's variance may differ by a rounding, and a code with it), recording which threads call the
    packing kernel's ``form`` (``"compiled"`` or ``"ahead"``): the weights, that form's calls, the callers' names."""
    set_codec_mode(codecs)
    torch.manual_seed(0)
    model = Net()
    ddp = DistributedDataParallel(model, process_group=group)
    hook = make_hook(ddp, "ddp_terngrad", warmup_steps=0, min_compress_numel=100, compressor_kwargs={"clip_sigma": 0})
    ddp.register_comm_hook(hook, gradcomp_comm_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(32, 64), torch.randint(0, 4, (32,))
    counter = f"{form}_calls"
    callers, calls, original = [], getattr(draw_packed_codes, counter), getattr(draw_packed_codes, form)

    def recording(*args: object) -> object:  # which thread calls the kernel's form
        callers.append(threading.current_thread().name)
        return original(*args)

    setattr(draw_packed_codes, form, recording)
    try:
        for step in range(steps):
            optimizer.zero_grad()
            loss = nn.functional.cross_entropy(ddp(x), y)
            worker = threading.Thread(target=loss.backward, name=f"backward-{step}")
            worker.start()
            worker.join()
            optimizer.step()
    finally:
        delattr(draw_packed_codes, form)
    return {
        "weights": [p.detach().clone() for p in model.parameters()],
        "calls": getattr(draw_packed_codes, counter) - calls,
        "callers": sorted(set(callers)),
    }
