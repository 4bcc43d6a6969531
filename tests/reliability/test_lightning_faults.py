"""A rank that dies, raises or stalls mid-fit, under each kind of strategy: the job must end in seconds.

Each case runs a 2-process fit in which rank 1 misbehaves at the start of its second step, while rank 0
is already in that step's collectives. Rank 0 must raise within seconds (the engine notices a dead peer
within about a second, a stalled one at the strategy's ``timeout``), naming rank 1 where the error comes
from the engine (the pipelines' point-to-point transfers go through gloo, whose messages do not).
"""

from __future__ import annotations

import os
import signal
import time
from datetime import timedelta
from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_haiscale  # noqa: F401 - registers the strategies
from lightning_haiscale.strategies import HaiDDPStrategy, HaiFSDPStrategy, PipeDreamStrategy
from tests.distributed import run_distributed

TIMEOUT_S = 4  # the strategies' deadline: how long a straggler may keep the others waiting
STALL_S = 10  # longer than TIMEOUT_S


class _Regression(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class _Fault(L.Callback):
    """At the start of the second step: rank 1 misbehaves; rank 0 notes the time."""

    def __init__(self, fault: str) -> None:
        self.fault = fault
        self.started: float | None = None

    def on_train_batch_start(self, trainer: L.Trainer, module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        if batch_idx != 1:
            return
        self.started = time.monotonic()
        if trainer.global_rank != 1:
            return
        if self.fault == "killed":
            os.kill(os.getpid(), signal.SIGKILL)
        if self.fault == "raises":
            raise RuntimeError("injected failure on rank 1")
        time.sleep(STALL_S)


def _strategy(name: str) -> Any:
    timeout = timedelta(seconds=TIMEOUT_S)
    if name == "hai_ddp":
        return HaiDDPStrategy(timeout=timeout)
    if name == "hai_fsdp":
        return HaiFSDPStrategy(timeout=timeout)
    return PipeDreamStrategy(chunks=2, timeout=timeout)


def _fit(rank: int, world: int, strategy: str, fault: str) -> tuple[str, str, float] | None:
    """Rank 0: (error type, message, seconds from the faulty step's start to the error)."""
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64, 4, generator=g), torch.randn(64, 1, generator=g))
    callback = _Fault(fault)
    trainer = L.Trainer(
        strategy=_strategy(strategy),
        accelerator="cpu",
        devices=world,
        max_steps=4,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[callback],
    )
    try:
        trainer.fit(_Regression(), DataLoader(data, batch_size=4))
    except Exception as error:  # the case under test: report it rather than fail the harness
        if rank != 0:
            return None
        assert callback.started is not None, f"failed before the faulty step: {error!r}"
        return type(error).__name__, str(error), time.monotonic() - callback.started
    return "no error", "", 0.0


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["killed", "raises", "stalls"])
@pytest.mark.parametrize("strategy", ["hai_ddp", "hai_fsdp", "hai_pipedream"])
def test_a_failing_rank_ends_the_job_within_seconds(strategy: str, fault: str) -> None:
    result = run_distributed(_fit, 2, strategy, fault, may_die={1}, timeout=240)[0]
    kind, message, seconds = result
    assert kind != "no error", f"rank 0 trained on after rank 1 {fault}"
    limit = TIMEOUT_S + 8 if fault == "stalls" else 8  # seconds, with slack for a loaded 2-core machine
    assert seconds < limit, f"rank 0 raised after {seconds:.1f} s (limit {limit} s): {kind}: {message}"
    if strategy != "hai_pipedream" and fault == "raises":  # the abort names the rank and its exception
        assert kind == "HFReduceAbortedError" and "rank 1 " in message and "RuntimeError" in message, message
    elif strategy != "hai_pipedream":  # the engine's errors name the rank
        assert "group ranks [1]" in message, f"{kind}: {message}"
