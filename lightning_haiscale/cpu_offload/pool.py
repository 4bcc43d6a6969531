"""A reused pool of host buffers for activation offload: pinned up to a cap, pageable past it.

[Note: why a pool]
Allocating page-locked memory costs milliseconds per call (the pages are locked by the driver), and an
offloaded step moves the same set of activation shapes every time. The pool keeps released buffers in
free lists keyed by a rounded size class, so from the second step on every device-to-host copy lands
in a buffer that is already pinned. Pinned memory is a scarce, system-wide resource: past ``limit_bytes``
the pool first drops idle buffers of other size classes, then hands out pageable buffers (slower,
synchronous copies, but correct) and counts them in ``pageable_fallbacks``.

[Note: buffer reuse ordering]
A released buffer may still be read by a host-to-device copy queued on a side stream. ``release``
takes the event that marks the end of that copy; ``acquire`` returns it with the buffer, and the next
writer makes its stream wait on it (``stream.wait_event``), so the wait happens on the device, never
by blocking the host.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field

import torch

__all__ = ["HostBuffer", "PinnedBufferPool", "default_pool"]

_SMALL_CLASS = 4096


def size_class(nbytes: int) -> int:
    """The capacity a request of ``nbytes`` is served from: the next power of two (at least 4 KiB).

    Powers of two because torch's pinned allocator rounds every block to one anyway: the pool's
    accounting then matches the memory actually locked.
    """
    if nbytes <= 0:
        raise ValueError(f"nbytes={nbytes} must be positive")
    return max(_SMALL_CLASS, 1 << (nbytes - 1).bit_length())


@dataclass(eq=False)
class HostBuffer:
    """A host byte buffer: ``tensor`` is the first ``nbytes`` of a block of ``capacity`` bytes."""

    block: torch.Tensor  # uint8, ``capacity`` bytes
    nbytes: int
    pinned: bool
    ready: torch.cuda.Event | None = None  # the last reader's end; a writer's stream waits on it
    tensor: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        self.tensor = self.block[: self.nbytes]

    @property
    def capacity(self) -> int:
        return self.block.numel()


def _default_limit() -> int:
    try:
        physical = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        physical = 16 << 30
    return physical // 4


class PinnedBufferPool:
    """Host buffers reused across steps; at most ``limit_bytes`` of them pinned (default: RAM / 4).

    ``pin=False`` requests (CPU tensors under ``force_copy``, or no CUDA) get pageable buffers, which are
    pooled too but do not count against the cap.
    """

    def __init__(self, limit_bytes: int | None = None) -> None:
        if limit_bytes is not None and limit_bytes < 0:
            raise ValueError(f"limit_bytes={limit_bytes} must be >= 0 (0 disables pinning)")
        self.limit_bytes = _default_limit() if limit_bytes is None else limit_bytes
        self._free: dict[tuple[bool, int], list[HostBuffer]] = {}
        self._lock = threading.Lock()
        self.pinned_bytes = 0  # pinned capacity owned by the pool, in use or idle
        self.idle_bytes = 0  # capacity sitting in free lists (pinned and pageable)
        self.pageable_fallbacks = 0  # pinned requests served pageable because of the cap

    def acquire(self, nbytes: int, *, pin: bool) -> HostBuffer:
        """A buffer of at least ``nbytes``; wait on its ``ready`` event (if any) before writing to it."""
        capacity = size_class(nbytes)
        with self._lock:
            if pin and not self._has_free(True, capacity) and not self._make_room(capacity):
                self.pageable_fallbacks += 1
                pin = False
            free = self._free.get((pin, capacity))
            if free:
                buf = free.pop()
                self.idle_bytes -= capacity
                return HostBuffer(buf.block, nbytes, pin, buf.ready)
            if pin:
                self.pinned_bytes += capacity
        block = torch.empty(capacity, dtype=torch.uint8, pin_memory=pin)
        return HostBuffer(block, nbytes, pin)

    def release(self, buf: HostBuffer, ready: torch.cuda.Event | None = None) -> None:
        """Returns ``buf``; ``ready`` marks the end of the last copy that reads or writes it."""
        with self._lock:
            self._free.setdefault((buf.pinned, buf.capacity), []).append(
                HostBuffer(buf.block, buf.capacity, buf.pinned, ready)
            )
            self.idle_bytes += buf.capacity

    def clear(self) -> None:
        """Drops every idle buffer (buffers in use come back later and are kept)."""
        with self._lock:
            for (pinned, capacity), free in self._free.items():
                if pinned:
                    self.pinned_bytes -= capacity * len(free)
            self._free.clear()
            self.idle_bytes = 0

    def _has_free(self, pinned: bool, capacity: int) -> bool:
        return bool(self._free.get((pinned, capacity)))

    def _make_room(self, capacity: int) -> bool:
        """Frees idle pinned buffers of other classes until ``capacity`` more fits under the cap."""
        for key in sorted((k for k in self._free if k[0]), key=lambda k: -k[1]):
            while self.pinned_bytes + capacity > self.limit_bytes and self._free[key]:
                self._free[key].pop()
                self.pinned_bytes -= key[1]
                self.idle_bytes -= key[1]
        return self.pinned_bytes + capacity <= self.limit_bytes


_DEFAULT_POOL: PinnedBufferPool | None = None
_DEFAULT_LOCK = threading.Lock()


def default_pool() -> PinnedBufferPool:
    """The process-wide pool every ``CPUOffload`` uses unless given its own (like the CUDA allocator)."""
    global _DEFAULT_POOL
    with _DEFAULT_LOCK:
        if _DEFAULT_POOL is None:
            _DEFAULT_POOL = PinnedBufferPool()
        return _DEFAULT_POOL
