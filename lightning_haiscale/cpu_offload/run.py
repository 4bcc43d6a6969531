"""One entry of an offload region: the saved spans it copies to host memory and back, and their lifecycle.

[Note: a span's life]
A span the selection offloads (``OffloadedSpan``) moves through ``SpanState``; each transition is one method of
``OffloadRun``:

| from        | event                                               | to          | method     |
|-------------|-----------------------------------------------------|-------------|------------|
| (new)       | copy out started on a side stream                   | COPYING_OUT | _offload   |
| (new)       | copy out done at once (a CPU tensor)                | ON_HOST     | _offload   |
| COPYING_OUT | the copy has read the device bytes (or was waited)  | ON_HOST     | _retire    |
| COPYING_OUT | backward needs it while the device bytes are intact | ON_DEVICE   | _restore   |
| ON_HOST     | copy back started (prefetch or use)                 | ON_DEVICE   | _restore   |
| any         | autograd released its last saved view               | RELEASED    | drop_handle|

A RELEASED span saved again in the same entry is copied out anew. ``source`` (the device bytes held for the copy
out) is dropped by ``_retire`` also after a reuse: then ``restored`` is what holds them.

[Note: memory bounds]
A copy out takes time; until it ends the device bytes cannot be freed. ``max_inflight_bytes`` bounds the bytes
whose copy out has not finished: past it the compute stream waits for the oldest copy (on the device, the host
never blocks), which is what turns offloading into a real reduction of peak memory when copies are slower than
compute. In backward, copies back are prefetched in reverse save order, up to ``prefetch_bytes`` ahead of use,
on every unpack, including unpacks of resident tensors (so the first offloaded tensor backward needs is already
on its way while backward still uses resident ones). Bytes restored for a saved tensor are released when
autograd releases the saved tensor; with ``retain_graph=True`` they stay on the device until the graph is freed.
"""

from __future__ import annotations

import enum
import threading
from collections import deque
from collections.abc import Callable
from typing import NamedTuple

import torch

from lightning_haiscale.cpu_offload.pool import HostBuffer, PinnedBufferPool
from lightning_haiscale.cpu_offload.selection import StreamingSelector, plan_offload
from lightning_haiscale.cpu_offload.spans import rebuildable, span_pack
from lightning_haiscale.cpu_offload.stats import CopyClock, RegionRecord
from lightning_haiscale.cpu_offload.transfer import Copies, CudaCopies, HostCopies

__all__ = ["CountingRun", "OffloadRun", "RunOptions", "SpanState"]


class RunOptions(NamedTuple):  # a tuple: built once per region, cheaper to read than a frozen dataclass
    offload_ratio: float
    min_bytes: int
    max_inflight_bytes: int
    prefetch_bytes: int
    force_copy: bool
    pool: PinnedBufferPool


class SpanState(enum.Enum):
    """Where the bytes of an offloaded span live (see [Note: a span's life])."""

    COPYING_OUT = "copying out"
    """The copy to host memory may still read the device bytes, which ``source`` holds."""
    ON_HOST = "on host"
    """Only the host buffer holds the bytes."""
    ON_DEVICE = "on device"
    """The bytes are on the device for backward (``restored``): copied back, or the held device bytes reused."""
    RELEASED = "released"
    """Autograd released every saved view of the span: nothing is held."""


class OffloadedSpan:
    """One storage span copied to host memory; shared by every saved view of it."""

    __slots__ = (
        "ahead",
        "copies",
        "done",
        "handles",
        "host",
        "nbytes",
        "restored",
        "seq",
        "source",
        "source_ptr",
        "state",
        "written",
    )

    def __init__(self, seq: int, nbytes: int, copies: Copies, host: HostBuffer) -> None:
        self.seq = seq  # save order: backward needs it in reverse
        self.nbytes = nbytes
        self.copies = copies
        self.state = SpanState.COPYING_OUT
        self.host: HostBuffer | None = host  # held until the bytes are back on the device
        self.written: torch.cuda.Event | None = None  # end of the copy out
        self.source: torch.Tensor | None = None  # device bytes, held while the copy out may read them
        self.source_ptr = 0  # where they were: a storage resized meanwhile (FSDP frees so) is not reused
        self.restored: torch.Tensor | None = None  # device bytes for backward
        self.done: torch.cuda.Event | None = None  # end of the copy back
        self.handles = 0  # live saved-tensor handles that point here
        self.ahead = False  # prefetched and not yet used: counted in the prefetch window


