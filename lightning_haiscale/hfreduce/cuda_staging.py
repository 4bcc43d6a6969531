"""Collectives of CUDA tensors through a backend that reduces in host memory.

[Note: CUDA staging]
hfreduce on CUDA: copy device-to-host into pinned memory on a side stream, reduce on the CPU, copy back on
another. Only what a collective reads goes to the host and only what it writes comes back (an all-gather's
output is never read, a reduce-scatter's input never written). The copy out waits for the caller's stream
on the tensor's device (an event recorded when the collective was issued); :meth:`Work.wait` makes the
caller's stream wait for the copy back. A backend that takes device tensors itself (``torch.distributed``)
runs them as they are, ordered by the same two events.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from lightning_haiscale.hfreduce.backend import Backend


class CudaStaging:
    """Runs a backend's collectives on CUDA tensors, on the communicator's job thread."""

    def __init__(self, backend: Backend, rank: int, chunk_bytes: int = 4 << 20) -> None:
        self._backend = backend
        self._rank = rank
        self._chunk_bytes = chunk_bytes  # of the pipelined all-reduce; see [Note: CUDA pipeline]
        self._streams: dict[torch.device, tuple[Any, Any]] = {}  # device-to-host, host-to-device

    @staticmethod
    def ready_event(tensors: tuple[Any, ...]) -> Any:
        """On the caller's thread: an event marking the caller's work so far on the tensors' device (not the
        current device's), or None if no tensor is on CUDA."""
        cuda = [t for t in tensors if isinstance(t, torch.Tensor) and t.is_cuda]
        if not cuda:
            return None
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(cuda[0].device))
        return ready

    def run(self, collective: str, args: tuple[Any, ...], ready: Any) -> Callable[[], None]:
        """Runs ``backend.<collective>(*args)``; returns what ``Work.wait`` runs on the caller's thread."""
        device = next(t.device for t in args if isinstance(t, torch.Tensor) and t.is_cuda)
        # [Note: CUDA device of the worker] This thread's current device is GPU 0 unless set: pinned
        # buffers, events and streams would otherwise create a context there on every rank.
        with torch.cuda.device(device):
            if self._backend.reads_device_tensors:
                torch.cuda.current_stream(device).wait_event(ready)
                getattr(self._backend, collective)(*args)
                return _wait_for(torch.cuda.current_stream(device).record_event(), device)
            d2h, h2d = self._cuda_streams(device)
            if collective == "all_reduce" and self._backend.name == "shm":
                return self._pipelined_all_reduce(args[0], args[1], ready, d2h, h2d)
            reads, writes = self._staged(collective, args)
            with torch.cuda.stream(d2h):
                d2h.wait_event(ready)
                host = tuple(_to_host(t, i in reads) if i in reads or i in writes else t for i, t in enumerate(args))
                d2h.synchronize()
            getattr(self._backend, collective)(*host)
            with torch.cuda.stream(h2d):
                for i in writes:
                    args[i].copy_(host[i], non_blocking=True)
                    args[i].record_stream(h2d)
                done = h2d.record_event()
            return _wait_for(done, device)

    def _staged(self, collective: str, args: tuple[Any, ...]) -> tuple[set[int], set[int]]:
        """Which of a collective's arguments it reads and which it writes (by position)."""
        if collective in ("reduce_scatter", "all_gather"):
            return {1}, {0}  # (output, input, ...)
        if collective == "broadcast":
            return {0}, ({0} if self._rank != args[1] else set())
        return {0}, {0}

    def _pipelined_all_reduce(
        self, tensor: torch.Tensor, divisor: float, ready: Any, d2h: Any, h2d: Any
    ) -> Callable[[], None]:
        """[Note: CUDA pipeline] Chunk i is reduced on the CPU while the copy engines move chunk i+1 to
        the host and chunk i-1 back to the device (two streams), as hfreduce pipelines its stages."""
        flat = tensor.view(-1)
        host = torch.empty(flat.numel(), dtype=flat.dtype, pin_memory=True)
        step = max(1, self._chunk_bytes // flat.element_size())
        bounds = [(b, min(b + step, flat.numel())) for b in range(0, flat.numel(), step)]
        arrived = []
        with torch.cuda.stream(d2h):
            d2h.wait_event(ready)
            for b, e in bounds:
                host[b:e].copy_(flat[b:e], non_blocking=True)
                arrived.append(d2h.record_event())
        with torch.cuda.stream(h2d):
            for (b, e), event in zip(bounds, arrived, strict=True):
                event.synchronize()
                chunk = host[b:e]
                self._backend.all_reduce(chunk, divisor)
                flat[b:e].copy_(chunk, non_blocking=True)
            flat.record_stream(d2h)
            flat.record_stream(h2d)
            done = h2d.record_event()
        return _wait_for(done, flat.device)

    def _cuda_streams(self, device: torch.device) -> tuple[Any, Any]:
        if device not in self._streams:
            self._streams[device] = (torch.cuda.Stream(device=device), torch.cuda.Stream(device=device))
        return self._streams[device]


def _to_host(tensor: torch.Tensor, copy: bool) -> torch.Tensor:
    """A pinned host twin of a device tensor, holding its values when ``copy`` (else uninitialised)."""
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    if copy:
        host.copy_(tensor, non_blocking=True)
    return host


def _wait_for(event: Any, device: torch.device) -> Callable[[], None]:
    """What ``Work.wait`` runs for a CUDA collective: the caller's stream on ``device`` waits for ``event``."""
    return lambda: torch.cuda.current_stream(device).wait_event(event)
