"""What the documents' code blocks take as given: tiny models and data, named by a block's ``setup`` marker.

A block preceded by ``<!-- setup: model, x -->`` runs with ``model`` and ``x`` defined as below: a name in
``FIXTURES`` is built fresh for that block (in marker order, so ``optimizer`` finds ``model``), any other name is
this module's attribute (a class). Everything is small, on CPU, and the same on every rank (seeded), so a block
runs in well under a second (see tests/test_docs.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

WIDTH, ROWS, BATCH, CLASSES = 8, 32, 8, 4


class Block(nn.Module):
    """A residual block: the unit a transformer repeats, and what ``auto_wrap_policy={Block}`` shards."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(x))


class Net(nn.Sequential):
    """Two blocks and a head: ``Net()(x)`` has shape (rows, CLASSES)."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        super().__init__(Block(), Block(), nn.Linear(WIDTH, CLASSES))


def _dataset(rows: int = ROWS) -> TensorDataset:
    g = torch.Generator().manual_seed(7)
    return TensorDataset(torch.randn(rows, WIDTH, generator=g), torch.randint(0, CLASSES, (rows,), generator=g))


class MyLightningModule(L.LightningModule):
    """A LightningModule as users write one: its network is one ``nn.Sequential``, its data its own."""

    def __init__(self) -> None:
        super().__init__()
        self.net = Net()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(_dataset(), batch_size=BATCH)


def _seq() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(layer for _ in range(4) for layer in (nn.Linear(WIDTH, WIDTH), nn.Tanh())))


def _tokens(ns: dict[str, Any]) -> DataLoader:
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, 64, (16, 16), generator=g)
    return DataLoader([{"input_ids": row} for row in ids], batch_size=8)


# name -> builds the value from the block's namespace so far (a block's setup names are built in order)
FIXTURES: dict[str, Callable[[dict[str, Any]], Any]] = {
    "model": lambda ns: Net(),
    "seq": lambda ns: _seq(),
    "module": lambda ns: MyLightningModule(),
    "optimizer": lambda ns: torch.optim.SGD(ns["model"].parameters(), lr=0.1),
    "loss_fn": lambda ns: F.cross_entropy,
    "x": lambda ns: _dataset(16).tensors[0],
    "y": lambda ns: _dataset(16).tensors[1],
    "x1": lambda ns: _dataset(BATCH).tensors[0],
    "y1": lambda ns: _dataset(BATCH).tensors[1],
    "x2": lambda ns: _dataset(BATCH).tensors[0] + 1,
    "y2": lambda ns: _dataset(BATCH).tensors[1],
    "batches": lambda ns: [(x, x.clone()) for x in _dataset(16).tensors[0].split(BATCH)],
    "train_loader": lambda ns: DataLoader(_dataset(), batch_size=BATCH),
    "token_loader": _tokens,
    "t": lambda ns: torch.ones(1024),
    "numel": lambda ns: 1024,
    "rank": lambda ns: dist.get_rank() if dist.is_initialized() else 0,
}


def setup_names(names: list[str]) -> dict[str, Any]:
    """The namespace a block with ``<!-- setup: names -->`` starts from."""
    ns: dict[str, Any] = {}
    for name in names:
        if name in FIXTURES:
            ns[name] = FIXTURES[name](ns)
        elif name in globals() and not name.startswith("_"):
            ns[name] = globals()[name]
        else:
            raise KeyError(f"setup name {name!r} is neither in tests/docs_setup.py's FIXTURES nor one of its classes")
    return ns
