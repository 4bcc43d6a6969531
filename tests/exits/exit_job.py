"""A script that trains two steps and ends with nothing else (what a user's last lines look like): under
torchrun, ``python exit_job.py <trainer|fabric> <strategy>``. Its exit status is the test (test_exits.py).
The Trainer and Fabric scripts do not destroy the process group: the strategy that created it does."""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from torch import nn


def trainer(strategy: str) -> None:
    import lightning as L
    from torch.utils.data import DataLoader

    import lightning_haiscale  # noqa: F401  (registers the strategies)
    from lightning_haiscale.testing.parity import BATCH, Classifier, data

    trainer = L.Trainer(
        strategy=strategy, accelerator="cpu", devices=2, max_steps=2, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0,
    )  # fmt: skip
    trainer.fit(Classifier(), DataLoader(data(), batch_size=BATCH))


def fabric(strategy: str) -> None:
    from lightning.fabric import Fabric

    import lightning_haiscale  # noqa: F401  (registers the Fabric strategies)

    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    module = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
    model = fabric.setup_module(module)
    optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1))
    for _ in range(2):
        x = torch.randn(4, 8)
        fabric.backward(F.mse_loss(model(x), x[:, :1]))
        optimizer.step()
        optimizer.zero_grad()
    fabric.all_reduce(torch.ones(1))  # the script ends right after a collective


if __name__ == "__main__":
    {"trainer": trainer, "fabric": fabric}[sys.argv[1]](sys.argv[2])
