"""A small Fabric job for torchrun (``python -m torch.distributed.run ... fabric_restart_job.py``) that resumes
from ``WORKDIR/ckpt/last.ckpt``, written by ``fabric.save`` at each epoch's end, and can SIGKILL one of its
ranks during a save; used by ``test_kills_during_save.py``.

Usage: ``fabric_restart_job.py STRATEGY WORKDIR [save:R:K ...]``, STRATEGY one of ``hai_ddp``, ``hai_fsdp``
(a full file) and ``hai_fsdp_sharded`` (a DCP folder). The kills, the log of generations and the final
weights are ``restart_job.py``'s (see ``save_kills.py``). Each epoch's batches are a fixed function of the
epoch, so a resume from an epoch's checkpoint replays exactly the steps a job never killed takes.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn

import lightning_haiscale  # noqa: F401 - registers the strategies
from lightning_haiscale.fabric import HaiDDPStrategy, HaiFSDPStrategy
from tests.reliability.save_kills import log_generation, save_killer, save_local_weights

EPOCHS = 4
ROWS, BATCH = 32, 4  # 4 steps per epoch on each of 2 ranks


def strategy(name: str) -> Any:
    if name == "hai_ddp":
        return HaiDDPStrategy()
    return HaiFSDPStrategy(state_dict_type="sharded" if name.endswith("sharded") else "full")


def batches(epoch: int, rank: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's batches of ``epoch``: a shuffle seeded by the epoch, every other row to each rank."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(ROWS, 4, generator=g, dtype=torch.float64), torch.randn(ROWS, 1, generator=g).double()
    mine = torch.randperm(ROWS, generator=torch.Generator().manual_seed(epoch))[rank::2]
    for rows in mine.split(BATCH):
        yield x[rows], y[rows]


def main(name: str, workdir: Path, kills: list[str]) -> None:
    rank = int(os.environ["RANK"])
    killer = save_killer(workdir, rank, kills)
    log_generation(workdir, rank)
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=strategy(name))
    fabric.launch()
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1)).double()
    model, optimizer = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9))
    state = {"model": model, "optimizer": optimizer, "epoch": -1, "step": 0}
    path = workdir / "ckpt" / "last.ckpt"
    if path.exists():
        fabric.load(path, state)
    for epoch in range(state["epoch"] + 1, EPOCHS):
        for x, y in batches(epoch, rank):
            optimizer.zero_grad()
            fabric.backward(F.mse_loss(model(x), y))
            optimizer.step()
            state["step"] += 1
        state["epoch"] = epoch
        killer.arm(epoch)
        fabric.save(path, state)
        killer.disarm()
    save_local_weights(workdir, rank, model, state["step"])


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]), sys.argv[3:])
