"""Steps a pipeline strategy cannot replay, and cuts it cannot make: an error on every rank at the first batch,
before any schedule runs, naming what was found and the form that works."""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_haiscale  # noqa: F401 - registers the strategies
from lightning_haiscale.strategies import PipeDreamStrategy
from tests.distributed import run_distributed
from tests.strategies.real_models import BATCH, MODELS, LitLM, build, tokens


class KeywordsToSequential(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.net(input=batch[0]).sum()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class NeverCallsTheModel(LitLM):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return sum(p.sum() for p in self.parameters())


def _fit(module: L.LightningModule, strategy: Any, data: Any) -> None:
    trainer = L.Trainer(
        strategy=strategy, accelerator="cpu", devices=dist.get_world_size(), max_steps=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(module, DataLoader(data, batch_size=BATCH))


def _refused(rank: int, world: int) -> None:
    make, loss = MODELS["gpt2"]
    lm = TensorDataset(tokens())
    with pytest.raises(TypeError, match=r"calls the Sequential 'net' with keywords \['input'\].*self\.net\(x\)"):
        _fit(KeywordsToSequential(), PipeDreamStrategy(chunks=2), TensorDataset(torch.randn(8, 4)))
    with pytest.raises(RuntimeError, match=r"never called the network 'model'.*self\.model\(input_ids=x, labels=y\)"):
        _fit(NeverCallsTheModel(build(make), loss), PipeDreamStrategy(chunks=2), lm)
    with pytest.raises(ValueError, match=r"'transformer\.h\.99' is not a block of 'transformer\.h'"):
        _fit(LitLM(build(make), loss), PipeDreamStrategy(chunks=2, split_points=["model.transformer.h.99"]), lm)
    with pytest.raises(ValueError, match=r"balance='time' times the layers of an nn\.Sequential"):
        _fit(LitLM(build(make), loss), PipeDreamStrategy(chunks=2, balance="time"), lm)


@pytest.mark.slow  # 4 Trainer setups on 2 ranks: 40-140 s on the loaded 2-core machine
def test_unreplayable_steps_and_impossible_cuts_raise_on_every_rank() -> None:
    run_distributed(_refused, 2, timeout=300)
