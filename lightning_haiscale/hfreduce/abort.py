"""One failing rank ends every rank's collectives at once, with an error that names it.

[Note: aborting a job] Without this, a rank that raises (between collectives or inside one) leaves its
peers waiting in the engine until its process has exited (the engine then sees a dead pid), about 1-4 s
under Lightning, or until their timeout if the process lingers. :func:`abort_job`, called on the failing
rank (the strategies' ``on_exception``), writes the abort record of every engine of this process (see
[Note: abort] in csrc/communicator.cpp): every local peer's wait ends at once with
:class:`HFReduceAbortedError` naming the rank and its exception. Other hosts learn it through the process
group's store: a job of several hosts runs one watcher thread per process that polls the store's key and,
when it appears, aborts its own host's engines in turn; a rank blocked in a cross-host transfer
(gloo) checks its host's record while it waits (see ``hierarchical.py``).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import weakref
from collections.abc import Iterable
from typing import Any, Protocol

import torch.distributed as dist

from lightning_haiscale.hfreduce.at_exit import call_at_exit
from lightning_haiscale.hfreduce.job_store import job_store
from lightning_haiscale.hfreduce.liveness import Heartbeats

__all__ = ["abort_job", "forget_other_hosts", "job_failure", "register_engine", "watch_other_hosts"]

log = logging.getLogger(__name__)

_KEY = "lightning_haiscale/hfreduce/abort"  # in the default group's store: "<rank>\n<reason>"
_POLL_S = 0.05
_EXIT_JOIN_S = 10.0  # a store call returns at once, or fails at once when its server is gone
_REASON_CHARS = 300


class _Abortable(Protocol):
    def abort(self, rank: int, reason: str) -> None: ...


_ENGINES: weakref.WeakSet[Any] = weakref.WeakSet()  # this process's live host engines (ShmBackend)
_watcher: threading.Thread | None = None
_stopping = threading.Event()
_HEARTBEATS = Heartbeats()
_LOST: list[str] = []  # why a peer on another host was declared lost, once one was
_POSTED: list[str] = []  # the abort another host posted, once one was


def register_engine(engine: _Abortable) -> None:
    """Makes ``engine`` one that :func:`abort_job` (and an abort from another host) aborts."""
    _ENGINES.add(engine)


def abort_job(exception: BaseException) -> None:
    """Called on the rank that failed with ``exception``: every collective waiting on this job, on any rank,
    ends with :class:`HFReduceAbortedError` naming this rank (see [Note: aborting a job])."""
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    text = str(exception).splitlines()[0][:_REASON_CHARS] if str(exception) else ""
    reason = f"rank {rank} (pid {os.getpid()}) failed with {type(exception).__name__}: {text}"
    _abort_here(rank, reason)
    if _watcher is not None:
        try:
            job_store().set(_KEY, f"{rank}\n{reason}")
        except RuntimeError as error:  # the store's host is gone too: its ranks already fail on their own
            log.debug("could not post the abort to the other hosts: %s", error)


def watch_other_hosts(peers: Iterable[int], silent_s: float) -> None:
    """An engine of this process exchanges with the global ranks ``peers`` on other hosts: starts this
    process's watcher of aborts posted there and of their heartbeats (see [Note: a silent host] in
    liveness.py); a peer silent for ``silent_s`` (at most ``SILENT_S``) aborts this host's engines."""
    global _watcher
    _HEARTBEATS.watch(job_store(), dist.get_rank(), peers, silent_s)
    if _watcher is None:
        _stopping.clear()
        _watcher = threading.Thread(target=_watch, name="hfreduce-abort", daemon=True)
        _watcher.start()


def forget_other_hosts(peers: Iterable[int]) -> None:
    """That engine closed: its peers are no longer watched (this rank tells them it left)."""
    try:
        _HEARTBEATS.forget(job_store(), dist.get_rank(), peers)
    except (RuntimeError, ValueError) as error:  # the job is over (no store, no process group)
        log.debug("could not post that this rank left: %s", error)


def job_failure() -> str | None:
    """Why this job is failing, as the watcher learned it: a peer on another host declared lost or an abort
    posted there; ``None`` while neither happened. Waits outside the engine (a pipeline's transfers across
    hosts) poll it, so that they end within seconds too."""
    return next(iter(_LOST + _POSTED), None)


def _stop_watching() -> None:
    """Ends the watcher before the interpreter finalizes (see [Note: a finished job exits 0] in at_exit.py).
    A daemon thread that is inside a store call when Python finalizes exits through pybind11's
    ``gil_scoped_release`` destructor, which is ``noexcept``: the process dies of ``std::terminate``."""
    watcher = _watcher
    if watcher is not None:
        _stopping.set()
        watcher.join(_EXIT_JOIN_S)
    try:  # what watches without an engine (a pipeline's stages across hosts) leaves here
        if dist.is_initialized():
            _HEARTBEATS.leave(job_store(), dist.get_rank())
    except (RuntimeError, ValueError) as error:
        log.debug("could not post that this rank left: %s", error)


def _exit_now_if_a_host_was_lost() -> None:
    """A process that lost a host exits at once with status 1: gloo's work still waiting on that host would
    hold the interpreter's finalization (the process group's destructor joins its threads) until the process
    group's timeout; torchrun then restarts the job or reports it failed within seconds, not that timeout."""
    if _LOST:
        log.error("hfreduce: exiting without waiting on the lost host (%s)", _LOST[0])
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        os._exit(1)


call_at_exit(_stop_watching)
call_at_exit(_exit_now_if_a_host_was_lost)


def _abort_here(rank: int, reason: str) -> None:
    for engine in list(_ENGINES):
        engine.abort(rank, reason)


def _watch() -> None:
    """Polls the default group's store until an abort is posted or the store is gone (the job ended), then
    leaves, so that a later job of this process starts a watcher of its own. It polls through a connection of
    its own (``clone()``): a store client is not safe to share with the main thread's ``new_group`` calls."""
    global _watcher
    watched, connection = None, None
    try:
        while not _stopping.wait(_POLL_S):
            if not dist.is_initialized():
                continue
            if job_store() is not watched:  # a new default group: its own store
                watched = job_store()
                connection = watched.clone()
            if connection.check([_KEY]):
                rank, reason = connection.get(_KEY).decode().split("\n", 1)
                _POSTED.append(reason)
                _abort_here(int(rank), reason)
                return
            lost = _HEARTBEATS.tick(connection, dist.get_rank())
            if lost is not None:
                log.error("hfreduce: %s", lost[1])
                _LOST.append(lost[1])
                _abort_here(*lost)
                return
    except RuntimeError as error:  # the store's host is gone: that job is over
        log.debug("stopped watching for aborts: %s", error)
    finally:
        _watcher = None