class _Offloaded:
    """A saved tensor whose bytes went to host memory: where they are and how to view them again."""

    __slots__ = ("dtype", "offset", "run", "seq", "size", "span", "stride")

    def __init__(self, run: OffloadRun, span: OffloadedSpan, seq: int, tensor: torch.Tensor, offset: int) -> None:
        self.run = run
        self.span = span
        self.seq = seq
        self.dtype = tensor.dtype
        self.size = tensor.size()
        self.stride = tensor.stride()
        self.offset = offset  # in bytes, from the start of the copied span

    def __del__(self) -> None:
        self.run.drop_handle(self.span)


# A saved tensor kept as is: (save order, the tensor detached, so a handle never owns its graph node).
_Resident = tuple[int, torch.Tensor]


def _intact(source: torch.Tensor, ptr: int) -> bool:
    """Whether ``source`` still views the same live bytes (a storage can be resized under a view)."""
    end = source.storage_offset() + source.numel()
    return source.untyped_storage().nbytes() >= end and source.data_ptr() == ptr


def _keep(handle: torch.Tensor) -> torch.Tensor:
    """The unpack hook of a region that offloads nothing: its handles are the tensors."""
    return handle


def _record_entry(
    record: RegionRecord, sizes: list[int], candidates: list[int], offloaded: int, spans: int, clock: CopyClock
) -> None:
    """The entry's measurement becomes the next entry's plan; statistics are recorded."""
    bytes_saved = sum(sizes)
    record.candidate_sizes, record.bytes_saved, record.clock = candidates, bytes_saved, clock
    stats = record.stats
    stats.entries += 1
    stats.bytes_saved, stats.bytes_offloaded = bytes_saved, offloaded
    stats.tensors_saved, stats.tensors_offloaded = len(sizes), spans
    stats.total_bytes_saved += bytes_saved
    stats.total_bytes_offloaded += offloaded


_NO_COPIES = CopyClock()  # the clock of every ratio-0 entry: nothing is ever added to it


class CountingRun:
    """One entry of a region at ratio 0: nothing is offloaded, so nothing but the count is kept."""

    def __init__(self, options: RunOptions) -> None:
        self.sizes: list[int] = []  # every span counted, in save order
        self.candidates: list[int] = []  # those the copy path could take: the next entry's plan
        self._pack = span_pack(options.force_copy, options.min_bytes, self.sizes, self.candidates, None)

    def hooks(self) -> tuple[Callable[[torch.Tensor], object], Callable[[torch.Tensor], torch.Tensor]]:
        return self._pack, _keep

    def finish(self, record: RegionRecord) -> None:
        """Ends the forward: the measurement becomes the next entry's plan; statistics are recorded."""
        _record_entry(record, self.sizes, self.candidates, 0, 0, _NO_COPIES)


