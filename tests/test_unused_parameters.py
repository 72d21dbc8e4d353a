"""Parameters that sit out a step under ``find_unused_parameters=True``: their memory is left as it is.

DDP hands the hook zeros for a parameter this rank did not use, and keeps the average only where some rank used it
(:mod:`lightning_gradcomp.ddp.arrivals`). An auxiliary head that every rank leaves out every other step, and a side
branch that only rank 0 uses every third step, trained on 2 ranks with Top-k + error feedback, TernGrad, PowerSGD
(compressing from the second step) and DIANA: an error-feedback residual, and DIANA's shifts ``h_i``, of a
parameter stay bit for bit as they were over a step this rank sat it out; DIANA's averaged shift ``h`` stays where
every rank did. Ranks end every step with identical weights, and the loss falls.
"""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from models import SitsOut, quiet_trainer, teacher_task
from ranks import run_ranks
from torch.utils.data import DataLoader

from lightning_gradcomp import GradCompStrategy

STEPS = 12
#: the presets, PowerSGD also at rank 1 (a matrix that every rank sat out gives a zero Q, which must not stick)
CASES = {
    "ddp_topk": ("ddp_topk", {"density": 0.1}),
    "ddp_terngrad": ("ddp_terngrad", {}),
    "ddp_powersgd": ("ddp_powersgd", {}),
    "ddp_powersgd/rank 1": ("ddp_powersgd", {"compressor_kwargs": {"rank": 1}}),
    "ddp_diana": ("ddp_diana", {}),
}


class Record(pl.Callback):
    """The memory's state and the weights after every step."""

    def __init__(self) -> None:
        self.states: list[dict[str, torch.Tensor]] = []
        self.weights: list[dict[str, torch.Tensor]] = []
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, outputs, batch, batch_idx) -> None:
        self.states.append({k: v.clone() for k, v in trainer.strategy.memory.state_dict().items()})
        self.weights.append({k: v.detach().clone() for k, v in module.state_dict().items()})
        self.losses.append(float(outputs["loss"]))


def _train(rank: int, world_size: int) -> dict:
    results = {}
    for case, (preset, options) in CASES.items():
        pl.seed_everything(0, verbose=False)
        module = SitsOut()
        strategy = GradCompStrategy.from_preset(
            preset, find_unused_parameters=True, adaptive="none", warmup_steps=1, min_compress_numel=200, **options
        )
        record = Record()
        trainer = quiet_trainer(strategy, world_size, STEPS, [record])
        trainer.fit(module, DataLoader(teacher_task(n=16 * STEPS * world_size), batch_size=16))
        hook = strategy.gradcomp_hook
        results[case] = {
            "states": record.states,
            "weights": record.weights,
            "losses": record.losses,
            "compressed": [s.compressed for s in hook.history],
            "units": {name: unit.compressed for unit in hook.units for name in unit.names},
        }
    return results


def _of(state: dict[str, torch.Tensor], layer: str) -> dict[str, torch.Tensor]:
    return {key: value for key, value in state.items() if f"{layer}." in key}


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return run_ranks(_train, 2, init=False, timeout=400)


@pytest.mark.parametrize("preset", list(CASES))
def test_a_parameter_that_sits_out_keeps_its_memory_and_ranks_stay_identical(ranks: list[dict], preset: str) -> None:
    first, second = ranks[0][preset], ranks[1][preset]
    assert first["units"]["aux.weight"] and first["units"]["side.weight"]  # compressed: they have a memory
    assert first["compressed"] == [False] + [True] * (STEPS - 1)
    for step in range(STEPS):
        for key, value in first["weights"][step].items():
            assert torch.equal(value, second["weights"][step][key]), (preset, step, key)
    assert sum(first["losses"][-4:]) < sum(first["losses"][:4]), (preset, first["losses"])
    model = SitsOut()
    checked = {"unchanged": 0, "changed": 0}
    for step in range(2, STEPS):  # from the second compressed step: the memories exist
        for rank, result in enumerate((first, second)):
            before, after = result["states"][step - 1], result["states"][step]
            for layer in ("aux", "side"):
                used_here = model.uses(step, rank)[layer]
                used_anywhere = any(model.uses(step, r)[layer] for r in range(2))
                own = {k: v for k, v in _of(after, layer).items() if not k.startswith("h/")}
                averaged = {k: v for k, v in _of(after, layer).items() if k.startswith("h/")}
                if not own and not _of(before, layer):  # no memory (TernGrad), or none yet on this rank
                    continue
                same = own.keys() == {k for k in _of(before, layer) if not k.startswith("h/")} and all(
                    torch.equal(v, before[k]) for k, v in own.items()
                )
                assert same == (not used_here), (preset, step, rank, layer)
                checked["unchanged" if same else "changed"] += 1
                if averaged:  # DIANA's h moves alike on every rank, and only when some rank sent a difference
                    moved = not all(k in before and torch.equal(v, before[k]) for k, v in averaged.items())
                    assert moved == used_anywhere, (preset, step, rank, layer)
    if preset != "ddp_terngrad":
        assert checked["unchanged"] >= 10 and checked["changed"] >= 10, checked
    for step in range(3, STEPS, 2):  # the auxiliary head keeps training on the steps it is used
        before, after = first["weights"][step - 1]["aux.weight"], first["weights"][step]["aux.weight"]
        assert not torch.equal(before, after), (preset, step)
