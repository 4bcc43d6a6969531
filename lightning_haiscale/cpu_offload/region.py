"""``CPUOffload``: a region whose activations saved for backward partly live in host memory.

[Note: what a saved tensor becomes]
The pack hook sees every tensor autograd saves inside the region. It works on storage spans rather
than tensors: the bytes of the tensor's storage (the whole storage unless the tensor covers less than
half of it) are copied once, however many views of them are saved (``q``, ``k`` and ``v`` of one
projection are one copy), and each view is rebuilt in backward with its own dtype, size, stride and
offset, so backward sees exactly the layout the forward saved. Parameters, views of parameters and
other leaves that require grad stay resident and are not counted; so are tensors on other devices (CPU
tensors unless ``force_copy``), tensors without a storage (sparse, mkldnn) and tensor subclasses. A
conjugate or negative view counts (its bytes are saved like any other) but stays resident: the bit is
not in the bytes, so the copy path could not rebuild it (like a span under ``min_bytes``, it is no
candidate for the selection).

[Note: recognising a span]
A span is keyed by (the id of a weak reference to its storage, the storage's address, first byte, byte
count). CPython hands out one weak reference per live object (``weakref.ref(s) is weakref.ref(s)``) and
the region holds every reference it keys by until it exits, so all saves of a live storage share a key,
while a storage freed and replaced at the same address gets a new reference: a freed and reused address
is never confused with an earlier tensor (and a storage resized meanwhile, at a new address, is a new
span).

[Note: memory bounds]
A copy out takes time; until it ends the device bytes cannot be freed. ``max_inflight_bytes`` bounds
the bytes whose copy out has not finished: past it the compute stream waits for the oldest copy (on the
device, the host never blocks), which is what turns offloading into a real reduction of peak memory
when copies are slower than compute. In backward, copies back are prefetched in reverse save order, up
to ``prefetch_bytes`` ahead of use, on every unpack, including unpacks of resident tensors (so the
first offloaded tensor backward needs is already on its way while backward still uses resident ones).
Bytes restored for a saved tensor are released when autograd releases the saved tensor; with
``retain_graph=True`` they stay on the device until the graph is freed.

[Note: the cost of the hooks]
Both hooks run for every saved tensor, thousands of times a step in a large model, so their Python cost
is a cost per step (``benchmarks/offload_overhead.py`` measures it against ``save_on_cpu``).
- A handle detaches only a tensor that owns a graph node (requires grad, not a leaf): holding the
  tensor itself would hold its node, which holds the handle, a cycle through autograd's C++ that the
  garbage collector cannot see (``save_on_cpu``'s CPU pack returns the tensor and leaks a saved output
  whose graph is dropped unused). A parameter (a leaf) or a tensor that does not require grad owns no
  node: it is its own handle, and a parameter is rejected before any other check. So is a view of a
  leaf that requires grad, at ratio 0: its node is the view's (``t()``, ``view``, a slice), which
  saves nothing, so no cycle can pass through it (autograd refuses to modify such a view in place,
  which would give it another node). Detaching is the dearest step of a pack; a plain tensor is
  detached with ``.data``, a third cheaper than ``detach()`` (no dispatcher call). The two differ
  only in the version counter, which ``.data`` does not share: autograd checks no versions of tensors
  that went through saved-tensor hooks, so none is read.
- A region at ratio 0 never offloads (the selection takes nothing when its target is 0), so it
  installs a leaner pair (see [Note: counting at ratio 0]): unpack returns the handle, and nothing in
  either touches a device: no event, stream, synchronization or host buffer per saved tensor.
- At other ratios a resident tensor's handle is a plain ``(seq, tensor)`` tuple, and its unpack takes
  the lock only while copies are left to retire or prefetch.
- The checks that decide whether a tensor counts run cheapest and most decisive first (a view of a
  parameter ends at its ``_base``; an activation base ends at ``is_leaf``; a layout without a storage
  ends at the exception of ``untyped_storage()``, which costs nothing until raised).

[Note: counting at ratio 0]
Ratio 0 must still count (``offload_stats``: bytes and spans saved, each span once; the tag's next
entry plans from the candidate sizes), by the rule of the other ratios: tests compare the two. Its pack
is one closure over locals, and it marks each counted storage instead of keying a dict: the storage's
Python object carries an attribute ``(this entry's token, the storage's address, its counted spans)``.
torch keeps one Python object per live storage (``t.untyped_storage() is t.untyped_storage()``, since
torch 2.1: the object lives as long as the storage), so the mark is found by every later save of the
storage in the entry, and dies with it: a storage freed and replaced at the same address has no mark,
a later entry's token differs, and a storage resized meanwhile has another address, so each of those
counts anew, as in the general path's key (see [Note: recognising a span]). The mark is two
attribute accesses where the key was a weak reference, the address, a tuple and a dict (measured in
``benchmarks/RESULTS.md``); it holds no tensor, so a dropped graph frees everything it saved. A span
counted goes to a list, summed when the region exits; whether it is a candidate (at least
``min_bytes``, rebuildable) is read only for those large enough.
"""

