"""A communicator over a torch.distributed group whose collectives run in shared memory on each host.

[Note: routing]
- CPU tensors, one host: straight to the native engine's worker thread (no Python thread involved).
  A tensor from :meth:`Communicator.alloc_buffer` is reduced in place in shared memory (zero-copy).
- Several hosts (hierarchical), CUDA tensors, or the torch.distributed fallback: a job on one Python
  thread (FIFO) that calls the engine and ``torch.distributed`` in turn.
Every rank must issue the same collectives in the same order, as with NCCL. The engine sees them in
program order because a direct submission is only taken when no threaded job is pending.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import secrets
import threading
import warnings
import weakref
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Literal

import torch
import torch.distributed as dist

from lightning_haiscale.hfreduce._native import load_engine
from lightning_haiscale.hfreduce.errors import (
    HFReduceError,
    HFReduceMismatchError,
    HFReducePeerError,
    HFReduceTimeoutError,
    SharedMemoryTooSmallError,
)
from lightning_haiscale.hfreduce.topology import Topology

log = logging.getLogger(__name__)

ReduceOp = Literal["sum", "avg"]

_DTYPE_CODES = {
    torch.float32: 0,
    torch.float64: 1,
    torch.float16: 2,
    torch.bfloat16: 3,
    torch.int32: 4,
    torch.int64: 5,
}
_ERRORS: dict[str, type[HFReduceError]] = {  # by the name of the engine's ErrorKind
    "TIMEOUT": HFReduceTimeoutError,
    "PEER_DIED": HFReducePeerError,
    "MISMATCH": HFReduceMismatchError,
}
_SHM_FIX = (
    "Give the job more: `docker run --shm-size=8g ...`, or on Kubernetes mount an emptyDir with "
    "`medium: Memory` at /dev/shm"
)
# torch 2.13 renamed the tensor collectives (the old names warn); older torch has only the old names.
_reduce_scatter_tensor = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_SPIN_ITERS = 2000  # ~50-100 µs of busy-waiting before sleeping, only when every rank has a core


def _seconds(timeout: float | timedelta | None) -> float | None:
    return timeout.total_seconds() if isinstance(timeout, timedelta) else timeout


def _shm_free_bytes() -> int:
    try:
        st = os.statvfs("/dev/shm")
    except OSError:
        return 0
    return st.f_bavail * st.f_frsize


class Work:
    """Handle of an asynchronous collective, like ``torch.distributed``'s ``Work``."""

    def __init__(
        self,
        comm: Communicator,
        native: Any = None,
        future: Future | None = None,
        keepalive: tuple[torch.Tensor, ...] = (),
    ) -> None:
        self._comm = comm
        self._native = native
        self._future = future
        self._keepalive = keepalive  # tensors the engine reads or writes until completion

    def is_completed(self) -> bool:
        if self._native is not None:
            return self._native.is_completed()
        return self._future is None or self._future.done()

    def wait(self, timeout: float | timedelta | None = None) -> bool:
        """Blocks until the collective is done; raises its error if it failed.

        Args:
            timeout: seconds (or a timedelta) to wait here; the engine's own deadline applies anyway.
        """
        seconds = _seconds(timeout)
        if self._native is not None:
            if not self._native.wait(-1.0 if seconds is None else seconds):
                raise HFReduceTimeoutError(f"hfreduce: collective not completed within {seconds} s", [])
            self._comm._raise_if_failed(self._native)
        elif self._future is not None:
            try:
                after = self._future.result(timeout=seconds)
            except FutureTimeout:
                raise HFReduceTimeoutError(f"hfreduce: collective not completed within {seconds} s", []) from None
            if after is not None:
                after()
        self._keepalive = ()
        return True


@dataclass(frozen=True)
class _Buffer:
    shared: Any  # _C.SharedBuffer
    start: int
    end: int


