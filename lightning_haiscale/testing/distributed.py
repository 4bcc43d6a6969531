"""Runs a function on N local processes with a gloo process group: the harness of the multi-rank tests.

Public so that the tests, the benchmarks and users' own tests of code built on lightning-haiscale share
one harness (as ``torch.testing`` and Lightning's test helpers do). It sets the torchelastic variables,
so Lightning treats the processes as launched externally, and ``HFREDUCE_NODE_ID`` to simulate hosts.
"""

from __future__ import annotations

import os
import queue
import time
import traceback
from collections.abc import Callable, Collection, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from lightning.fabric.plugins.environments.lightning import find_free_network_port

from lightning_haiscale.hfreduce import NODE_ID_ENV

__all__ = ["run_distributed"]


def _entry(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    port: int,
    node_ids: Sequence[str] | None,
    args: tuple[Any, ...],
    results: Any,
) -> None:
    # The torchelastic variables make Lightning treat the processes as launched externally.
    nodes = list(dict.fromkeys(node_ids)) if node_ids is not None else ["0"]
    node = node_ids[rank] if node_ids is not None else "0"
    peers = [r for r in range(world_size) if node_ids is None or node_ids[r] == node]
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(peers.index(rank)),
        LOCAL_WORLD_SIZE=str(len(peers)),
        GROUP_RANK=str(nodes.index(node)),
    )
    if node_ids is not None:
        os.environ[NODE_ID_ENV] = node
    for leaked in ("PL_GLOBAL_SEED", "PL_SEED_WORKERS"):  # seed_everything() in the parent must not leak in
        os.environ.pop(leaked, None)
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=60))
        value = fn(rank, world_size, *args)
        results.put((rank, True, value))
    except BaseException:  # report every failure to the parent, which raises it
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    node_ids: Sequence[str] | None = None,
    timeout: float = 180.0,
    may_die: Collection[int] = (),
) -> list[Any]:
    """Runs ``fn(rank, world_size, *args)`` on ``world_size`` spawned processes; returns results by rank.

    ``node_ids[r]`` simulates rank r's host (sets ``HFREDUCE_NODE_ID``). Any rank's exception is raised
    here with its traceback; a run past ``timeout`` seconds is killed and raises ``TimeoutError``.
    Ranks in ``may_die`` may exit without a result (tests that kill a peer); theirs is ``None``.
    Return plain values (numbers, lists): a returned tensor travels as a file descriptor that can vanish
    with its process before this one reads it.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = find_free_network_port()  # STANDALONE_PORT overrides it
    procs = [
        ctx.Process(
            target=_entry,
            args=(fn, rank, world_size, port, node_ids, args, results),
            daemon=True,
        )
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    outcome: dict[int, tuple[bool, Any]] = {}
    try:
        while len(outcome) < world_size:
            for r in may_die:
                if r not in outcome and procs[r].exitcode is not None:
                    outcome[r] = (True, None)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(
                    f"ranks {sorted(set(range(world_size)) - set(outcome))} did not finish in {timeout} s"
                )
            try:
                rank, ok, value = results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode is not None and r not in outcome]
                if dead and set(dead) - set(may_die) and all(p.exitcode is not None for p in procs):
                    raise RuntimeError(f"ranks {dead} exited without a result") from None
                continue
            outcome[rank] = (ok, value)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
    failures = {r: v for r, (ok, v) in outcome.items() if not ok}
    if failures:
        rank = min(failures)
        raise AssertionError(f"rank {rank} failed:\n{failures[rank]}")
    return [outcome[r][1] for r in range(world_size)]