from __future__ import annotations

import operator
import threading
import weakref
from collections import deque
from collections.abc import Callable
from types import TracebackType
from typing import NamedTuple

import torch
from torch import nn

from lightning_haiscale.cpu_offload.pool import HostBuffer, PinnedBufferPool, default_pool
from lightning_haiscale.cpu_offload.selection import StreamingSelector, check_ratio, plan_offload
from lightning_haiscale.cpu_offload.stats import CopyClock, OffloadStats, RegionRecord, region_record
from lightning_haiscale.cpu_offload.transfer import CudaTransfer, HostTransfer, Transfer

__all__ = ["CPUOffload"]

DEFAULT_MIN_BYTES = 1 << 20  # below 1 MiB a copy is latency, not bandwidth: keep those resident
DEFAULT_INFLIGHT_BYTES = 512 << 20
DEFAULT_PREFETCH_BYTES = 512 << 20
_STRIDED = torch.strided
_TENSOR = torch.Tensor
_PARAMETER = nn.Parameter


class _Options(NamedTuple):  # a tuple: built once per region entry, cheaper than a frozen dataclass
    offload_ratio: float
    min_bytes: int
    max_inflight_bytes: int
    prefetch_bytes: int
    force_copy: bool
    pool: PinnedBufferPool


class _Stored:
    """One storage span that was copied to host memory; shared by every saved view of it."""

    __slots__ = (
        "consumed",
        "done",
        "handles",
        "host",
        "nbytes",
        "prefetched",
        "restored",
        "seq",
        "source",
        "source_ptr",
        "transfer",
        "written",
    )

    def __init__(self, seq: int, nbytes: int, transfer: Transfer, host: HostBuffer) -> None:
        self.seq = seq  # save order: backward needs it in reverse
        self.nbytes = nbytes
        self.transfer = transfer
        self.host: HostBuffer | None = host  # held until the bytes are back on the device
        self.written: torch.cuda.Event | None = None  # end of the copy out
        self.source: torch.Tensor | None = None  # device bytes, held while the copy out may read them
        self.source_ptr = 0  # where they were: a storage resized meanwhile (FSDP frees so) is not reused
        self.restored: torch.Tensor | None = None  # device bytes for backward
        self.done: torch.cuda.Event | None = None  # end of the copy back
        self.handles = 0  # live saved-tensor handles that point here
        self.prefetched = False
        self.consumed = False


class _Offloaded:
    """A saved tensor whose bytes went to host memory: where they are and how to view them again."""

    __slots__ = ("dtype", "offset", "run", "seq", "size", "stored", "stride")

    def __init__(self, run: _Run, stored: _Stored, seq: int, tensor: torch.Tensor, offset: int) -> None:
        self.run = run
        self.stored = stored
        self.seq = seq
        self.dtype = tensor.dtype
        self.size = tensor.size()
        self.stride = tensor.stride()
        self.offset = offset  # in bytes, from the start of the copied span

    def __del__(self) -> None:
        self.run.drop_handle(self.stored)