class OffloadRun:
    """One entry of a region that offloads: the ``SpanActions`` of its pack hook, its unpack hook, the copies."""

    def __init__(self, options: RunOptions, record: RegionRecord) -> None:
        self.options = options
        self.clock = CopyClock()
        self._lock = threading.RLock()
        self._seq = 0
        self._copies: dict[torch.device, Copies] = {}
        self._planned = record.candidate_sizes
        self._plan = None if self._planned is None else plan_offload(
            self._planned, record.bytes_saved, options.offload_ratio
        )
        self._streaming = StreamingSelector(options.offload_ratio)
        self.sizes: list[int] = []  # every span counted, in save order
        self.candidates: list[int] = []  # those the copy path could take: the next entry's plan
        self._bytes_saved = self.bytes_offloaded = self.spans_offloaded = 0
        self._slots: list[OffloadedSpan] = []  # each offloaded span's latest copy, by the slot its mark keeps
        self._offloaded: list[OffloadedSpan] = []  # every copy, in save order
        self._cursor = -1  # next entry of _offloaded to prefetch, walking backward
        self._ahead_bytes = 0  # prefetched and not yet used
        self._pending: deque[OffloadedSpan] = deque()  # copies out whose source is still held
        self._pending_bytes = 0
        self._pack = span_pack(options.force_copy, options.min_bytes, self.sizes, self.candidates, self)

    def hooks(self) -> tuple[Callable[[torch.Tensor], object], Callable[[object], torch.Tensor]]:
        return self._pack, self.unpack

    # -- forward: the SpanActions of span_pack ------------------------------------------------------

    def _next_seq(self) -> int:
        seq = self._seq
        self._seq = seq + 1
        return seq

    def resident(self, handle: torch.Tensor) -> _Resident:
        return self._next_seq(), handle

    def first(
        self, t: torch.Tensor, handle: torch.Tensor, storage: torch.UntypedStorage, start: int, nbytes: int, fit: bool
    ) -> tuple[_Resident | _Offloaded, int | None]:
        seq = self._next_seq()
        self._bytes_saved += nbytes
        if not (fit and self._choose(len(self.candidates) - 1, nbytes)):
            return (seq, handle), None
        with self._lock:
            span = self._offload(t, storage, start, nbytes, seq)
            self.bytes_offloaded += nbytes
            self.spans_offloaded += 1
            self._slots.append(span)
            span.handles += 1
        return _Offloaded(self, span, seq, t, t.storage_offset() * t.element_size() - start), len(self._slots) - 1

    def again(self, t: torch.Tensor, handle: torch.Tensor, start: int, nbytes: int, slot: int | None) -> object:
        seq = self._next_seq()
        if slot is None or not rebuildable(t):  # a conjugate view of an offloaded span stays resident
            return seq, handle
        with self._lock:
            span = self._slots[slot]
            if span.state is SpanState.RELEASED:  # every earlier save of it was released: copy again
                span = self._slots[slot] = self._offload(t, t.untyped_storage(), start, nbytes, seq)
            span.handles += 1
        return _Offloaded(self, span, seq, t, t.storage_offset() * t.element_size() - start)

    def _choose(self, index: int, nbytes: int) -> bool:
        """Follows the plan while the region saves what was measured, then the streaming rule."""
        if self._plan is not None and index < len(self._plan) and self._planned[index] == nbytes:
            take = self._plan[index]
            self._streaming.offloaded += nbytes if take else 0
            return take
        self._plan = None
        return self._streaming.take(nbytes, self._bytes_saved)

    def _offload(
        self, t: torch.Tensor, storage: torch.UntypedStorage, start: int, nbytes: int, seq: int
    ) -> OffloadedSpan:
        """(new) -> COPYING_OUT or ON_HOST: starts the copy out; bounds the device bytes still waiting for theirs."""
        source = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage, start, (nbytes,), (1,))
        copies = self._copies_for(t.device)
        span = OffloadedSpan(seq, nbytes, copies, self.options.pool.acquire(nbytes, pin=t.is_cuda))
        span.written = copies.to_host(source, span.host)
        self._offloaded.append(span)
        self._cursor = len(self._offloaded) - 1
        if span.written is None:
            span.state = SpanState.ON_HOST
            return span
        span.source, span.source_ptr = source, source.data_ptr()
        self._pending.append(span)
        self._pending_bytes += nbytes
        self._throttle()
        return span

    def _copies_for(self, device: torch.device) -> Copies:
        if device not in self._copies:
            kind = CudaCopies if device.type == "cuda" else HostCopies
            self._copies[device] = kind(device, self.clock)
        return self._copies[device]

    def _throttle(self) -> None:
        """Keeps at most ``max_inflight_bytes`` of device bytes waiting for their copy out."""
        self._poll()
        while self._pending_bytes > self.options.max_inflight_bytes:
            span = self._pending.popleft()
            if span.source is not None:
                span.copies.wait(span.written)
                self._retire(span, read=True)

    def _poll(self) -> None:
        """Drops the sources of finished copies out (they complete in order on one stream)."""
        while self._pending:
            span = self._pending[0]
            if span.source is not None and not span.written.query():
                return
            self._pending.popleft()
            self._retire(span, read=True)

    def _retire(self, span: OffloadedSpan, read: bool = False) -> None:
        """COPYING_OUT -> ON_HOST: drops the held device bytes; unless ``read``, first protects a copy still
        reading them. After a reuse (ON_DEVICE) only the hold is dropped: ``restored`` keeps the bytes."""
        if span.source is None:
            return
        if not read and not span.written.query():
            span.copies.keep_until_read(span.source)
        span.source = None
        self._pending_bytes -= span.nbytes
        if span.state is SpanState.COPYING_OUT:
            span.state = SpanState.ON_HOST

    def finish(self, record: RegionRecord) -> None:
        """Ends the forward: the measurement becomes the next entry's plan; statistics are recorded."""
        with self._lock:
            _record_entry(record, self.sizes, self.candidates, self.bytes_offloaded, self.spans_offloaded, self.clock)

    # -- backward -----------------------------------------------------------------------------------

    def unpack(self, handle: _Resident | _Offloaded) -> torch.Tensor:
        if type(handle) is tuple:
            seq, tensor = handle
            # Read without the lock: in a run that offloaded nothing both stay empty; otherwise a stale
            # read only moves a retire or a prefetch to a later unpack.
            if self._cursor >= 0 or self._pending:
                with self._lock:
                    self._poll()
                    self._prefetch(seq)
            return tensor
        with self._lock:
            self._poll()
            self._prefetch(handle.seq)
            span = handle.span
            if span.state is not SpanState.ON_DEVICE:
                self._restore(span)
            if span.ahead:
                span.ahead = False
                self._ahead_bytes -= span.nbytes
            data, done = span.restored, span.done
        span.copies.before_use(data, done)
        # ``data`` is the span: a fresh allocation, or a view into the original storage when reused.
        offset = (data.storage_offset() + handle.offset) // handle.dtype.itemsize
        view = torch.empty(0, dtype=handle.dtype, device=data.device)
        return view.set_(data.untyped_storage(), offset, handle.size, handle.stride)

    def _prefetch(self, seq: int) -> None:
        """Starts copies back of the offloaded spans saved before ``seq`` (needed next), within the window."""
        while self._cursor >= 0 and self._ahead_bytes < self.options.prefetch_bytes:
            span = self._offloaded[self._cursor]
            self._cursor -= 1
            if span.seq < seq and span.state in (SpanState.COPYING_OUT, SpanState.ON_HOST):
                self._restore(span)
                span.ahead = True
                self._ahead_bytes += span.nbytes

    def _restore(self, span: OffloadedSpan) -> None:
        """COPYING_OUT or ON_HOST -> ON_DEVICE: reuses the held device bytes when intact, else copies back."""
        if span.source is not None and _intact(span.source, span.source_ptr):
            span.restored = span.source  # the copy out is not retired: the device bytes are still here
        else:
            span.restored, span.done = span.copies.to_device(span.host, span.written)
            self.options.pool.release(span.host, span.done)
            span.host = None
        span.state = SpanState.ON_DEVICE

    def drop_handle(self, span: OffloadedSpan) -> None:
        """A saved tensor was released by autograd; the last one releases the span's memory (-> RELEASED)."""
        with self._lock:
            span.handles -= 1
            if span.handles:
                return
            self._retire(span)
            if span.host is not None:
                self.options.pool.release(span.host, span.written)
                span.host = None
            span.restored = None
            if span.ahead:
                span.ahead = False
                self._ahead_bytes -= span.nbytes
            span.state = SpanState.RELEASED
