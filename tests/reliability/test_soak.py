"""Long runs leak nothing: RSS, open files, threads and shared-memory mappings stay flat over many steps with
validation and checkpoints, for hai_ddp, hai_fsdp and hai_pipedream.

Each rank samples itself every ``EVERY`` steps; from ``WARMUP`` steps on (allocator pools, thread pools and
the first checkpoints are in place by then) the least-squares slope of its RSS must stay under
``RSS_SLOPE_MIB`` per 1,000 steps, and its open file descriptors, threads and mapped /dev/shm segments must
not change at all. RSS is read after ``malloc_trim(0)``, so it counts live memory rather than what glibc
keeps for reuse. The bound is set between what the loop costs without us and what a leak would cost:
Lightning's own ``"ddp"`` under the same loop grew 2.9-3.1 MiB per 1,000 steps here (and hai_ddp 2.3-2.5,
hai_fsdp 2.1-2.5 with checkpoints off or on), while the model has 1.6 MiB of float32 weights, so keeping one
copy of its gradients per step would add ~1,600 MiB per 1,000 steps, and one copy of a rank's checkpoint per
save (every 100 steps: weights and momentum, a shard of them under hai_fsdp) 16-32 MiB. The measured slopes
are in docs/checkpoints.md's reliability table. Run it with
``LHS_LONG_TESTS=1 pytest -s tests/reliability/test_soak.py`` (about 3 min).
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_haiscale  # noqa: F401 - registers the strategies
from lightning_haiscale.strategies import HaiDDPStrategy, HaiFSDPStrategy, PipeDreamStrategy
from tests.distributed import run_distributed

STEPS = 2000
WARMUP = 500
EVERY = 50  # steps between samples, and between validations
WIDTH = 640
_LIBC = ctypes.CDLL("libc.so.6")
RSS_SLOPE_MIB = 8.0  # per 1,000 steps, after warm-up; see the module's docstring


class _MLP(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        layers = [nn.Linear(16, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, 1)]
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.mse_loss(self(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", F.mse_loss(self(x), y), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)


def resources() -> tuple[float, int, int, int]:
    """This process's RSS (MiB, after returning glibc's free pages), open file descriptors, threads and mapped
    /dev/shm segments."""
    _LIBC.malloc_trim(0)
    with open("/proc/self/statm") as statm:
        rss = int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    with open("/proc/self/maps") as maps:
        shm = len({line.split()[-1] for line in maps if "/dev/shm/" in line})
    return rss, len(os.listdir("/proc/self/fd")), len(os.listdir("/proc/self/task")), shm


class _Sampler(L.Callback):
    def __init__(self) -> None:
        self.samples: list[tuple[int, float, int, int, int]] = []

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step % EVERY == 0:
            self.samples.append((trainer.global_step, *resources()))


def _strategy(name: str) -> Any:
    if name == "hai_ddp":
        return HaiDDPStrategy()
    if name == "hai_fsdp":
        return HaiFSDPStrategy(state_dict_type="sharded")
    return PipeDreamStrategy(chunks=2)


def _soak(rank: int, world: int, name: str, tmp: str) -> list[tuple[int, float, int, int, int]]:
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(512, 16, generator=g), torch.randn(512, 1, generator=g))
    sampler = _Sampler()
    trainer = L.Trainer(
        strategy=_strategy(name),
        accelerator="cpu",
        devices=world,
        max_steps=STEPS,
        val_check_interval=EVERY,
        check_val_every_n_epoch=None,
        limit_val_batches=2,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[
            ModelCheckpoint(dirpath=Path(tmp) / name, save_last=True, every_n_train_steps=100, save_top_k=1),
            sampler,
        ],
    )
    loader = DataLoader(data, batch_size=8)
    trainer.fit(_MLP(), loader, DataLoader(data, batch_size=8))
    return sampler.samples


def slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of ys over xs."""
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)


@pytest.mark.slow
@pytest.mark.long  # minutes: see conftest.py
@pytest.mark.parametrize("name", ["hai_ddp", "hai_fsdp", "hai_pipedream"])
def test_long_runs_leak_nothing(name: str, tmp_path: Path) -> None:
    for rank, samples in enumerate(run_distributed(_soak, 2, name, str(tmp_path), timeout=900)):
        after = [s for s in samples if s[0] >= WARMUP]
        steps, rss = [s[0] for s in after], [s[1] for s in after]
        per_1000 = 1000 * slope(steps, rss)
        print(f"{name} rank {rank}: RSS {rss[0]:.1f} -> {rss[-1]:.1f} MiB, {per_1000:+.2f} MiB per 1,000 steps; "
              f"fds, threads, shm maps {after[0][2:]} -> {after[-1][2:]}")  # fmt: skip
        assert per_1000 < RSS_SLOPE_MIB, f"{name} rank {rank}: RSS grows {per_1000:.2f} MiB per 1,000 steps"
        for i, what in ((2, "open files"), (3, "threads"), (4, "mapped /dev/shm segments")):
            counts = sorted({s[i] for s in after})
            assert len(counts) == 1, f"{name} rank {rank}: {what} changed after warm-up: {counts}"
