"""A communicator over a torch.distributed group whose collectives run in shared memory on each host.

[Note: routing]
The communicator checks each call's arguments, then hands it to the backend it chose at construction
(see [Note: backends] in backend.py):
- CPU tensors on one host (``shm``): straight to the native engine, on the caller's thread when
  synchronous, else queued on the engine's worker thread (no Python thread involved). A tensor from
  :meth:`Communicator.alloc_buffer` is reduced in place in shared memory (zero-copy).
- Several hosts, CUDA tensors (see [Note: CUDA staging] in cuda_staging.py), or the torch.distributed
  fallback: a job on one Python thread (FIFO) that calls the backend.
Every rank must issue the same collectives in the same order, as with NCCL. The engine sees them in
program order because a direct submission is only taken when no threaded job is pending.
"""

from __future__ import annotations

import threading
import weakref
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any, Literal

import torch
import torch.distributed as dist

from lightning_haiscale.hfreduce import segments
from lightning_haiscale.hfreduce._native import load_engine
from lightning_haiscale.hfreduce.at_exit import close_at_exit
from lightning_haiscale.hfreduce.backend import Backend
from lightning_haiscale.hfreduce.cuda_staging import CudaStaging
from lightning_haiscale.hfreduce.dtypes import engine_dtype
from lightning_haiscale.hfreduce.hierarchical import HierarchicalBackend
from lightning_haiscale.hfreduce.shm_backend import ShmBackend
from lightning_haiscale.hfreduce.topology import Topology
from lightning_haiscale.hfreduce.torch_backend import TorchBackend
from lightning_haiscale.hfreduce.work import Work

