"""The step timing the pipeline benchmarks share: every rank starts and ends each step together (a barrier on
both sides), so the median after warm-up is the slowest stage's step, as the schedule makes it."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist


def median_step_seconds(
    step: Callable[[Any], None], params: Iterable[torch.Tensor], batch: Any, warmup: int, steps: int
) -> float:
    """The median time of ``steps`` SGD steps of ``step(batch)`` after ``warmup`` untimed ones."""
    optimizer = torch.optim.SGD(params, lr=1e-3)
    times = []
    for i in range(warmup + steps):
        dist.barrier()
        start = time.perf_counter()
        optimizer.zero_grad()
        step(batch)
        optimizer.step()
        dist.barrier()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times)
