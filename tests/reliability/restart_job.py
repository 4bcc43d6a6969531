"""A small Lightning job for torchrun (``python -m torch.distributed.run ... restart_job.py``) that resumes from
``last.ckpt`` and can SIGKILL one of its ranks at chosen steps, once each; used by ``test_restarts.py`` and the
README's restart recipe.

Usage: ``restart_job.py STRATEGY WORKDIR [KILL ...]``, each KILL a step number or ``save:R:K``. Every
worker appends ``generation rank pid`` to ``WORKDIR/generations`` when it starts; when the fit ends, each rank
saves its local parameters (its shard or stage) to ``WORKDIR/weights_rank<r>.pt``. A kill at step ``s``
happens on rank 1 at the start of its step ``s`` and is recorded by the file ``WORKDIR/killed_<s>`` (written
before the kill), so a resumed generation passes that step. ``save:R:K`` kills rank R just before its K-th
file operation (open for writing, rename, remove, mkdir, the exchange's symbol lookup) under ``WORKDIR/ckpt``
in the saves at the end of epoch 1 (or the first saves after a resume past it); the ``save:`` kills are done
in order, one per generation (markers ``killed_save_<i>``). Every run records each rank's operations in the
saves at the end of epoch 1 to ``WORKDIR/save_ops_rank<r>``.

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


SAVE_EPOCH = 1  # the saves at the end of this epoch (or, resumed past it, of the next) are the ones killed
_SAVE_EVENTS = ("open", "os.rename", "os.remove", "os.mkdir", "shutil.rmtree", "ctypes.dlsym")


class KillInSave(L.Callback):
    """Logs this rank's file operations under the checkpoint folder during the saves at the end of epoch
    ``SAVE_EPOCH`` (an audit hook: it runs before each operation), and SIGKILLs this rank before the
    ``kill_before``-th of them (1-based) in the first saves of an epoch from ``SAVE_EPOCH`` on, if given."""

    def __init__(self, workdir: Path, rank: int, kill_before: int | None, marker: Path | None) -> None:
        self.folder, self.ops = str(workdir / "ckpt"), workdir / f"save_ops_rank{rank}"
        self.kill_before, self.marker = kill_before, marker
        self.armed, self.epoch, self.count = False, 0, 0
        sys.addaudithook(self._audit)

    def on_save_checkpoint(self, trainer: L.Trainer, module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        self.armed, self.epoch = trainer.current_epoch >= SAVE_EPOCH, trainer.current_epoch

    def on_train_epoch_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self.armed, self.count = False, 0

    def _audit(self, event: str, args: tuple[Any, ...]) -> None:
        if not self.armed or event not in _SAVE_EVENTS:
            return
        if event == "open" and not _writes(args):
            return
        paths = [os.fspath(a) for a in args if isinstance(a, str | os.PathLike)]
        if event != "ctypes.dlsym" and not any(p.startswith(self.folder) for p in paths):
            return
        self.count += 1
        if self.epoch == SAVE_EPOCH:
            with open(self.ops, "a") as ops:  # outside the folder: not counted
                ops.write(f"{self.count} {event} {paths[0] if paths else args[0]}\n")
        if self.count == self.kill_before and self.marker is not None:
            self.marker.write_text(str(os.getpid()))
            os.kill(os.getpid(), signal.SIGKILL)


def _writes(args: tuple[Any, ...]) -> bool:
    mode, flags = args[1], args[2]
    if isinstance(mode, str):
        return any(c in mode for c in "wax+")
    return bool(flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT))


def save_kill(workdir: Path, rank: int, kills: list[str]) -> tuple[int | None, Path | None]:
    """This generation's ``save:R:K`` kill: the first one not done yet (decided before anyone is killed)."""
    for i, spec in enumerate(k for k in kills if k.startswith("save:")):
        marker = workdir / f"killed_save_{i}"
        if not marker.exists():
            _, victim, before = spec.split(":")
            return (int(before), marker) if int(victim) == rank else (None, None)
    return None, None


def strategy(name: str) -> Any:
    if name == "hai_ddp":
        return HaiDDPStrategy()
    if name.startswith("hai_fsdp"):
        return HaiFSDPStrategy(state_dict_type="sharded" if name.endswith("sharded") else "full")
    return PipeDreamStrategy(chunks=2)


def main(name: str, workdir: Path, kills: list[str]) -> None:
    rank = int(os.environ["RANK"])
    in_save = KillInSave(workdir, rank, *save_kill(workdir, rank, kills))
    with open(workdir / "generations", "a") as log:
        log.write(f"{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')} {rank} {os.getpid()}\n")
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
    local = {n: p.detach().clone() for n, p in trainer.strategy.model.named_parameters()}
    torch.save({"weights": local, "global_step": trainer.global_step}, workdir / f"weights_rank{rank}.pt")


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]), sys.argv[3:])