# A saved tensor kept as is: (save order, the tensor detached, so a handle never owns its graph node).
_Resident = tuple[int, torch.Tensor]

_Key = tuple[int, int, int, int]  # (id of the storage's weak reference, address, first byte, byte count)

# What ``_Run._seen`` knows of a span: a weak reference to its storage (held, so that its id stays
# unique) and its copy, None when the span is kept resident.
_Seen = tuple[weakref.ref, _Stored | None]


def _span_of(t: torch.Tensor, cpu_too: bool) -> tuple[torch.UntypedStorage, int, int] | None:
    """(storage, first byte, byte count) that ``t`` adds to the region; None: not counted, never copied.

    ``t`` is not a leaf that requires grad (both pack hooks keep those before asking). The span is the
    whole storage unless ``t`` covers under half of it. The same rule as the ratio-0 pack, spelled as it
    is there (see [Note: counting at ratio 0]).
    """
    if type(t) is not _TENSOR or (not t.requires_grad and getattr(t, "_is_param", False)):
        return None  # a subclass, a frozen parameter
    base = t._base
    if base is not None and _parameter_like(base):
        return None
    if not ((cpu_too and t.is_cpu) or t.is_cuda):
        return None
    try:
        storage = t.untyped_storage()
    except (NotImplementedError, RuntimeError):  # sparse, mkldnn and other layouts without a storage
        return None
    total = storage.nbytes()
    nbytes = _extent(t)
    if not nbytes:
        return None
    return (storage, 0, total) if 2 * nbytes >= total else (storage, t.storage_offset() * t.element_size(), nbytes)


def _extent(t: torch.Tensor) -> int:
    """Bytes from ``t``'s first element to its last: its element count when contiguous (empty ones are)."""
    if t.is_contiguous():
        return t.nbytes
    stride = t.stride()  # every size is >= 1 (else it would be contiguous): 1 + sum((size - 1) * stride)
    return t.element_size() * (1 + sum(map(operator.mul, t.size(), stride)) - sum(stride))


def _parameter_like(x: torch.Tensor) -> bool:
    """A parameter, or a leaf that requires grad: resident whatever we do.

    A parameter is a leaf, so an activation (the common base) ends at ``is_leaf``. For a plain tensor,
    ``isinstance(x, nn.Parameter)`` is the ``_is_param`` flag its metaclass reads (read directly: the
    metaclass check is the most expensive step of a pack).
    """
    cls = type(x)
    if cls is _PARAMETER:
        return True
    if not x.is_leaf:
        return False
    return x.requires_grad or bool(getattr(x, "_is_param", False) if cls is _TENSOR else isinstance(x, nn.Parameter))


def _rebuildable(t: torch.Tensor) -> bool:
    """Whether the copy path can rebuild ``t`` from its bytes (a conjugate or negative bit is not in them)."""
    return not (t.is_conj() or t.is_neg())


def _intact(source: torch.Tensor, ptr: int) -> bool:
    """Whether ``source`` still views the same live bytes (a storage can be resized under a view)."""
    end = source.storage_offset() + source.numel()
    return source.untyped_storage().nbytes() >= end and source.data_ptr() == ptr


def _detached(t: torch.Tensor) -> torch.Tensor:
    """``t`` without its graph node (see [Note: the cost of the hooks])."""
    return t.data if type(t) is _TENSOR else t.detach()


def _keep(handle: torch.Tensor) -> torch.Tensor:
    """The unpack hook of a region that offloads nothing: its handles are the tensors."""
    return handle


# The attribute of a storage that the ratio-0 pack marks it with: (the run's token, the storage's address,
# None when only the whole storage was counted, else the set of counted spans, None for the whole one).
_MARK = "_lightning_haiscale_offload_counted"  # written as a plain attribute store: half a ``setattr`` call
_Mark = tuple[object, int, "set[tuple[int, int] | None] | None"]


