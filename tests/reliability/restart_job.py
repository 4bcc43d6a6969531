"""A small Lightning job for torchrun (``python -m torch.distributed.run ... restart_job.py``) that resumes from
``last.ckpt`` and can SIGKILL one of its ranks at chosen steps, once each; used by ``test_restarts.py`` and the
restart recipe of docs/checkpoints.md.

Usage: ``restart_job.py STRATEGY WORKDIR [KILL ...]``, each KILL a step number or ``save:R:K``. Every
worker appends ``generation rank pid`` to ``WORKDIR/generations`` when it starts; when the fit ends, each rank
saves its local parameters (its shard or stage) to ``WORKDIR/weights_rank<r>.pt``. A kill at step ``s``
happens on rank 1 at the start of its step ``s`` and is recorded by the file ``WORKDIR/killed_<s>`` (written
before the kill), so a resumed generation passes that step. ``save:R:K`` kills rank R just before its K-th
file operation in the saves at the end of epoch 1 (see ``save_kills.py``).

[Note: where a resume is exact] The checkpoint is taken at each epoch's end (``every_n_epochs=1``). A
checkpoint taken mid-epoch (``every_n_train_steps``) resumes with the epoch's first batches again, since a plain
``DataLoader`` has no state (Lightning restores a loader's position only if it has ``state_dict``, like
torchdata's ``StatefulDataLoader``); and a step checkpoint that falls on an epoch's last batch, written by an
already resumed run, was resumed by Lightning 2.6.6 into the epoch it ended (seen here: 4 extra steps).
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_haiscale  # noqa: F401 - registers the strategies
from lightning_haiscale.strategies import HaiDDPStrategy, HaiFSDPStrategy, PipeDreamStrategy
from tests.reliability.save_kills import SaveKiller, log_generation, save_killer, save_local_weights

STEPS_PER_EPOCH = 4  # per rank: 32 rows / 2 ranks / batch 4
EPOCHS = 4


class Regression(L.LightningModule):
    """A tiny float64 MLP trained with SGD and momentum (a lost optimizer state would show in the weights)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1)).double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


class Resources(L.Callback):
    """Appends ``generation rank rss_mib fds threads`` to ``WORKDIR/resources`` at the first training step."""

    def __init__(self, workdir: Path) -> None:
        self.path: Path | None = workdir / "resources"

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if self.path is None:
            return
        with open("/proc/self/statm") as statm:
            rss = int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
        fds, threads = len(os.listdir("/proc/self/fd")), len(os.listdir("/proc/self/task"))
        generation = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        with open(self.path, "a") as out:
            out.write(f"{generation} {trainer.global_rank} {rss} {fds} {threads}\n")
        self.path = None


class KillAt(L.Callback):
    """Rank 1 SIGKILLs itself at the start of each step in ``steps`` once (a marker file remembers it)."""

    def __init__(self, workdir: Path, steps: list[int]) -> None:
        self.workdir, self.steps = workdir, steps

    def on_train_batch_start(self, trainer: L.Trainer, module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        step = trainer.global_step
        marker = self.workdir / f"killed_{step}"
        if trainer.global_rank == 1 and step in self.steps and not marker.exists():
            marker.write_text(str(os.getpid()))
            os.kill(os.getpid(), signal.SIGKILL)


class KillInSave(L.Callback):
    """Arms the :class:`SaveKiller` for the saves at the end of each epoch (see ``save_kills.py``)."""

    def __init__(self, killer: SaveKiller) -> None:
        self.killer = killer

    def on_save_checkpoint(self, trainer: L.Trainer, module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        self.killer.arm(trainer.current_epoch)

    def on_train_epoch_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self.killer.disarm()


def strategy(name: str) -> Any:
    if name == "hai_ddp":
        return HaiDDPStrategy()
    if name.startswith("hai_fsdp"):
        return HaiFSDPStrategy(state_dict_type="sharded" if name.endswith("sharded") else "full")
    return PipeDreamStrategy(chunks=2)


def main(name: str, workdir: Path, kills: list[str]) -> None:
    rank = int(os.environ["RANK"])
    in_save = KillInSave(save_killer(workdir, rank, kills))
    log_generation(workdir, rank)
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(32, 4, generator=g, dtype=torch.float64), torch.randn(32, 1, generator=g).double())
    trainer = L.Trainer(
        strategy=strategy(name),
        accelerator="cpu",
        devices=2,
        max_epochs=EPOCHS,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[
            ModelCheckpoint(dirpath=workdir / "ckpt", save_last=True, every_n_epochs=1),
            KillAt(workdir, [int(k) for k in kills if k.isdigit()]),
            in_save,
            Resources(workdir),
        ],
    )
    trainer.fit(Regression(), DataLoader(data, batch_size=4, shuffle=True), ckpt_path="last")
    save_local_weights(workdir, rank, trainer.strategy.model, trainer.global_step)


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]), sys.argv[3:])
