"""What every Lightning example shares: an unchanged LightningModule and its data."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from torch.utils.data import DataLoader, TensorDataset

from examples.plain.common import toy_model


class ToyRegression(LightningModule):
    """A LightningModule as users write it: nothing in it knows which strategy trains it."""

    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.net = toy_model(width)  # the one nn.Sequential: pipeline strategies cut it into stages

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        out = self(x)
        loss = F.mse_loss(out, y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def toy_loader(samples: int = 2048, width: int = 64, batch_size: int = 32) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(samples, width, generator=g)
    return DataLoader(TensorDataset(x, x[:, : width // 2].sum(dim=1, keepdim=True)), batch_size=batch_size)