def _counting_pack(
    sizes: list[int], candidates: list[int], cpu_too: bool, min_bytes: int
) -> Callable[[torch.Tensor], torch.Tensor]:
    """The pack hook of a region that offloads nothing: keeps ``t``; a span counted the first time goes to
    ``sizes``, and to ``candidates`` if the copy path could take it. The rule is ``_span_of``'s and
    ``_Run._count``'s, inlined: this closure runs for every saved tensor (see [Note: counting at ratio 0]).
    """
    token = object()  # this run's: a storage marked with another run's token is new here
    count, candidate = sizes.append, candidates.append

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.requires_grad:
            if t.is_leaf:
                return t  # a parameter: not counted, and it owns no graph node
            if type(t) is not _TENSOR:
                return t.detach()  # a subclass: not counted
            base = t._base
            if base is not None:  # a view of a parameter is not counted
                if base.is_leaf:
                    if base.requires_grad:
                        return t  # and its node saves nothing (see [Note: the cost of the hooks])
                    if _parameter_like(base):
                        return t.data  # a frozen parameter's view made to require grad in place
                elif type(base) is _PARAMETER:
                    return t.data
            handle = t.data  # see [Note: the cost of the hooks]
        elif type(t) is not _TENSOR or getattr(t, "_is_param", False):
            return t  # a subclass or a frozen parameter: not counted, and no graph node
        else:
            base = t._base
            if base is not None and (type(base) is _PARAMETER or (base.is_leaf and _parameter_like(base))):
                return t  # a view of a frozen parameter
            handle = t
        if not ((cpu_too and t.is_cpu) or t.is_cuda):
            return handle
        try:
            storage = t.untyped_storage()
        except (NotImplementedError, RuntimeError):  # sparse, mkldnn and other layouts without a storage
            return handle
        total = storage.nbytes()
        nbytes = t.nbytes if t.is_contiguous() else _extent(t)
        if not nbytes:  # an empty tensor (of any storage) saves nothing
            return handle
        if 2 * nbytes >= total:
            span, nbytes = None, total
        else:
            span = (t.storage_offset() * t.element_size(), nbytes)
        mark: _Mark | None = getattr(storage, _MARK, None)
        address = storage.data_ptr()
        if mark is None or mark[0] is not token or mark[1] != address:
            storage._lightning_haiscale_offload_counted = (token, address, None if span is None else {span})
        elif mark[2] is None:  # only the whole storage was counted
            if span is None:
                return handle
            storage._lightning_haiscale_offload_counted = (token, address, {None, span})
        elif span in mark[2]:
            return handle
        else:
            mark[2].add(span)
        count(nbytes)
        if nbytes >= min_bytes and not (t.is_conj() or t.is_neg()):
            candidate(nbytes)
        return handle

    return pack


_NO_COPIES = CopyClock()  # the clock of every ratio-0 entry: nothing is ever added to it


class _CountingRun:
    """One entry of a region at ratio 0: nothing is offloaded, so nothing but the count is kept."""

    def __init__(self, options: _Options) -> None:
        self.sizes: list[int] = []  # every span counted, in save order
        self.candidates: list[int] = []  # those the copy path could take: the next entry's plan
        self._pack = _counting_pack(self.sizes, self.candidates, options.force_copy, options.min_bytes)

    def hooks(self) -> tuple[Callable[[torch.Tensor], torch.Tensor], Callable[[torch.Tensor], torch.Tensor]]:
        return self._pack, _keep

    def finish(self, record: RegionRecord) -> None:
        """Ends the forward: the measurement becomes the next entry's plan; statistics are recorded."""
        _record_entry(record, self.candidates, sum(self.sizes), 0, len(self.sizes), 0, _NO_COPIES)


def _record_entry(
    record: RegionRecord,
    candidates: list[int],
    bytes_saved: int,
    bytes_offloaded: int,
    tensors_saved: int,
    tensors_offloaded: int,
    clock: CopyClock,
) -> None:
    record.candidate_sizes, record.bytes_saved, record.clock = candidates, bytes_saved, clock
    stats = record.stats
    stats.entries += 1
    stats.bytes_saved, stats.bytes_offloaded = bytes_saved, bytes_offloaded
    stats.tensors_saved, stats.tensors_offloaded = tensors_saved, tensors_offloaded
    stats.total_bytes_saved += bytes_saved
    stats.total_bytes_offloaded += bytes_offloaded