ReduceOp = Literal["sum", "avg"]


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
        self.topology = Topology.discover(self.group, segments.shm_free_bytes())
        self._check_uniform_hosts()
        self._backend = self._choose_backend(chunk_bytes, allow_fallback)
        self._engine = self._backend if self._backend.queues_on_engine else None  # see [Note: routing]
        self._staging = CudaStaging(self._backend, self.rank)
        self._pending = 0  # jobs submitted to the thread and not yet finished
        self._pending_lock = threading.Lock()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hfreduce")
        self._finalizer = weakref.finalize(self, _shutdown, self._executor, self._backend)
        close_at_exit(self)  # one that is never closed: see [Note: a finished job exits 0] in at_exit.py

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
        return self._backend.name

    # --------------------------------------------------------------------------- collectives

    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp = "sum", async_op: bool = False) -> Work | None:
        """Reduces ``tensor`` in place across the group (``op="avg"`` divides by the world size)."""
        _check_tensor(tensor, "tensor")
        divisor = 1.0 if op == "sum" else self._divisor(op, tensor.dtype)
        engine = self._engine
        if engine is not None and not async_op and not self._pending and not tensor.is_cuda:
            engine.all_reduce(tensor, divisor)  # _issue's first branch, inlined: see [Note: the synchronous fast path]
            return None
        return self._issue("all_reduce", (tensor, divisor), (tensor,), async_op)

    def reduce_scatter(
        self, output: torch.Tensor, input: torch.Tensor, op: ReduceOp = "sum", async_op: bool = False
    ) -> Work | None:
        """``output`` (n elements) receives this rank's n-slice of the reduction of ``input`` (world*n)."""
        _check_tensor(output, "output")
        _check_tensor(input, "input")
        _check_pair(output, input, self.world_size, "reduce_scatter")
        return self._issue("reduce_scatter", (output, input, self._divisor(op, input.dtype)), (output, input), async_op)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False) -> Work | None:
        """``output`` (world*n elements) receives every rank's ``input`` (n elements), in rank order."""
        _check_tensor(output, "output")
        _check_tensor(input, "input")
        _check_pair(input, output, self.world_size, "all_gather")
        return self._issue("all_gather", (output, input), (output, input), async_op)

    def broadcast(self, tensor: torch.Tensor, src: int = 0, async_op: bool = False) -> Work | None:
        """Copies ``tensor`` of group rank ``src`` to every rank."""
        _check_tensor(tensor, "tensor")
        if not 0 <= src < self.world_size:
            raise ValueError(f"src={src} is not a rank of a group of size {self.world_size}")
        return self._issue("broadcast", (tensor, src), (tensor,), async_op)

    def barrier(self) -> None:
        """Returns once every rank of the group has called it."""
        self._issue("barrier", (), (), False)

    def alloc_buffer(self, numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """A zero-filled CPU tensor in shared memory; :meth:`all_reduce` of it (or of a contiguous view
        of it) reduces in place, with no copy in or out. Collective: all ranks allocate in the same order.
        """
        if numel < 0:
            raise ValueError(f"numel={numel} must be >= 0")
        engine_dtype(dtype)
        return self._backend.alloc_buffer(numel, dtype, self.barrier)

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

    def _choose_backend(self, chunk_bytes: int, allow_fallback: bool) -> Backend:
        """Collective: every rank chooses the same (see [Note: backends] in backend.py)."""
        host = ShmBackend.open(self.topology, self.rank, self.group, self.timeout, chunk_bytes, allow_fallback)
        if host is None:
            return TorchBackend(self.group)
        if self.num_hosts == 1:
            return host
        return HierarchicalBackend(host, self.group)

    # ---------------------------------------------------------------------------- execution

    def _issue(
        self, collective: str, args: tuple[Any, ...], tensors: tuple[torch.Tensor, ...], async_op: bool
    ) -> Work | None:
        """Runs the collective now or queues it (see [Note: routing]); returns its Work when ``async_op``.
        ``tensors`` are the checked tensors among ``args``, all on one device.

        [Note: the synchronous fast path] A synchronous CPU collective on one host runs on the caller's
        thread: the argument checks, this method (``all_reduce`` inlines its first branch) and one engine
        call, with the GIL released while it runs, that returns None on success and wakes no other thread
        (see [Note: two condition variables] in csrc/communicator.h). Measured per 4 KiB all-reduce in one
        process, where no peer is waited for (RESULTS.md): each Python step costs 0.1-2 µs, as much as the
        engine's copy, barrier and reduce together, so the path builds no Work and no engine object, and
        tests the device with ``is_cuda``/``is_cpu`` (``tensor.device`` builds an object).
        """
        engine = self._engine
        if engine is not None and not self._pending and not (tensors and tensors[0].is_cuda):
            native = getattr(engine, collective)(*args, blocking=not async_op)
            return Work(native, engine.raise_if_failed, keepalive=tensors) if async_op else None
        ready = CudaStaging.ready_event(tensors)
        with self._pending_lock:
            self._pending += 1
        work = Work(future=self._executor.submit(self._run_job, collective, args, ready))
        if async_op:
            return work
        work.wait()
        return None

    def _run_job(self, collective: str, args: tuple[Any, ...], ready: Any) -> Any:
        """On the job thread: the collective; returns what ``Work.wait`` runs afterwards (or None)."""
        try:
            if ready is None:
                getattr(self._backend, collective)(*args)
                return None
            return self._staging.run(collective, args, ready)
        finally:
            with self._pending_lock:
                self._pending -= 1

    def _divisor(self, op: str, dtype: torch.dtype) -> float:
        if op == "sum":
            return 1.0
        if op == "avg":
            if not dtype.is_floating_point:
                raise TypeError(f"op='avg' needs a floating-point tensor, got {dtype}; use op='sum'")
            return float(self.world_size)
        raise ValueError(f"op={op!r} is not supported; use 'sum' or 'avg'")


def _shutdown(executor: ThreadPoolExecutor, backend: Backend) -> None:
    executor.shutdown(wait=True)
    backend.close()


def _check_tensor(tensor: Any, name: str) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    engine_dtype(tensor.dtype)
    if not tensor.is_contiguous():
        raise ValueError(f"{name} must be contiguous; call .contiguous() first")
    if not (tensor.is_cpu or tensor.is_cuda):
        raise ValueError(f"{name} is on {tensor.device}; hfreduce supports cpu and cuda tensors")


def _check_pair(small: torch.Tensor, large: torch.Tensor, world: int, what: str) -> None:
    if small.dtype != large.dtype or small.device != large.device:
        raise ValueError(f"{what}: output and input must share dtype and device")
    if large.numel() != world * small.numel():
        raise ValueError(
            f"{what}: the large tensor has {large.numel()} elements, expected world_size ({world}) x "
            f"{small.numel()} = {world * small.numel()}"
        )
