"""Heartbeats (see [Note: a silent host] in liveness.py), on a store of our own and a clock we move: a peer
whose count stops is named after the silence, one that beats or left never is, and a watcher that was itself
descheduled does not judge. The real case (a host's link dropped) is in tests/hosts."""

from __future__ import annotations

import pytest

from lightning_haiscale.hfreduce import liveness
from lightning_haiscale.hfreduce.liveness import BEAT_S, Heartbeats


class _Store:
    def __init__(self) -> None:
        self.values: dict[str, int] = {}

    def set(self, key: str, value: str) -> None:
        self.values[key] = int(value)

    def add(self, key: str, amount: int) -> int:
        self.values[key] = self.values.get(key, 0) + amount
        return self.values[key]


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    now = [100.0]
    monkeypatch.setattr(liveness.time, "monotonic", lambda: now[0])
    return now


def _run(beats: Heartbeats, store: _Store, clock: list[float], seconds: float, peer_beats: bool) -> object:
    for _ in range(int(seconds / BEAT_S)):
        clock[0] += BEAT_S
        if peer_beats:
            store.add(f"{liveness._PREFIX}1", 1)
        lost = beats.tick(store, 0)
        if lost is not None:
            return lost
    return None


def test_a_peer_that_stops_beating_is_named_after_the_silence(clock: list[float]) -> None:
    beats, store = Heartbeats(), _Store()
    beats.watch(store, 0, [1], silent_s=4.0)
    assert _run(beats, store, clock, 30, peer_beats=True) is None
    start = clock[0]
    peer, reason = _run(beats, store, clock, 30, peer_beats=False)
    assert peer == 1 and "rank 1 is silent" in reason
    assert 4.0 < clock[0] - start <= 4.0 + 2 * BEAT_S


def test_a_peer_that_left_or_a_late_watcher_is_not_a_loss(clock: list[float]) -> None:
    beats, store = Heartbeats(), _Store()
    beats.watch(store, 0, [1], silent_s=4.0)
    _run(beats, store, clock, 2, peer_beats=True)
    store.set(f"{liveness._PREFIX}1", "-1")  # rank 1 closed its engine
    assert _run(beats, store, clock, 30, peer_beats=False) is None
    store.set(f"{liveness._PREFIX}1", "5")
    beats.tick(store, 0)
    clock[0] += 60  # this watcher slept a minute: one check is not enough to judge
    assert beats.tick(store, 0) is None
    beats.forget(store, 0, [1])
    assert store.values[f"{liveness._PREFIX}0"] == -1 and beats.tick(store, 0) is None