class _Run:
    """One entry of a region: the pack and unpack hooks and everything they share."""

    def __init__(self, options: _Options, record: RegionRecord) -> None:
        self.options = options
        self.clock = CopyClock()
        self._lock = threading.RLock()
        self._seq = 0
        self._seen: dict[_Key, _Seen] = {}
        self._transfers: dict[torch.device, Transfer] = {}
        self._planned = record.candidate_sizes
        planless = self._planned is None
        self._plan = None if planless else plan_offload(self._planned, record.bytes_saved, options.offload_ratio)
        self._streaming = StreamingSelector(options.offload_ratio)
        self.sizes: list[int] = []  # candidate sizes seen, in save order: the next entry's plan
        self.bytes_saved = self.bytes_offloaded = self.tensors_saved = self.tensors_offloaded = 0
        self._offloaded: list[_Stored] = []
        self._cursor = -1  # next entry of _offloaded to prefetch, walking backward
        self._ahead_bytes = 0  # prefetched and not yet used
        self._pending: deque[_Stored] = deque()  # copies out whose source is still held
        self._pending_bytes = 0

    def hooks(self) -> tuple[Callable[[torch.Tensor], object], Callable[[object], torch.Tensor]]:
        return self.pack, self.unpack

    # -- forward ------------------------------------------------------------------------------------

    def pack(self, t: torch.Tensor) -> _Resident | _Offloaded:
        with self._lock:
            seq = self._seq
            self._seq = seq + 1
            if t.requires_grad and t.is_leaf:
                return seq, t  # a parameter: not counted, and it owns no graph node
            span = _span_of(t, self.options.force_copy)
            stored = None if span is None else self._copy_of(t, span, seq)
            if stored is None:
                return seq, _detached(t) if t.requires_grad else t  # a handle must not own t's graph node
            stored.handles += 1
            return _Offloaded(self, stored, seq, t, t.storage_offset() * t.element_size() - span[1])

    def _copy_of(self, t: torch.Tensor, span: tuple[torch.UntypedStorage, int, int], seq: int) -> _Stored | None:
        """The copy of ``t``'s span, or None to keep ``t`` resident; a span seen the first time is counted."""
        storage, start, nbytes = span
        ref = weakref.ref(storage)
        key = (id(ref), storage.data_ptr(), start, nbytes)  # see [Note: recognising a span]
        seen = self._seen.get(key)
        if seen is None:
            stored = self._save(t, storage, start, nbytes, seq)
            self._seen[key] = (ref, stored)
            return stored
        stored = seen[1]
        if stored is None or not _rebuildable(t):  # a conjugate view of an offloaded span stays resident
            return None
        if not stored.handles:  # every earlier save of it was released: copy again
            stored = self._offload(t, storage, start, nbytes, seq)
            self._seen[key] = (ref, stored)
        return stored

    def _save(
        self, t: torch.Tensor, storage: torch.UntypedStorage, start: int, nbytes: int, seq: int
    ) -> _Stored | None:
        """Counts a new span and offloads it if the selection says so."""
        if not self._count(t, nbytes):
            return None
        self.bytes_offloaded += nbytes
        self.tensors_offloaded += 1
        return self._offload(t, storage, start, nbytes, seq)

    def _count(self, t: torch.Tensor, nbytes: int) -> bool:
        """Counts a new span; whether the selection offloads it. Only a span of at least ``min_bytes`` that the
        copy path can rebuild is a candidate (the ratio-0 pack keeps the same list)."""
        self.bytes_saved += nbytes
        self.tensors_saved += 1
        return nbytes >= self.options.min_bytes and _rebuildable(t) and self._choose(len(self.sizes), nbytes)

    def _offload(self, t: torch.Tensor, storage: torch.UntypedStorage, start: int, nbytes: int, seq: int) -> _Stored:
        """Starts the copy out of a span; bounds the device bytes still waiting for theirs."""
        source = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage, start, (nbytes,), (1,))
        transfer = self._transfer(t.device)
        stored = _Stored(seq, nbytes, transfer, self.options.pool.acquire(nbytes, pin=t.is_cuda))
        stored.written = transfer.to_host(source, stored.host)
        self._offloaded.append(stored)
        self._cursor = len(self._offloaded) - 1
        if stored.written is not None:
            stored.source, stored.source_ptr = source, source.data_ptr()
            self._pending.append(stored)
            self._pending_bytes += nbytes
            self._throttle()
        return stored

    def _choose(self, index: int, nbytes: int) -> bool:
        """Follows the plan while the region saves what was measured, then the streaming rule."""
        self.sizes.append(nbytes)
        if self._plan is not None and index < len(self._plan) and self._planned[index] == nbytes:
            take = self._plan[index]
            self._streaming.offloaded += nbytes if take else 0
            return take
        self._plan = None
        return self._streaming.take(nbytes, self.bytes_saved)

    def _transfer(self, device: torch.device) -> Transfer:
        if device not in self._transfers:
            kind = CudaTransfer if device.type == "cuda" else HostTransfer
            self._transfers[device] = kind(device, self.clock)
        return self._transfers[device]

    def _throttle(self) -> None:
        """Keeps at most ``max_inflight_bytes`` of device bytes waiting for their copy out."""
        self._poll()
        while self._pending_bytes > self.options.max_inflight_bytes:
            stored = self._pending.popleft()
            if stored.source is not None:
                stored.transfer.wait(stored.written)
                self._retire(stored, read=True)

    def _poll(self) -> None:
        """Drops the sources of finished copies out (they complete in order on one stream)."""
        while self._pending:
            stored = self._pending[0]
            if stored.source is not None and not stored.written.query():
                return
            self._pending.popleft()
            self._retire(stored, read=True)

    def _retire(self, stored: _Stored, read: bool = False) -> None:
        """Drops the reference to the device bytes; unless ``read``, first protects a copy still reading them."""
        if stored.source is None:
            return
        if not read and not stored.written.query():
            stored.transfer.keep_until_read(stored.source)
        stored.source = None
        self._pending_bytes -= stored.nbytes

    def finish(self, record: RegionRecord) -> None:
        """Ends the forward: the measurement becomes the next entry's plan; statistics are recorded."""
        with self._lock:
            self._seen.clear()
            counts = (self.bytes_saved, self.bytes_offloaded, self.tensors_saved, self.tensors_offloaded)
            _record_entry(record, self.sizes, *counts, self.clock)

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
            stored = handle.stored
            if stored.restored is None:
                self._restore(stored)
            if not stored.consumed:
                stored.consumed = True
                self._ahead_bytes -= stored.nbytes if stored.prefetched else 0
            data, done = stored.restored, stored.done
        stored.transfer.before_use(data, done)
        # ``data`` is the span: a fresh allocation, or a view into the original storage when reused.
        offset = (data.storage_offset() + handle.offset) // handle.dtype.itemsize
        view = torch.empty(0, dtype=handle.dtype, device=data.device)
        return view.set_(data.untyped_storage(), offset, handle.size, handle.stride)

    def _prefetch(self, seq: int) -> None:
        """Starts copies back of the offloaded spans saved before ``seq`` (needed next), within the window."""
        while self._cursor >= 0 and self._ahead_bytes < self.options.prefetch_bytes:
            stored = self._offloaded[self._cursor]
            self._cursor -= 1
            if stored.seq < seq and stored.handles and stored.restored is None:
                self._restore(stored)
                stored.prefetched = True
                self._ahead_bytes += stored.nbytes

    def _restore(self, stored: _Stored) -> None:
        if stored.source is not None and _intact(stored.source, stored.source_ptr):
            stored.restored = stored.source  # the copy out is not retired: the device bytes are still here
            return
        stored.restored, stored.done = stored.transfer.to_device(stored.host, stored.written)
        self.options.pool.release(stored.host, stored.done)
        stored.host = None

    def drop_handle(self, stored: _Stored) -> None:
        """A saved tensor was released by autograd; the last one releases the span's memory."""
        with self._lock:
            stored.handles -= 1
            if stored.handles:
                return
            self._retire(stored)
            if stored.host is not None:
                self.options.pool.release(stored.host, stored.written)
                stored.host = None
            stored.restored = None
            if stored.prefetched and not stored.consumed:
                self._ahead_bytes -= stored.nbytes


