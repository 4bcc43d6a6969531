"""``Trainer(strategy="hai_ddp")`` on a model whose gradients live in both homes (reducer [Note: where
gradients live]): the MLP's 1.1 MiB (float64) weights are reduced in place, the rest packed in shared buckets.

Against one process with SGD, in float64 (``_run_all``; relative 1e-9 of each parameter's norm, ``FLOAT64_RTOL``:
tests/strategies/test_hai_ddp.py), with gradient accumulation (the
Trainer's ``no_sync``) and Lightning's ``zero_grad(set_to_none=True)``; a resumed run equals the
uninterrupted one bit-for-bit.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DistributedSampler, TensorDataset

import lightning_haiscale  # noqa: F401  (registers "hai_ddp")
from examples.gpt.lightning_module import GPTLightningModule
from examples.gpt.model import config, lm_loss
from lightning_haiscale.testing.parity import default_dtype
from tests.distributed import run_distributed
from tests.strategies.helpers import lm_dataset, quiet_fit
from tests.strategies.test_hai_ddp import _assert_close, _Losses

CFG = config("tiny", n_layer=1, n_embd=192, n_head=4, block_size=16, bias=False)  # MLP: 768 x 192 fp64 (1.1 MiB)
BATCH = 2  # sequences per rank and micro-batch
LR = 0.5


class _SGDGPT(GPTLightningModule):
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=LR, momentum=0.9)


def _module() -> _SGDGPT:
    torch.manual_seed(0)
    module = _SGDGPT(CFG)
    module.configure_model()
    return module


class _Homes(L.Callback):
    """Records which parameters the reducer reduces in place."""

    def on_train_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        reducer = trainer.strategy.model.reducer
        self.in_place = [name for name, home in zip(reducer.names, reducer.in_place, strict=True) if home]


def _reference(module: GPTLightningModule, world: int, steps: int, accumulate: int, data: TensorDataset) -> nn.Module:
    """One process; each step's batch is every rank's micro-batches of that step, dealt as Lightning deals them."""
    ref = copy.deepcopy(module.model)
    opt = torch.optim.SGD(ref.parameters(), lr=LR, momentum=0.9)
    samplers = [DistributedSampler(data, num_replicas=world, rank=r, shuffle=True, seed=0) for r in range(world)]
    rows_per_step = BATCH * accumulate
    for step in range(steps):
        rows = [i for s in samplers for i in list(s)[step * rows_per_step : (step + 1) * rows_per_step]]
        x, y = data[torch.tensor(rows)]
        lm_loss(ref(x), y).backward()
        opt.step()
        opt.zero_grad()
    return ref


def _accumulation_matches_one_process(rank: int, world: int, tmp: Path) -> None:
    data = lm_dataset(CFG, 3 * 2 * world * BATCH)
    module, homes = _module(), _Homes()
    ref = _reference(module, world, 3, 2, data)
    quiet_fit(module, "hai_ddp", 3, data, BATCH, accumulate_grad_batches=2, callbacks=[homes])
    assert homes.in_place == ["model.1.mlp.c_fc.weight", "model.1.mlp.c_proj.weight"]
    _assert_close(module.model, ref)


def _resume_is_bit_for_bit(rank: int, world: int, tmp: Path) -> None:
    data = lm_dataset(CFG, 3 * world * BATCH)  # 3 steps an epoch: see tests/strategies/test_hai_ddp.py
    whole, resumed = _Losses(), _Losses()
    saver = ModelCheckpoint(dirpath=tmp / "homes", filename="{step}", every_n_train_steps=3, save_top_k=-1)
    first, second = _module(), _module()
    quiet_fit(first, "hai_ddp", 6, data, BATCH, callbacks=[whole, saver], enable_checkpointing=True)
    quiet_fit(second, "hai_ddp", 6, data, BATCH, callbacks=[resumed], ckpt_path=tmp / "homes" / "step=3.ckpt")
    assert resumed.losses == whole.losses[3:]
    expected = first.state_dict()
    assert all(torch.equal(v, expected[k]) for k, v in second.state_dict().items())


@default_dtype(torch.float64)
def _run_all(rank: int, world: int, tmp: str, checks: list[Any]) -> None:
    for check in checks:
        check(rank, world, Path(tmp))
        dist.barrier()


def test_both_gradient_homes_under_the_trainer(tmp_path: Path) -> None:
    checks = [_accumulation_matches_one_process, _resume_is_bit_for_bit]
    run_distributed(_run_all, 2, str(tmp_path), checks, timeout=240)
