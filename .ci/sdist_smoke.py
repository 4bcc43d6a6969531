"""The installed package as a user meets it: run from outside the source tree by ``.ci/sdist_check``.

    python -m torch.distributed.run --nproc-per-node 2 sdist_smoke.py allreduce   # the engine, 2 processes
    python sdist_smoke.py fit                                                     # 2 hai_ddp steps, 2 processes

``--editable`` after the check's name accepts an editable install of this checkout (``make test-min``).
Exits non-zero on any failure; prints one line per check on rank 0.
"""

from __future__ import annotations

import importlib.metadata
import sys
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_haiscale
from lightning_haiscale.hfreduce import Communicator, simd_level

SOURCE_TREE = Path(__file__).resolve().parents[1]
EDITABLE = sys.argv[2:] == ["--editable"]


def check_installed() -> str:
    where = Path(lightning_haiscale.__file__).resolve()
    if SOURCE_TREE in where.parents and not EDITABLE:
        raise SystemExit(f"lightning_haiscale was imported from the source tree ({where}), not the install")
    version = importlib.metadata.version("lightning-haiscale")
    if version != lightning_haiscale.__version__:
        raise SystemExit(f"metadata version {version} is not __version__ {lightning_haiscale.__version__}")
    return f"lightning-haiscale {version} from {where.parent} (SIMD {simd_level()}, torch {torch.__version__})"


def allreduce() -> None:
    """Sum and average over 2 processes, 4 MiB (several engine chunks), fp32 and bf16."""
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    base = torch.arange(1 << 20, dtype=torch.float32) % 251
    with Communicator() as comm:
        for dtype in (torch.float32, torch.bfloat16):
            tensor = (base * (rank + 1)).to(dtype)
            comm.all_reduce(tensor)
            torch.testing.assert_close(tensor, (base * sum(range(1, world + 1))).to(dtype))
        averaged = base * (rank + 1)
        comm.all_reduce(averaged, op="avg")
        torch.testing.assert_close(averaged, base * (world + 1) / 2)
    dist.destroy_process_group()
    if rank == 0:
        print(f"engine all-reduce on {world} processes: ok; {check_installed()}")


class TinyRegression(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> DataLoader:
        generator = torch.Generator().manual_seed(0)
        x = torch.randn(64, 8, generator=generator)
        return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4)


def fit() -> None:
    """Two optimizer steps of ``hai_ddp`` on 2 processes, started by Lightning's own launcher."""
    L.seed_everything(0)
    module = TinyRegression()
    initial = torch.cat([p.detach().flatten() for p in module.parameters()])
    trainer = L.Trainer(
        strategy="hai_ddp",
        accelerator="cpu",
        devices=2,
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module)
    final = torch.cat([p.detach().flatten() for p in module.parameters()])
    replicas = trainer.strategy.all_gather(final)
    if trainer.global_step != 2 or torch.equal(final, initial):
        raise SystemExit(f"hai_ddp fit: {trainer.global_step} steps (expected 2), or the parameters did not change")
    if not torch.equal(replicas[0], replicas[1]):
        raise SystemExit("hai_ddp fit: the two replicas' parameters differ")
    if trainer.is_global_zero:
        print(f"hai_ddp fit, 2 steps on 2 processes: ok; {check_installed()}")


if __name__ == "__main__":
    {"allreduce": allreduce, "fit": fit}[sys.argv[1]]()
