"""Copies between device memory and host buffers: on CUDA side streams, or synchronous for CPU tensors.

[Note: stream ordering]
Device-to-host copies run on a per-device ``d2h`` side stream, host-to-device copies on an ``h2d``
stream, so both copy engines work while the compute stream computes.
- A copy out first waits for the compute stream (``d2h.wait_stream``): the tensor is written by then.
- The device tensor must not be freed, and its memory handed to a new tensor, while the copy reads
  it. The region keeps a reference until the copy's event has completed, or until the compute stream
  has been made to wait on that event (then every later use of the freed memory on the compute stream
  is ordered after the copy). A reference dropped earlier is first ``record_stream``-ed on ``d2h``.
- A copy back waits for the copy out of the same bytes (``h2d.wait_event``) and allocates its target on
  the ``h2d`` stream, so it never races with queued compute that used that memory before. Before
  backward uses the bytes, the compute stream waits on the copy's event and the tensor is
  ``record_stream``-ed on the compute stream, so its memory is not reused until backward is done with it.
- A host buffer returns to the pool with the event of its last copy; the next copy into it waits on it.
"""

from __future__ import annotations

import threading
import time

import torch

from lightning_haiscale.cpu_offload.pool import HostBuffer
from lightning_haiscale.cpu_offload.stats import CopyClock

__all__ = ["Copies", "CudaCopies", "HostCopies"]

_STREAMS: dict[int, tuple[torch.cuda.Stream, torch.cuda.Stream]] = {}
_STREAMS_LOCK = threading.Lock()


def _side_streams(device: torch.device) -> tuple[torch.cuda.Stream, torch.cuda.Stream]:
    """The (d2h, h2d) streams of ``device``, created once per process."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    with _STREAMS_LOCK:
        if index not in _STREAMS:
            _STREAMS[index] = (torch.cuda.Stream(index), torch.cuda.Stream(index))
        return _STREAMS[index]


class Copies:
    """The copy interface a region uses; ``None`` events mean the copy already finished."""

    def to_host(self, source: torch.Tensor, buf: HostBuffer) -> torch.cuda.Event | None:
        raise NotImplementedError

    def to_device(
        self, buf: HostBuffer, written: torch.cuda.Event | None
    ) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        raise NotImplementedError

    def before_use(self, data: torch.Tensor, done: torch.cuda.Event | None) -> None:
        """Orders the consumer's stream after the copy that produced ``data``."""

    def wait(self, event: torch.cuda.Event) -> None:
        """Makes the compute stream wait for ``event`` (no host blocking)."""

    def keep_until_read(self, source: torch.Tensor) -> None:
        """Marks ``source`` so its memory is not reused before queued copies out have read it."""


class HostCopies(Copies):
    """Synchronous copies for CPU tensors (``force_copy=True``): the mechanism, testable without a GPU."""

    def __init__(self, device: torch.device, clock: CopyClock) -> None:
        self.device = device
        self.clock = clock

    def to_host(self, source: torch.Tensor, buf: HostBuffer) -> None:
        start = time.perf_counter()
        buf.tensor.copy_(source)
        self.clock.add_seconds(time.perf_counter() - start)

    def to_device(self, buf: HostBuffer, written: torch.cuda.Event | None) -> tuple[torch.Tensor, None]:
        start = time.perf_counter()
        data = torch.empty(buf.nbytes, dtype=torch.uint8, device=self.device)
        data.copy_(buf.tensor)
        self.clock.add_seconds(time.perf_counter() - start)
        return data, None


class CudaCopies(Copies):
    """Asynchronous copies on the device's side streams (see the module note for the ordering)."""

    def __init__(self, device: torch.device, clock: CopyClock) -> None:
        self.device = device
        self.clock = clock
        self.d2h, self.h2d = _side_streams(device)

    def to_host(self, source: torch.Tensor, buf: HostBuffer) -> torch.cuda.Event:
        self.d2h.wait_stream(torch.cuda.current_stream(self.device))
        if buf.ready is not None:
            self.d2h.wait_event(buf.ready)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self.d2h):
            start.record()
            buf.tensor.copy_(source, non_blocking=buf.pinned)
            end.record()
        self.clock.add_events(start, end)
        return end

    def to_device(self, buf: HostBuffer, written: torch.cuda.Event | None) -> tuple[torch.Tensor, torch.cuda.Event]:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self.h2d):
            if written is not None:
                self.h2d.wait_event(written)
            data = torch.empty(buf.nbytes, dtype=torch.uint8, device=self.device)
            start.record()
            data.copy_(buf.tensor, non_blocking=buf.pinned)
            end.record()
        self.clock.add_events(start, end)
        return data, end

    def before_use(self, data: torch.Tensor, done: torch.cuda.Event | None) -> None:
        if done is None:
            return
        current = torch.cuda.current_stream(self.device)
        current.wait_event(done)
        data.record_stream(current)

    def wait(self, event: torch.cuda.Event) -> None:
        torch.cuda.current_stream(self.device).wait_event(event)

    def keep_until_read(self, source: torch.Tensor) -> None:
        source.record_stream(self.d2h)
