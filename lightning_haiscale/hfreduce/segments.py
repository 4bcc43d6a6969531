"""Shared-memory segments of a host: sizing /dev/shm, and creating one segment for all local ranks."""

from __future__ import annotations

import os
import secrets
import sys
import warnings
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from lightning_haiscale.hfreduce import kept_collectives
from lightning_haiscale.hfreduce._native import load_engine
from lightning_haiscale.hfreduce.errors import SharedMemoryTooSmallError
from lightning_haiscale.hfreduce.topology import Topology

SHM_FIX = (
    "Give the job more: `docker run --shm-size=8g ...`, or on Kubernetes mount an emptyDir with "
    "`medium: Memory` at /dev/shm"
)


def shm_free_bytes() -> int:
    """Free bytes in /dev/shm (0 if it cannot be read)."""
    try:
        st = os.statvfs("/dev/shm")
    except OSError:
        return 0
    return st.f_bavail * st.f_frsize


def create_shared(
    make: Callable[[str, bool], Any],
    nbytes: int,
    what: str,
    *,
    topology: Topology,
    group: dist.ProcessGroup,
    allow_fallback: bool,
) -> Any:
    """Local rank 0 of each host creates ``make(name, True)`` (``nbytes`` of /dev/shm) under a fresh
    unguessable name; its peers, having received the name, open it with ``make(name, False)``.
    Collective over ``group``.

    If any host's /dev/shm cannot hold it, every rank learns so in the same exchange and raises
    :class:`SharedMemoryTooSmallError` (or, with ``allow_fallback``, warns and returns None) together.
    """
    created, mine, failure = None, None, None
    if topology.local_rank == 0:
        mine = f"/lhs-{os.getpid()}-{secrets.token_hex(16)}"  # pid: whose it was, if one ever leaks
        too_small = f"hfreduce: {what} needs {nbytes / 2**20:.1f} MiB of shared memory on host {topology.host}"
        if shm_free_bytes() < nbytes:  # checked first; the engine's posix_fallocate settles any race
            failure = f"{too_small} but /dev/shm has {shm_free_bytes() / 2**20:.1f} MiB free"
        else:
            try:
                created = make(mine, True)
            except load_engine().ShmFullError as error:
                failure = f"{too_small}: {error}"
    world_size = len(topology.peers)
    names: list[tuple[str | None, str | None]] = [(mine, failure)] * world_size
    if world_size > 1:
        names = kept_collectives.all_gather_object((mine, failure), group)
    failures = [f for _, f in names if f is not None]
    if failures:
        del created  # unlinks this host's segment if it was made
        shm_too_small(failures[0], allow_fallback)
        return None
    if created is not None:
        return created
    return make(str(names[topology.local_ranks[0]][0]), False)


def shm_too_small(message: str, allow_fallback: bool) -> None:
    """Raises :class:`SharedMemoryTooSmallError`, or warns when ``allow_fallback`` (the caller falls back)."""
    if not allow_fallback:
        raise SharedMemoryTooSmallError(f"{message}. {SHM_FIX}; or pass allow_fallback=True to use torch.distributed.")
    warnings.warn(f"{message}; falling back to torch.distributed collectives.", stacklevel=_caller_outside_hfreduce())


def _caller_outside_hfreduce() -> int:
    """The ``stacklevel`` of the first frame outside this package: a warning points at the user's call."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_globals.get("__name__", "").startswith("lightning_haiscale.hfreduce"):
        frame, level = frame.f_back, level + 1
    return level