class Communicator:
    """hfreduce-style collectives over an existing ``torch.distributed`` process group.

    Ranks on one host share a memory segment and reduce in it with SIMD kernels on a background
    thread; across hosts the engine reduce-scatters in shared memory, all-reduces each local rank's
    slice with its peers on the other hosts through ``torch.distributed``, and all-gathers in shared
    memory. Construction is collective over ``group``.

    Args:
        group: the process group (default: the world).
        timeout: deadline of every wait on a peer; a stalled peer makes the others raise
            :class:`HFReduceTimeoutError`, a dead one :class:`HFReducePeerError` within about a second.
        chunk_bytes: staging chunk per rank; collectives are pipelined in chunks of this size.
        allow_fallback: when ``/dev/shm`` is too small, use plain ``torch.distributed`` with one warning
            instead of raising :class:`SharedMemoryTooSmallError`.
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        *,
        timeout: timedelta = timedelta(minutes=5),
        chunk_bytes: int = 1 << 20,
        allow_fallback: bool = False,
    ) -> None:
        load_engine()  # without the engine: an ImportError that says how to build it, before any collective
        if not dist.is_initialized():
            raise RuntimeError("hfreduce: call torch.distributed.init_process_group() before Communicator()")
        if chunk_bytes < 4096 or chunk_bytes % 4096:
            raise ValueError(f"chunk_bytes={chunk_bytes} must be a positive multiple of 4096")
        self.group = group if group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)
        self.timeout = timeout
        self.topology = Topology.discover(self.group, _shm_free_bytes())
        self._check_uniform_hosts()
        self._buffers: list[_Buffer] = []
        self._allow_fallback = allow_fallback
        self._disagreed: str | None = None  # set when hosts called different collectives
        self._pending = 0
        self._pending_lock = threading.Lock()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hfreduce")
        self._native = self._open_native(chunk_bytes, allow_fallback)
        self._cross_group, self._cross_order = self._make_cross_groups()
        self._copy_streams: dict[torch.device, tuple[Any, Any]] = {}  # device-to-host, host-to-device
        self._cuda_chunk_bytes = 4 << 20
        self._finalizer = weakref.finalize(self, _shutdown, self._executor, self._native)

    # ------------------------------------------------------------------------------ properties

    @property
    def local_rank(self) -> int:
        return self.topology.local_rank

    @property
    def local_size(self) -> int:
        return self.topology.local_size

    @property
    def num_hosts(self) -> int:
        return self.topology.num_hosts

    @property
    def backend(self) -> str:
        """``"shm"`` (one host), ``"hierarchical"`` (several) or ``"torch.distributed"`` (fallback)."""
        if self._native is None:
            return "torch.distributed"
        return "shm" if self.num_hosts == 1 else "hierarchical"

    # --------------------------------------------------------------------------- collectives

    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp = "sum", async_op: bool = False) -> Work | None:
        """Reduces ``tensor`` in place across the group (``op="avg"`` divides by the world size)."""
        _check_tensor(tensor, "tensor")
        divisor = self._divisor(op, tensor.dtype)
        if self._direct(tensor):
            buffer = self._find_buffer(tensor)
            code, n = _DTYPE_CODES[tensor.dtype], tensor.numel()
            if buffer is not None:
                offset = tensor.data_ptr() - buffer.start
                native = self._native.all_reduce_buffer(buffer.shared, offset, n, code, divisor, not async_op)
            else:
                native = self._native.all_reduce(tensor.data_ptr(), tensor.data_ptr(), n, code, divisor, not async_op)
            return self._finish(Work(self, native=native, keepalive=(tensor,)), async_op)
        return self._finish(self._threaded(self._all_reduce_job, tensor, divisor), async_op)

    def reduce_scatter(
        self, output: torch.Tensor, input: torch.Tensor, op: ReduceOp = "sum", async_op: bool = False
    ) -> Work | None:
        """``output`` (n elements) receives this rank's n-slice of the reduction of ``input`` (world*n)."""
        _check_tensor(output, "output")
        _check_tensor(input, "input")
        _check_pair(output, input, self.world_size, "reduce_scatter")
        divisor = self._divisor(op, input.dtype)
        if self._direct(output, input):
            native = self._native.reduce_scatter(
                input.data_ptr(), output.data_ptr(), output.numel(), _DTYPE_CODES[input.dtype], divisor, not async_op
            )
            return self._finish(Work(self, native=native, keepalive=(output, input)), async_op)
        return self._finish(self._threaded(self._reduce_scatter_job, output, input, divisor), async_op)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False) -> Work | None:
        """``output`` (world*n elements) receives every rank's ``input`` (n elements), in rank order."""
        _check_tensor(output, "output")
        _check_tensor(input, "input")
        _check_pair(input, output, self.world_size, "all_gather")
        if self._direct(output, input):
            native = self._native.all_gather(
                input.data_ptr(), output.data_ptr(), input.numel(), _DTYPE_CODES[input.dtype], not async_op
            )
            return self._finish(Work(self, native=native, keepalive=(output, input)), async_op)
        return self._finish(self._threaded(self._all_gather_job, output, input), async_op)

    def broadcast(self, tensor: torch.Tensor, src: int = 0, async_op: bool = False) -> Work | None:
        """Copies ``tensor`` of group rank ``src`` to every rank."""
        _check_tensor(tensor, "tensor")
        if not 0 <= src < self.world_size:
            raise ValueError(f"src={src} is not a rank of a group of size {self.world_size}")
        if self._direct(tensor):
            root = self.topology.local_ranks.index(src)
            native = self._native.broadcast(
                tensor.data_ptr(), tensor.numel(), _DTYPE_CODES[tensor.dtype], root, not async_op
            )
            return self._finish(Work(self, native=native, keepalive=(tensor,)), async_op)
        return self._finish(self._threaded(self._broadcast_job, tensor, src), async_op)

    def barrier(self) -> None:
        """Returns once every rank of the group has called it."""
        if self._direct():
            self._finish(Work(self, native=self._native.barrier(True)), False)
        else:
            self._finish(self._threaded(self._barrier_job), False)

    def alloc_buffer(self, numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """A zero-filled CPU tensor in shared memory; :meth:`all_reduce` of it (or of a contiguous view
        of it) reduces in place, with no copy in or out. Collective: all ranks allocate in the same order.
        """
        if numel < 0:
            raise ValueError(f"numel={numel} must be >= 0")
        _check_dtype(dtype)
        if self._native is None:
            return torch.zeros(numel, dtype=dtype)
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        region = max(4096, -(-nbytes // 4096) * 4096)  # what the engine maps per local rank
        shared = self._create_shared(
            lambda name, create: load_engine().SharedBuffer(name, nbytes, self.local_size, create),
            region * self.local_size,
            f"alloc_buffer({numel}, {dtype}) ({region / 2**20:.1f} MiB for each of {self.local_size} local ranks)",
        )
        if shared is None:
            return torch.zeros(numel, dtype=dtype)
        self.barrier()  # every local rank has mapped it
        shared.unlink()
        tensor = torch.frombuffer(shared.region(self.local_rank), dtype=torch.uint8)[:nbytes].view(dtype)
        self._buffers.append(_Buffer(shared, tensor.data_ptr(), tensor.data_ptr() + shared.region_bytes))
        return tensor

    def close(self) -> None:
        """Finishes queued collectives and stops the engine's threads. Idempotent."""
        self._finalizer()

    def __enter__(self) -> Communicator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------------------ set-up

    def _check_uniform_hosts(self) -> None:
        sizes = sorted({len(ranks) for ranks in self.topology.hosts})
        if len(sizes) > 1:
            raise ValueError(
                f"hfreduce needs the same number of ranks on every host, got {sizes}; launch the same "
                "number of processes per node"
            )

    def _open_native(self, chunk_bytes: int, allow_fallback: bool) -> Any:
        segment = load_engine().Communicator.segment_bytes(self.local_size, chunk_bytes)
        free = min(p.shm_free_bytes for p in self.topology.peers)
        if free < 2 * segment:
            self._shm_too_small(
                f"hfreduce needs {2 * segment / 2**20:.1f} MiB of free shared memory per host "
                f"({segment / 2**20:.1f} MiB for the communicator's staging segment and as much again kept free "
                f"for shared buffers) but /dev/shm has {free / 2**20:.1f} MiB free"
            )
            return None
        spin = _SPIN_ITERS if self.local_size <= len(os.sched_getaffinity(0)) else 0
        seconds = self.timeout.total_seconds()
        native = self._create_shared(
            lambda name, create: load_engine().Communicator(
                name, self.local_rank, self.local_size, create, chunk_bytes, seconds, spin
            ),
            segment,
            "the communicator's staging segment",
        )
        if native is not None:
            native.wait_attached()
        return native

    def _create_shared(self, make: Callable[[str, bool], Any], nbytes: int, what: str) -> Any:
        """Local rank 0 of each host creates ``make(name, True)`` (``nbytes`` of /dev/shm) under a fresh
        unguessable name; its peers, having received the name, open it with ``make(name, False)``.

        If any host's /dev/shm cannot hold it, every rank learns so in the same exchange and raises
        :class:`SharedMemoryTooSmallError` (or, with ``allow_fallback``, returns None) together.
        """
        created, mine, failure = None, None, None
        if self.local_rank == 0:
            mine = f"/lhs-{os.getpid()}-{secrets.token_hex(16)}"  # pid: whose it was, if one ever leaks
            too_small = f"hfreduce: {what} needs {nbytes / 2**20:.1f} MiB of shared memory on host {self.topology.host}"
            if _shm_free_bytes() < nbytes:  # checked first; the engine's posix_fallocate settles any race
                failure = f"{too_small} but /dev/shm has {_shm_free_bytes() / 2**20:.1f} MiB free"
            else:
                try:
                    created = make(mine, True)
                except load_engine().ShmFullError as error:
                    failure = f"{too_small}: {error}"
        names: list[tuple[str | None, str | None]] = [(mine, failure)] * self.world_size
        if self.world_size > 1:
            dist.all_gather_object(names, (mine, failure), group=self.group)
        failures = [f for _, f in names if f is not None]
        if failures:
            del created  # unlinks this host's segment if it was made
            self._shm_too_small(failures[0])
            return None
        if created is not None:
            return created
        return make(str(names[self.topology.local_ranks[0]][0]), False)

    def _shm_too_small(self, message: str) -> None:
        """Raises :class:`SharedMemoryTooSmallError`, or warns when ``allow_fallback`` (the caller falls back)."""
        if not self._allow_fallback:
            raise SharedMemoryTooSmallError(
                f"{message}. {_SHM_FIX}; or pass allow_fallback=True to use torch.distributed."
            )
        warnings.warn(f"{message}; falling back to torch.distributed collectives.", stacklevel=4)

    def _make_cross_groups(self) -> tuple[dist.ProcessGroup | None, list[int]]:
        """The group of this rank's local index on every host, and the (local index, host) order of ranks."""
        if self._native is None or self.num_hosts == 1:
            return None, []
        order: list[int] = []
        mine = None
        for local in range(self.local_size):
            members = sorted(self.topology.cross_host_ranks(local), key=self._global_rank)
            order += members
            if local == self.local_rank:
                # gloo: the slices crossing hosts are in host memory, whatever the tensors' device.
                ranks = [self._global_rank(r) for r in members]
                mine = dist.new_group(ranks, backend="gloo", use_local_synchronization=True)
        return mine, order

    def _global_rank(self, group_rank: int) -> int:
        return dist.get_global_rank(self.group, group_rank) if self.group is not dist.group.WORLD else group_rank

    # ---------------------------------------------------------------------------- execution

    def _direct(self, *tensors: torch.Tensor) -> bool:
        """Whether the collective can go straight to the engine (see [Note: routing])."""
        return (
            self._native is not None
            and self.num_hosts == 1
            and self._pending == 0
            and all(not t.is_cuda for t in tensors)
        )

    def _threaded(self, job: Callable[..., Any], *tensors: Any) -> Work:
        cuda = [t for t in tensors if isinstance(t, torch.Tensor) and t.is_cuda]
        ready = None
        if cuda:  # the caller's work on the tensor's device (not the current device's) must finish first
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(cuda[0].device))
        with self._pending_lock:
            self._pending += 1
        future = self._executor.submit(self._run_job, job, tensors, ready)
        return Work(self, future=future)

    def _run_job(self, job: Callable[..., Any], tensors: tuple[Any, ...], ready: Any) -> Callable[[], None] | None:
        try:
            if ready is None:
                job(*tensors)
                return None
            device = next(t.device for t in tensors if isinstance(t, torch.Tensor) and t.is_cuda)
            # [Note: CUDA device of the worker] This thread's current device is GPU 0 unless set: pinned
            # buffers, events and streams would otherwise create a context there on every rank.
            with torch.cuda.device(device):
                if self._native is None:  # torch.distributed handles device tensors itself
                    torch.cuda.current_stream(device).wait_event(ready)
                    job(*tensors)
                    return _wait_for(torch.cuda.current_stream(device).record_event(), device)
                return self._run_cuda_job(job, tensors, ready, device)
        finally:
            with self._pending_lock:
                self._pending -= 1

    def _run_cuda_job(
        self, job: Callable[..., Any], tensors: tuple[Any, ...], ready: Any, device: torch.device
    ) -> Callable[[], None]:
        """hfreduce on CUDA: device-to-host into pinned memory on a side stream, reduce on the CPU, copy back.
        Only what the collective reads goes to the host and only what it writes comes back (an all-gather's
        output is never read, a reduce-scatter's input never written). Returns what ``Work.wait`` runs: make
        the caller's stream wait for the copy back."""
        d2h, h2d = self._cuda_streams(device)
        if job == self._all_reduce_job and self.backend == "shm":
            return self._pipelined_cuda_all_reduce(tensors[0], tensors[1], ready, d2h, h2d)
        reads, writes = self._staged(job, tensors)
        with torch.cuda.stream(d2h):
            d2h.wait_event(ready)
            host = tuple(_to_host(t, i in reads) if i in reads or i in writes else t for i, t in enumerate(tensors))
            d2h.synchronize()
        job(*host)
        with torch.cuda.stream(h2d):
            for i in writes:
                tensors[i].copy_(host[i], non_blocking=True)
                tensors[i].record_stream(h2d)
            done = h2d.record_event()
        return _wait_for(done, device)

    def _staged(self, job: Callable[..., Any], tensors: tuple[Any, ...]) -> tuple[set[int], set[int]]:
        """Which of a job's CUDA arguments it reads and which it writes (by position)."""
        if job == self._reduce_scatter_job or job == self._all_gather_job:
            return {1}, {0}  # (output, input, ...)
        if job == self._broadcast_job:
            return {0}, ({0} if self.rank != tensors[1] else set())
        return {0}, {0}

    def _pipelined_cuda_all_reduce(
        self, tensor: torch.Tensor, divisor: float, ready: Any, d2h: Any, h2d: Any
    ) -> Callable[[], None]:
        """[Note: CUDA pipeline] Chunk i is reduced on the CPU while the copy engines move chunk i+1 to
        the host and chunk i-1 back to the device (two streams), as hfreduce pipelines its stages."""
        flat = tensor.view(-1)
        host = torch.empty(flat.numel(), dtype=flat.dtype, pin_memory=True)
        step = max(1, self._cuda_chunk_bytes // flat.element_size())
        bounds = [(b, min(b + step, flat.numel())) for b in range(0, flat.numel(), step)]
        arrived = []
        with torch.cuda.stream(d2h):
            d2h.wait_event(ready)
            for b, e in bounds:
                host[b:e].copy_(flat[b:e], non_blocking=True)
                arrived.append(d2h.record_event())
        code = _DTYPE_CODES[flat.dtype]
        with torch.cuda.stream(h2d):
            for (b, e), event in zip(bounds, arrived, strict=True):
                event.synchronize()
                chunk = host[b:e]
                self._run_native("all_reduce", chunk.data_ptr(), chunk.data_ptr(), e - b, code, divisor)
                flat[b:e].copy_(chunk, non_blocking=True)
            flat.record_stream(d2h)
            flat.record_stream(h2d)
            done = h2d.record_event()
        return _wait_for(done, flat.device)

    def _cuda_streams(self, device: torch.device) -> tuple[Any, Any]:
        if device not in self._copy_streams:
            self._copy_streams[device] = (torch.cuda.Stream(device=device), torch.cuda.Stream(device=device))
        return self._copy_streams[device]

    def _finish(self, work: Work, async_op: bool) -> Work | None:
        if async_op:
            return work
        work.wait()
        return None

    def _run_native(self, collective: str, *args: Any) -> None:
        """Runs an engine collective on this thread and raises its error, if any."""
        self._raise_if_failed(getattr(self._native, collective)(*args, blocking=True))

    def _raise_if_failed(self, native: Any) -> None:
        kind = native.error_kind()  # an int: 0 (ErrorKind.NONE) is checked on every call
        if not kind:
            return
        name = load_engine().ErrorKind(kind).name
        ranks = [self.topology.local_ranks[r] for r in native.error_ranks()]
        if name == "MISMATCH":
            where = f"local ranks 0..{self.local_size - 1} are group ranks {list(self.topology.local_ranks)}"
        else:
            where = f"group ranks {ranks}"
        message = native.error_message() + f" ({where}; this is group rank {self.rank})"
        error = _ERRORS.get(name)
        if error is None:
            raise HFReduceError(message)
        raise error(message, ranks)

    def _divisor(self, op: str, dtype: torch.dtype) -> float:
        if op == "sum":
            return 1.0
        if op == "avg":
            if not dtype.is_floating_point:
                raise TypeError(f"op='avg' needs a floating-point tensor, got {dtype}; use op='sum'")
            return float(self.world_size)
        raise ValueError(f"op={op!r} is not supported; use 'sum' or 'avg'")

    def _find_buffer(self, tensor: torch.Tensor) -> _Buffer | None:
        start = tensor.data_ptr()
        end = start + tensor.numel() * tensor.element_size()
        return next((b for b in self._buffers if b.start <= start and end <= b.end), None)

    def _agree_across_hosts(self, call: Any) -> None:
        """Raises :class:`HFReduceMismatchError` on every rank unless every rank of the group makes ``call``.

        [Note: agreement across hosts] The engine checks that the ranks of one host agree (see [Note:
        agreement check] in csrc/communicator.cpp). Across hosts, the ranks with this local index
        all-gather the call (a fixed-size message, which cannot itself mismatch); then the host's ranks
        agree on it in the engine, each announcing "disagreed elsewhere" instead if another host
        differed. A host whose ranks disagree fails there; every other host then has a local index whose
        cross-host peers differ from it, so its ranks fail too. Every rank raises; none waits on one that did.
        """
        if self._disagreed is not None:  # the engine is in step, but the program is not
            raise HFReduceError(f"hfreduce: communicator unusable after an earlier failure: {self._disagreed}")
        engine = load_engine()
        fields = (int(call.collective), call.dtype, call.count, call.arg, int(call.divisor))
        mine = torch.tensor(fields, dtype=torch.int64)
        every = mine.new_empty(self.num_hosts * len(fields))
        _all_gather_tensor(every, mine, group=self._cross_group)
        peers = self.topology.cross_host_ranks(self.local_rank)
        rows = dict(zip(peers, (tuple(r) for r in every.view(self.num_hosts, -1).tolist()), strict=True))
        if all(r == fields for r in rows.values()):
            self._run_native("agree", call)
            return
        with contextlib.suppress(HFReduceMismatchError):  # a local peer differs too: it fails on its own
            self._run_native("agree", engine.Fingerprint(engine.Collective.DISAGREED_ELSEWHERE, 0, 0))
        calls = "; ".join(
            f"group rank {rank} (host {host}) called {engine.Fingerprint(engine.Collective(r[0]), *r[1:]).describe()}"
            for host, (rank, r) in enumerate(rows.items())
        )
        self._disagreed = (
            f"hfreduce: ranks on different hosts called different collectives: {calls}. Is there a distributed "
            "collective mismatch in your code? Every rank must make the same calls, with the same sizes, dtypes, "
            f"ops and roots, in the same order (this is group rank {self.rank})"
        )
        raise HFReduceMismatchError(self._disagreed, [rank for rank, r in rows.items() if r != fields])

    # ------------------------------------------------------------------- threaded jobs (CPU)

    def _all_reduce_job(self, tensor: torch.Tensor, divisor: float) -> None:
        flat = tensor.view(-1)
        if self._native is None:
            dist.all_reduce(flat, group=self.group)
        elif self.num_hosts == 1:
            code = _DTYPE_CODES[flat.dtype]
            self._run_native("all_reduce", flat.data_ptr(), flat.data_ptr(), flat.numel(), code, divisor)
            return
        else:
            self._agree_across_hosts(_fingerprint(load_engine().Collective.ALL_REDUCE, flat, flat.numel(), 0, divisor))
            if flat.numel() > 0:
                self._hierarchical_all_reduce(flat)
        if divisor != 1.0:
            flat.div_(divisor)

    def _hierarchical_all_reduce(self, flat: torch.Tensor) -> None:
        code, n, local = _DTYPE_CODES[flat.dtype], flat.numel(), self.local_size
        per_rank = math.ceil(n / local)
        padded = flat if per_rank * local == n else torch.cat([flat, flat.new_zeros(per_rank * local - n)])
        piece = flat.new_empty(per_rank)
        self._run_native("reduce_scatter", padded.data_ptr(), piece.data_ptr(), per_rank, code, 1.0)
        dist.all_reduce(piece, group=self._cross_group)
        self._run_native("all_gather", piece.data_ptr(), padded.data_ptr(), per_rank, code)
        if padded is not flat:
            flat.copy_(padded[:n])

    def _reduce_scatter_job(self, output: torch.Tensor, input: torch.Tensor, divisor: float) -> None:
        n = output.numel()
        if self._native is None:
            _reduce_scatter_tensor(output, input, group=self.group)
        elif self.num_hosts == 1:
            self._run_native(
                "reduce_scatter", input.data_ptr(), output.data_ptr(), n, _DTYPE_CODES[input.dtype], divisor
            )
            return
        else:
            self._agree_across_hosts(_fingerprint(load_engine().Collective.REDUCE_SCATTER, input, n, 0, divisor))
            if n > 0:
                self._hierarchical_reduce_scatter(output, input)
        if divisor != 1.0:
            output.div_(divisor)

    def _hierarchical_reduce_scatter(self, output: torch.Tensor, input: torch.Tensor) -> None:
        n = output.numel()
        order = torch.tensor(self._cross_order)
        by_local = input.view(self.world_size, n).index_select(0, order).contiguous()
        host_pieces = output.new_empty(self.num_hosts * n)
        code = _DTYPE_CODES[input.dtype]
        self._run_native("reduce_scatter", by_local.data_ptr(), host_pieces.data_ptr(), host_pieces.numel(), code, 1.0)
        _reduce_scatter_tensor(output, host_pieces, group=self._cross_group)

    def _all_gather_job(self, output: torch.Tensor, input: torch.Tensor) -> None:
        n = input.numel()
        if self._native is None:
            _all_gather_tensor(output, input, group=self.group)
        elif self.num_hosts == 1:
            self._run_native("all_gather", input.data_ptr(), output.data_ptr(), n, _DTYPE_CODES[input.dtype])
        else:
            self._agree_across_hosts(_fingerprint(load_engine().Collective.ALL_GATHER, input, n))
            if n > 0:
                self._hierarchical_all_gather(output, input)

    def _hierarchical_all_gather(self, output: torch.Tensor, input: torch.Tensor) -> None:
        n = input.numel()
        across = input.new_empty(self.num_hosts * n)
        _all_gather_tensor(across, input.contiguous(), group=self._cross_group)
        by_local = input.new_empty(self.world_size * n)
        code = _DTYPE_CODES[input.dtype]
        self._run_native("all_gather", across.data_ptr(), by_local.data_ptr(), across.numel(), code)
        output.view(self.world_size, n).index_copy_(0, torch.tensor(self._cross_order), by_local.view(-1, n))

    def _broadcast_job(self, tensor: torch.Tensor, src: int) -> None:
        if self._native is None:
            dist.broadcast(tensor, src=self._global_rank(src), group=self.group)
            return
        if self.num_hosts > 1:
            self._agree_across_hosts(_fingerprint(load_engine().Collective.BROADCAST, tensor, tensor.numel(), src))
        src_host = next(h for h, ranks in enumerate(self.topology.hosts) if src in ranks)
        root = self.topology.hosts[src_host].index(src)
        if self.num_hosts > 1 and self.local_rank == root:
            dist.broadcast(tensor, src=self._global_rank(src), group=self._cross_group)
        code = _DTYPE_CODES[tensor.dtype]
        self._run_native("broadcast", tensor.data_ptr(), tensor.numel(), code, root)

    def _barrier_job(self) -> None:
        if self._native is None:
            dist.barrier(group=self.group)
            return
        if self.num_hosts > 1:  # the exchange of fingerprints is the barrier across hosts
            self._agree_across_hosts(load_engine().Fingerprint(load_engine().Collective.BARRIER, 0, 0))
            return
        self._run_native("barrier")


def _shutdown(executor: ThreadPoolExecutor, native: Any) -> None:
    executor.shutdown(wait=True)
    if native is not None:
        native.stop()


def _fingerprint(collective: Any, tensor: torch.Tensor, count: int, arg: int = 0, divisor: float = 1.0) -> Any:
    return load_engine().Fingerprint(collective, _DTYPE_CODES[tensor.dtype], count, arg, divisor)


def _to_host(tensor: torch.Tensor, copy: bool) -> torch.Tensor:
    """A pinned host twin of a device tensor, holding its values when ``copy`` (else uninitialised)."""
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    if copy:
        host.copy_(tensor, non_blocking=True)
    return host


def _wait_for(event: Any, device: torch.device) -> Callable[[], None]:
    """What ``Work.wait`` runs for a CUDA collective: the caller's stream on ``device`` waits for ``event``."""
    return lambda: torch.cuda.current_stream(device).wait_event(event)


def _check_dtype(dtype: torch.dtype) -> None:
    if dtype not in _DTYPE_CODES:
        supported = ", ".join(str(d).removeprefix("torch.") for d in _DTYPE_CODES)
        raise TypeError(f"hfreduce does not support dtype {dtype}; supported: {supported}")


def _check_tensor(tensor: Any, name: str) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    _check_dtype(tensor.dtype)
    if not tensor.is_contiguous():
        raise ValueError(f"{name} must be contiguous; call .contiguous() first")
    if tensor.device.type not in ("cpu", "cuda"):
        raise ValueError(f"{name} is on {tensor.device}; hfreduce supports cpu and cuda tensors")


def _check_pair(small: torch.Tensor, large: torch.Tensor, world: int, what: str) -> None:
    if small.dtype != large.dtype or small.device != large.device:
        raise ValueError(f"{what}: output and input must share dtype and device")
    if large.numel() != world * small.numel():
        raise ValueError(
            f"{what}: the large tensor has {large.numel()} elements, expected world_size ({world}) x "
            f"{small.numel()} = {world * small.numel()}"
        )
