"""A pipeline whose stages span hosts names a host that goes silent within seconds (see [Note: a silent host in
a pipeline] in lightning_haiscale/pipeline/hosts.py): stage 1, on another (simulated) host, freezes mid-step
(SIGSTOP: its sockets stay open, as a frozen node's or a partitioned one's do); stage 0's receive ends with
``PipelineCommunicationError`` naming the silent rank long before the process group's 60 s timeout. Stages on
one host watch nobody. The real case (two network namespaces, a link dropped) is in tests/hosts."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lightning_haiscale.hfreduce.liveness import SILENT_S
from lightning_haiscale.pipeline import PipeDream, PipelineCommunicationError, partition
from tests.distributed import run_distributed

_NAMED_WITHIN_S = SILENT_S + 10  # the silence, then the watcher's own checks on a loaded machine


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))


def _freeze_stage_1(rank: int, world: int) -> tuple[float, str]:
    pids: list[int] = [0] * world
    dist.all_gather_object(pids, os.getpid())
    pipe = PipeDream(partition(_model(), rank, world), chunks=2)
    x, y = torch.randn(4, 4), torch.randn(4, 2)
    criterion = lambda out, target: F.mse_loss(out, target) / 2  # noqa: E731
    pipe.forward_backward(x, criterion=criterion, labels=(y,))  # a step across the hosts works
    assert pipe.hosts is not None and pipe.hosts.peers == [1 - rank]
    if rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)  # frozen: no heartbeat, no closed socket
    start = time.monotonic()
    with pytest.raises(PipelineCommunicationError) as raised:
        pipe.forward_backward(x, criterion=criterion, labels=(y,))
    waited = time.monotonic() - start
    os.kill(pids[1], signal.SIGKILL)  # the frozen host is gone for good
    return waited, str(raised.value)


def test_a_frozen_stage_on_another_host_is_named_within_seconds() -> None:
    results = run_distributed(_freeze_stage_1, 2, node_ids=["a", "b"], may_die=[1], timeout=120)
    waited, error = results[0]
    assert "rank 1 is silent" in error and "stage 0" in error, error
    assert waited < _NAMED_WITHIN_S, f"named after {waited:.1f} s"


def _one_host(rank: int, world: int) -> list[int]:
    pipe = PipeDream(partition(_model(), rank, world), chunks=2)
    peers = pipe.hosts.peers
    pipe.close()
    return peers


def test_stages_on_one_host_watch_nobody() -> None:
    assert run_distributed(_one_host, 2) == [[], []]
