"""The process group of every strategy of this package, on a store that a torchrun restart cannot confuse with the
killed generation's.

[Note: torchrun's shared store] Since torch 2.4, torchrun's agent hosts one TCPStore for the whole job and its
workers' ``init_process_group`` uses it (``TORCHELASTIC_USE_AGENT_STORE=True``; the workers connect as
clients to ``MASTER_ADDR:MASTER_PORT``). It outlives every generation of workers, so after a restart the new
generation can read the keys of the one that died before its own peers overwrite them: gloo then dials the
dead workers' addresses (``Gloo connectFullMesh failed ... Connection refused``, pytorch#135712) and every
restart fails the same way until ``--max-restarts`` runs out. torch keys nothing by generation: the workers'
``TORCHELASTIC_RESTART_COUNT`` differs between hosts (an agent counts only its own workers' failures), so
it cannot name a generation either. ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` avoids it: rank 0 then hosts a
fresh store at a port the agent picks per generation.

:func:`restart_safe_store` does the same without the variable: global rank 0 starts a store of its own and
posts its port and a random token under one key of the agent's store; every other rank reads that key,
connects, and accepts the store only if it holds the same token. A stale post names a store that died with
its generation (the agent stops every worker of the job before it starts the next generation), or a port
another process took since, whose token differs: the rank reads the key again until rank 0's post arrives.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.plugins import ClusterEnvironment
from lightning.fabric.utilities.distributed import _init_dist_connection
from torch.distributed import Store, TCPStore
from torch.distributed.constants import default_pg_timeout

from lightning_haiscale.hfreduce.at_exit import destroy_at_exit

__all__ = ["init_dist_connection", "restart_safe_store"]

log = logging.getLogger(__name__)

_POST = "lightning_haiscale/generation_store"  # key in the agent's store: "<port> <token>"
_TOKEN = "lightning_haiscale/token"  # key in rank 0's store
_PROBE = timedelta(seconds=3)  # how long one connection attempt to a posted store may take


def init_dist_connection(
    environment: ClusterEnvironment, backend: str, timeout: timedelta | None, root_device: torch.device
) -> None:
    """Lightning's ``_init_dist_connection`` (as ``"ddp"`` calls it), on a store that survives torchrun's
    restarts: under torchrun's shared store, a generation's own (see :func:`restart_safe_store`).
    The group it creates is destroyed at exit (see [Note: a finished job exits 0] in hfreduce/at_exit.py)."""
    if dist.is_available() and dist.is_initialized():
        return
    store = restart_safe_store(environment.global_rank(), environment.world_size(), timeout or default_pg_timeout)
    kwargs: dict[str, Any] = {} if store is None else {"store": store}
    device_id = root_device if root_device.type != "cpu" else None  # eager NCCL init, as "ddp"
    _init_dist_connection(environment, backend, timeout=timeout, device_id=device_id, **kwargs)
    destroy_at_exit()


def restart_safe_store(rank: int, world_size: int, timeout: timedelta) -> Store | None:
    """The store for ``init_process_group(store=...)`` under torchrun's shared store; None elsewhere (then
    ``init_process_group`` builds its store as usual).

    Args:
        rank, world_size: this process's global rank and the world size.
        timeout: how long rank ``r > 0`` waits for rank 0's store, and the store's own timeout.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != str(True):
        return None
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    agent = TCPStore(host, port, world_size=None, is_master=False, timeout=timeout)
    if rank == 0:
        token = secrets.token_hex(16)
        own = TCPStore(host, 0, world_size=world_size, is_master=True, timeout=timeout, wait_for_workers=False)
        own.set(_TOKEN, token)
        agent.set(_POST, f"{own.port} {token}")
        return own
    return _join(agent, host, timeout)


def _join(agent: Store, host: str, timeout: timedelta) -> Store:
    """Rank r > 0: the store that rank 0 of this generation posted (see the module's note)."""
    deadline = time.monotonic() + timeout.total_seconds()
    while True:
        post = agent.get(_POST).decode()
        store = _connect(host, post, timeout)
        if store is not None:
            return store
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"rank 0 did not post its process-group store within {timeout} (the last post, {post!r}, names a "
                "store that is gone: a generation before this restart)"
            )
        time.sleep(0.05)


def _connect(host: str, post: str, timeout: timedelta) -> Store | None:
    """The store ``post`` names, if it is alive and holds the posted token; else None."""
    port, token = post.split()
    try:  # a plain connection first: a dead store refuses it at once, where TCPStore would retry until _PROBE
        socket.create_connection((host, int(port)), timeout=_PROBE.total_seconds()).close()
        store = TCPStore(host, int(port), is_master=False, timeout=_PROBE)
        if not store.check([_TOKEN]) or store.get(_TOKEN).decode() != token:
            return None
    except (OSError, RuntimeError) as error:  # refused or reset: that generation is gone
        log.debug("posted store %s is gone: %s", post, error)
        return None
    store.set_timeout(timeout)
    return store
