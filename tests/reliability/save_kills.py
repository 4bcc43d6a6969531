"""What the restart jobs (``restart_job.py`` under the Trainer, ``fabric_restart_job.py`` under Fabric) share:
the log of each worker's start, the kill of a rank before its K-th file operation in a save, and the record of
each rank's final parameters.

A ``save:R:K`` kill stops rank R just before its K-th file operation (open for writing, rename, remove, mkdir,
the exchange's symbol lookup) under ``WORKDIR/ckpt`` in the saves at the end of epoch ``SAVE_EPOCH`` (or the
first saves after a resume past it); the ``save:`` kills are done in order, one per generation (markers
``killed_save_<i>``). Every run records each rank's operations in the saves at the end of epoch ``SAVE_EPOCH``
to ``WORKDIR/save_ops_rank<r>``. The audit hook that counts operations runs before each one, so "before
operation K" covers every gap between two operations.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

SAVE_EPOCH = 1  # the saves at the end of this epoch (or, resumed past it, of the next) are the ones killed
_SAVE_EVENTS = ("open", "os.rename", "os.remove", "os.mkdir", "shutil.rmtree", "ctypes.dlsym")


class SaveKiller:
    """Logs this rank's file operations under ``WORKDIR/ckpt`` while armed for the saves of epoch
    ``SAVE_EPOCH`` (an audit hook: it runs before each operation), and SIGKILLs this rank before the
    ``kill_before``-th of them (1-based) in the first armed saves of an epoch from ``SAVE_EPOCH`` on, if given."""

    def __init__(self, workdir: Path, rank: int, kill_before: int | None, marker: Path | None) -> None:
        self.folder, self.ops = str(workdir / "ckpt"), workdir / f"save_ops_rank{rank}"
        self.kill_before, self.marker = kill_before, marker
        self.armed, self.epoch, self.count = False, 0, 0
        sys.addaudithook(self._audit)

    def arm(self, epoch: int) -> None:
        """The saves of ``epoch`` begin (counted only from ``SAVE_EPOCH`` on)."""
        self.armed, self.epoch = epoch >= SAVE_EPOCH, epoch

    def disarm(self) -> None:
        """The saves of the epoch are over: the next armed saves count from 1 again."""
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


def save_killer(workdir: Path, rank: int, kills: list[str]) -> SaveKiller:
    """This rank's :class:`SaveKiller`, armed with this generation's ``save:R:K`` kill: the first one not done
    yet (decided before anyone is killed)."""
    for i, spec in enumerate(k for k in kills if k.startswith("save:")):
        marker = workdir / f"killed_save_{i}"
        if not marker.exists():
            _, victim, before = spec.split(":")
            if int(victim) == rank:
                return SaveKiller(workdir, rank, int(before), marker)
            break
    return SaveKiller(workdir, rank, None, None)


def log_generation(workdir: Path, rank: int) -> None:
    """Appends ``generation rank pid`` to ``WORKDIR/generations``."""
    with open(workdir / "generations", "a") as log:
        log.write(f"{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')} {rank} {os.getpid()}\n")


def save_local_weights(workdir: Path, rank: int, module: nn.Module, step: int) -> None:
    """This rank's parameters (its shard or stage) to ``WORKDIR/weights_rank<r>.pt``."""
    local = {n: p.detach().clone() for n, p in module.named_parameters()}
    torch.save({"weights": local, "global_step": step}, workdir / f"weights_rank{rank}.pt")
