"""Per-region statistics and the record a tagged region keeps across entries."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field, replace

import torch

__all__ = ["CopyClock", "OffloadStats", "RegionRecord", "offload_stats", "region_record", "reset_offload_stats"]


class CopyClock:
    """Sums copy durations: CUDA copies by event pairs (read lazily), host copies in seconds."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._seconds = 0.0

    def add_events(self, start: torch.cuda.Event, end: torch.cuda.Event) -> None:
        with self._lock:
            self._events.append((start, end))

    def add_seconds(self, seconds: float) -> None:
        with self._lock:
            self._seconds += seconds

    def seconds(self) -> float:
        """Total so far; waits for the copies already queued (call it after backward, not in a hot loop)."""
        with self._lock:
            for start, end in self._events:
                end.synchronize()
                self._seconds += start.elapsed_time(end) / 1000.0
            self._events.clear()
            return self._seconds


@dataclass
class OffloadStats:
    """What a region did. ``bytes_*`` and ``tensors_*`` describe its last entry; ``total_*`` all of them.

    ``bytes_saved`` counts the activations saved for backward inside the region, each storage once;
    parameters and views of parameters are left out (they stay resident anyway).
    """

    tag: str | None = None
    entries: int = 0  # completed entries of the region
    bytes_saved: int = 0
    bytes_offloaded: int = 0
    tensors_saved: int = 0  # distinct storages saved
    tensors_offloaded: int = 0
    copy_seconds: float = 0.0  # last entry: device-to-host plus host-to-device time of finished copies
    total_bytes_saved: int = 0
    total_bytes_offloaded: int = 0

    @property
    def achieved_ratio(self) -> float:
        """``bytes_offloaded / bytes_saved`` of the last entry (0 when nothing was saved)."""
        return self.bytes_offloaded / self.bytes_saved if self.bytes_saved else 0.0


@dataclass(eq=False)
class RegionRecord:
    """What a region remembers between entries: its last measurement, whether it is active, its stats."""

    tag: str | None
    candidate_sizes: list[int] | None = None  # sizes of the copyable activations, in save order
    bytes_saved: int = 0  # the measured entry's total
    active: bool = False
    stats: OffloadStats = field(default_factory=OffloadStats)
    clock: CopyClock = field(default_factory=CopyClock)

    def snapshot(self) -> OffloadStats:
        return replace(self.stats, tag=self.tag, copy_seconds=self.clock.seconds())


_RECORDS: dict[str, RegionRecord] = {}
_RECORDS_LOCK = threading.Lock()


def region_record(tag: str) -> RegionRecord:
    """The process-wide record of ``tag`` (created on first use)."""
    with _RECORDS_LOCK:
        record = _RECORDS.get(tag)
        if record is None:
            record = _RECORDS[tag] = RegionRecord(tag)
        return record


def offload_stats(tag: str) -> OffloadStats:
    """Statistics of the region named ``tag``; ``KeyError`` if no region with that tag was entered."""
    with _RECORDS_LOCK:
        record = _RECORDS.get(tag)
    if record is None:
        raise KeyError(f"no CPUOffload region with tag={tag!r} has been entered; known tags: {sorted(_RECORDS)}")
    return record.snapshot()


def reset_offload_stats(tag: str | None = None) -> None:
    """Forgets the record of ``tag`` (or of every tag): the next entry measures the region again."""
    with _RECORDS_LOCK:
        for name in [tag] if tag is not None else list(_RECORDS):
            record = _RECORDS.get(name)
            if record is not None and record.active:
                raise RuntimeError(f"CPUOffload region tag={name!r} is active; reset it after it exits")
            _RECORDS.pop(name, None)