class CPUOffload:
    """Offloads ``offload_ratio`` of the bytes saved for backward inside the region to host memory.

    >>> with CPUOffload(offload_ratio=0.3, tag="MyModel"):
    ...     out = model(x)
    >>> loss_fn(out, y).backward()

    The first entry of a ``tag`` measures the region (offloading with an online rule meanwhile); later
    entries follow a plan made from the previous entry's measurement: as close to the ratio as tensor
    sizes allow, favoring the tensors saved first. Without a tag, the measurement lives in this
    object, so reuse one object across steps. Statistics: ``offload_stats(tag)`` or ``.stats()``.

    Args:
        offload_ratio: fraction in [0, 1] of the saved bytes to move to host memory.
        tag: names the region; its measurement and statistics persist across entries and objects.
        min_bytes: tensors smaller than this stay resident (they still count as saved bytes).
        max_inflight_bytes: device bytes allowed to wait for their copy out before compute waits.
        prefetch_bytes: how far copies back may run ahead of backward's use.
        force_copy: also offload CPU tensors (copied to host buffers and back); by default CPU tensors
            are left alone. Meant for testing the mechanism without a GPU.
        pool: host buffers to use (default: the process-wide ``default_pool()``).
    """

    def __init__(
        self,
        offload_ratio: float,
        tag: str | None = None,
        *,
        min_bytes: int = DEFAULT_MIN_BYTES,
        max_inflight_bytes: int = DEFAULT_INFLIGHT_BYTES,
        prefetch_bytes: int = DEFAULT_PREFETCH_BYTES,
        force_copy: bool = False,
        pool: PinnedBufferPool | None = None,
    ) -> None:
        sizes = (min_bytes, max_inflight_bytes, prefetch_bytes)
        if not (type(min_bytes) is type(max_inflight_bytes) is type(prefetch_bytes) is int and min(sizes) >= 0):
            names = ("min_bytes", "max_inflight_bytes", "prefetch_bytes")
            for name, value in zip(names, sizes, strict=True):  # a region is built every step: checked fast first
                if not isinstance(value, int) or value < 0:
                    raise ValueError(f"{name}={value!r} must be an int >= 0 (bytes)")
        self.offload_ratio = check_ratio(offload_ratio)
        self.tag = tag
        pool = pool if pool is not None else default_pool()
        self._options = _Options(self.offload_ratio, min_bytes, max_inflight_bytes, prefetch_bytes, force_copy, pool)
        self._record = region_record(tag) if tag is not None else RegionRecord(None)
        self._run: _Run | _CountingRun | None = None
        self._hooks: torch.autograd.graph.saved_tensors_hooks | None = None

    def __enter__(self) -> CPUOffload:
        if self._record.active:
            raise RuntimeError(
                f"CPUOffload region tag={self.tag!r} is already active; nested regions need distinct tags"
            )
        self._run = _CountingRun(self._options) if self.offload_ratio == 0 else _Run(self._options, self._record)
        self._hooks = torch.autograd.graph.saved_tensors_hooks(*self._run.hooks())
        self._hooks.__enter__()
        self._record.active = True
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._hooks is None or self._run is None:
            raise RuntimeError("CPUOffload.__exit__ without a matching __enter__")
        hooks, run = self._hooks, self._run
        self._hooks = self._run = None
        hooks.__exit__(exc_type, exc, tb)
        self._record.active = False
        run.finish(self._record)

    @property
    def active(self) -> bool:
        """Whether the region's hooks are installed."""
        return self._hooks is not None

    def stats(self) -> OffloadStats:
        """This region's statistics (the same as ``offload_stats(tag)`` for a tagged region)."""
        return self._record.snapshot()

    def __repr__(self) -> str:
        return f"CPUOffload(offload_ratio={self.offload_ratio}, tag={self.tag!r})"
