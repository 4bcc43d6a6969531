"""What the library started ends before the interpreter finalizes, in one order.

[Note: a finished job exits 0]
A C++ thread that touches Python once the interpreter has begun to finalize kills the process with
``std::terminate`` ("terminate called without an active exception", SIGABRT) after a run that succeeded,
and torchrun reports the job failed: gloo's worker threads freeing a work's tensors (pytorch#190489; the
fix upstream was abandoned, pytorch#179291), or a daemon thread inside a store call (the abort watcher).
So one ``atexit`` hook, run while Python is whole, ends in this order: the communicators still open (the
engine's threads; those of wrappers a user never closed), the steps other modules register (the abort
watcher), and the default process group if this library created it (a strategy's; see
``adapter/process_group.py``), whose destruction joins gloo's threads. A process group the user created is
the user's to destroy (docs/troubleshooting.md); a strategy keeps its group until exit, since a later
``fit``/``test`` of the same process reuses it, as Lightning's ``ddp`` does.

[Note: the last reference to a gloo work]
Destroying a process group does not end its gloo threads while Python holds the group (our wrappers do,
until the interpreter clears them). A gloo worker drops its reference to a work just after completing it;
when that reference is the last, it frees the work's tensors, which takes the GIL (a tensor's Python
object), and during finalization that kills the process (seen: ``examples/plain/fsdp.py`` aborted after its
last collective, the arrival check of ``summon_full_params``, about 1 run in 20 on a loaded machine, the
core showing ``~AsyncAllgatherWork`` in ``ProcessGroupGloo::runLoop``; and a Fabric script ending in
``fabric.all_reduce``, 5 runs in 119). So the library's collectives, the strategies' included, go through
``kept_collectives`` or run ``async_op=True`` and end in :func:`wait_and_keep`: the last reference is then
Python's, dropped on the main thread (tests/exits/test_exits.py scans the package for blocking ones).
The cost: a kept work holds its tensors until 16 newer works push it out, so a tensor the caller lets go
lives a few steps longer (a pipeline's tied gradient, set to None each step, about 5 steps: 3 kept works a
step), whatever the backend.
"""

from __future__ import annotations

import atexit
import collections
import logging
import weakref
from collections.abc import Callable
from typing import Any, Protocol

import torch.distributed as dist

__all__ = ["call_at_exit", "close_at_exit", "destroy_at_exit", "wait_and_keep"]

log = logging.getLogger(__name__)


class _Closable(Protocol):
    def close(self) -> None: ...


_OPEN: weakref.WeakSet[Any] = weakref.WeakSet()
_STEPS: list[Callable[[], None]] = []
_owned: list[Any] = []  # the default process group this library created, if it did
_RETAINED: collections.deque[Any] = collections.deque(maxlen=16)  # the library's latest finished gloo works


def close_at_exit(obj: _Closable) -> None:
    """``obj.close()`` runs at exit if ``obj`` is still alive then (kept weakly)."""
    _OPEN.add(obj)


def call_at_exit(step: Callable[[], None]) -> None:
    """``step()`` runs at exit, after the open communicators closed and before the process group ends."""
    _STEPS.append(step)


def wait_and_keep(work: Any) -> None:
    """Waits for a gloo ``work`` and keeps it referenced from Python, so that a gloo thread never frees it while
    the interpreter finalizes (see [Note: the last reference to a gloo work]); the oldest are let go."""
    work.wait()
    _RETAINED.append(work)


def destroy_at_exit() -> None:
    """The default process group, just created by this library, is destroyed at exit if it still is the
    default one then (a user who destroyed it, or made another, keeps theirs)."""
    _owned[:] = [dist.group.WORLD]


@atexit.register
def _finish() -> None:
    for obj in list(_OPEN):
        try:
            obj.close()
        except Exception as error:
            log.warning("closing %r at exit failed: %s", obj, error)
    for step in _STEPS:
        step()
    if _owned and dist.is_available() and dist.is_initialized() and dist.group.WORLD is _owned[0]:
        dist.destroy_process_group()
    _owned.clear()
