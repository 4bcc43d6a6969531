"""A small LightningModule and its single-process reference: what the pipeline parity tests and the GPU
check compare every strategy with.

``Classifier`` is an 8-layer MLP in an ``nn.Sequential`` (so every pipeline can split it) written in the
form Lightning documents; ``reference`` trains it in plain PyTorch on the rows Lightning's sampler gives
each data-parallel replica, with SGD (Adam's normalised step would hide a wrong gradient scale).
"""

from __future__ import annotations

import itertools
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DistributedSampler, TensorDataset

__all__ = ["BATCH", "LR", "STEPS", "Classifier", "data", "reference"]

BATCH, STEPS, LR = 8, 5, 0.1


class Classifier(L.LightningModule):
    """The supported form, verbatim: the strategy must train it with no edit."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        widths = [6, 16, 16, 16, 16, 16, 16, 16]
        self.net = nn.Sequential(
            *(nn.Sequential(nn.Linear(a, b), nn.Tanh()) for a, b in itertools.pairwise(widths)), nn.Linear(16, 4)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        out = self(x)
        loss = F.cross_entropy(out, y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", F.cross_entropy(self(x), y))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=LR, momentum=0.9)


def data(n: int = BATCH * STEPS * 2) -> TensorDataset:
    g = torch.Generator().manual_seed(7)
    return TensorDataset(torch.randn(n, 6, generator=g), torch.randint(0, 4, (n,), generator=g))


def reference(
    steps: int,
    batch: int,
    accumulate: int = 1,
    dp: int = 1,
    clip: float | None = None,
    rows: int = BATCH * STEPS * 2,
) -> tuple[dict[str, torch.Tensor], float]:
    """Plain PyTorch on the batches Lightning's sampler gives (shuffled, sharded by data-parallel rank): each
    optimizer step's samples from every replica, their mean loss, gradients clipped to norm ``clip``."""
    module = Classifier()
    opt = torch.optim.SGD(module.parameters(), lr=LR, momentum=0.9)
    x, y = data(rows).tensors
    orders = [list(DistributedSampler(data(rows), num_replicas=dp, rank=r, shuffle=True, seed=0)) for r in range(dp)]
    per_step = batch * accumulate
    for step in range(steps):
        rows = [i for order in orders for i in order[step * per_step : (step + 1) * per_step]]
        opt.zero_grad()
        loss = F.cross_entropy(module(x[rows]), y[rows])
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(module.parameters(), clip)
        opt.step()
    return {k: v.detach() for k, v in module.state_dict().items()}, float(loss.detach())
