"""Under Fabric, which has no exception hook for its strategy, a script that calls
``lightning_haiscale.hfreduce.abort_job(error)`` where it catches a rank's error stops every peer within a
second, as the Trainer's ``on_exception`` does (docs/troubleshooting.md). The failed rank stays alive for
``LINGER_S``: a peer that only noticed its exit would take longer (mutation: without the call, ~6 s)."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
import torch
import torch.nn.functional as F
from lightning.fabric import Fabric
from torch import nn

from lightning_haiscale.fabric import HaiDDPStrategy, HaiFSDPStrategy
from lightning_haiscale.hfreduce import abort_job
from tests.distributed import run_distributed
from tests.reliability.test_abort import LIMIT_S, LINGER_S


def _train(rank: int, world: int, strategy: str) -> tuple[str, str, float]:
    """Every rank: (error type, message, time of the error or, on the failing rank, of the raise)."""
    timeout = timedelta(seconds=60)
    chosen = HaiDDPStrategy(timeout=timeout) if strategy == "hai_ddp" else HaiFSDPStrategy(timeout=timeout)
    fabric = Fabric(accelerator="cpu", devices=world, strategy=chosen)
    fabric.launch()
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 64), nn.Tanh(), nn.Linear(64, 1))
    model, optimizer = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    raised_at = None
    try:
        for step in range(4):
            if step == 1 and rank == world - 1:
                raised_at = time.time()
                raise RuntimeError("injected failure")
            optimizer.zero_grad()
            fabric.backward(F.mse_loss(model(torch.randn(4, 4)), torch.randn(4, 1)))
            optimizer.step()
    except Exception as error:  # the case under test: the script's own handler
        abort_job(error)
        if raised_at is not None:
            time.sleep(LINGER_S)
            return type(error).__name__, str(error), raised_at
        return type(error).__name__, str(error), time.time()
    return "no error", "", 0.0


@pytest.mark.parametrize("strategy", ["hai_ddp", "hai_fsdp"])
def test_a_fabric_script_that_calls_abort_job_stops_every_rank(strategy: str) -> None:
    (kind0, message, seen_at), (kind1, _, raised_at) = run_distributed(_train, 2, strategy, timeout=300)
    assert kind1 == "RuntimeError"
    assert kind0 == "HFReduceAbortedError" and "rank 1 " in message and "RuntimeError" in message, message
    print(f"{strategy}: {seen_at - raised_at:.3f} s from the raise to rank 0's error")
    assert seen_at - raised_at < LIMIT_S, f"{seen_at - raised_at:.2f} s from the raise to rank 0's error"
