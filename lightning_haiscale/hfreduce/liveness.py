"""A host that goes silent is named within seconds: heartbeats through the process group's store.

[Note: a silent host]
A host that loses power, its network or its scheduler's favour closes no socket: gloo waits on it for the
process group's timeout (30 minutes by default) and then names nobody. So each process of a job of several
hosts counts a heartbeat in the store (``<prefix><rank>``, every ``BEAT_S``) from the abort watcher's thread
(see abort.py), and reads those of the ranks it exchanges with on other hosts; one whose count has not moved
for ``silent_s`` (10 s, or the communicator's timeout if shorter), over as many of this watcher's own checks
as that takes (a watcher that was itself descheduled does not judge), is declared lost: the watcher aborts this
host's engines naming it (see [Note: aborting a job] in abort.py), so every wait on it ends, and the
strategy's timeout stays the outer bound of whatever does not wait in the engine. Such a process then exits
at once when it ends (status 1; see abort.py), rather than wait at finalization on gloo's work for that host.
A rank that closes its last engine of several hosts writes -1 (it left; nobody waits for it), so a job's
normal end is never a loss.
Limit: the store lives on one host (torchrun's agent or rank 0); if that host is the one that goes silent,
the survivors' store calls wait for the store's timeout instead.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterable
from typing import Any

__all__ = ["BEAT_S", "SILENT_S", "Heartbeats"]

BEAT_S = 0.5
SILENT_S = 10.0
_PREFIX = "lightning_haiscale/hfreduce/alive/"
_LEFT = -1


class Heartbeats:
    """This process's heartbeat and the peers it watches (one per process; thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._peers: Counter[int] = Counter()  # watched global rank -> engines that exchange with it
        self._silent_s = SILENT_S
        self._seen: dict[int, tuple[int, float, int]] = {}  # peer -> (its count, when it moved, checks since)
        self._next = 0.0

    def watch(self, store: Any, rank: int, peers: Iterable[int], silent_s: float) -> None:
        """An engine of ``rank`` exchanges with ``peers`` on other hosts; the first one starts the heartbeat."""
        with self._lock:
            if not self._peers:
                store.set(f"{_PREFIX}{rank}", "0")
            self._peers.update(peers)
            self._silent_s = min(self._silent_s, silent_s)

    def forget(self, store: Any, rank: int, peers: Iterable[int]) -> None:
        """That engine closed; once none is left, this rank writes that it left."""
        with self._lock:
            self._peers.subtract(peers)
            self._peers = +self._peers  # drops counts <= 0
            for gone in set(self._seen) - set(self._peers):
                del self._seen[gone]
            if not self._peers:
                store.set(f"{_PREFIX}{rank}", str(_LEFT))

    def leave(self, store: Any, rank: int) -> None:
        """This process ends: it stops watching and writes that it left, so that no peer takes it for lost."""
        with self._lock:
            watching, self._peers = bool(self._peers), Counter()
            self._seen.clear()
        if watching:
            store.set(f"{_PREFIX}{rank}", str(_LEFT))

    def tick(self, connection: Any, rank: int) -> tuple[int, str] | None:
        """Called by the watcher thread often: beats and checks at most every ``BEAT_S``; returns
        ``(peer, reason)`` for a peer silent for too long, else None."""
        now = time.monotonic()
        with self._lock:
            if not self._peers or now < self._next:
                return None
            self._next = now + BEAT_S
            peers, silent_s = list(self._peers), self._silent_s
        connection.add(f"{_PREFIX}{rank}", 1)
        for peer in peers:
            count = connection.add(f"{_PREFIX}{peer}", 0)  # reads without waiting for the key
            last = self._seen.get(peer)
            if count == _LEFT or last is None or last[0] != count:
                self._seen[peer] = (count, now, 0)
                continue
            self._seen[peer] = last = (count, last[1], last[2] + 1)
            # both: a watcher that was itself descheduled for long has not checked often enough to judge
            if now - last[1] > silent_s and last[2] * BEAT_S >= silent_s:
                return peer, (
                    f"rank {peer} is silent: no heartbeat for {now - last[1]:.1f} s (its host froze, lost its "
                    "network or its power; see [Note: a silent host] in lightning_haiscale/hfreduce/liveness.py)"
                )
        return None
