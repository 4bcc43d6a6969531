"""The one-host backend: every collective runs in the native engine's shared memory (see csrc/)."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from lightning_haiscale.hfreduce._native import load_engine
from lightning_haiscale.hfreduce.abort import register_engine
from lightning_haiscale.hfreduce.backend import Backend
from lightning_haiscale.hfreduce.dtypes import engine_dtype
from lightning_haiscale.hfreduce.errors import (
    HFReduceAbortedError,
    HFReduceError,
    HFReduceMismatchError,
    HFReducePeerError,
    HFReduceTimeoutError,
)
from lightning_haiscale.hfreduce.segments import create_shared, shm_too_small
from lightning_haiscale.hfreduce.topology import Topology

_SPIN_ITERS = 2000  # ~50-100 µs of busy-waiting before sleeping, only when every rank has a core


@dataclass(frozen=True)
class _Buffer:
    shared: Any  # _C.SharedBuffer
    start: int
    end: int


class ShmBackend(Backend):
    """The local ranks of one host, through the engine's segment; a rank of several hosts uses one as its
    host's part of :class:`~lightning_haiscale.hfreduce.hierarchical.HierarchicalBackend`.

    [Note: engine handles] Each collective takes ``blocking``: True runs it on the calling thread (GIL
    released) once the engine's earlier work is done, and raises its error; False queues it on the engine's
    worker thread and returns the engine's ``Work``, for :meth:`raise_if_failed` once it completes.
    """

    name: ClassVar[str] = "shm"
    queues_on_engine: ClassVar[bool] = True

    def __init__(
        self,
        native: Any,
        topology: Topology,
        rank: int,
        group: dist.ProcessGroup,
        allow_fallback: bool,
        timeout_s: float,
    ) -> None:
        self.native = native
        self.timeout_s = timeout_s  # the deadline of every wait on a peer
        self.topology = topology
        self.rank = rank
        self._group = group
        self._allow_fallback = allow_fallback  # alloc_buffer: a plain tensor when /dev/shm is full
        self._buffers: list[_Buffer] = []
        kinds = load_engine().ErrorKind
        self._errors: dict[Any, type[HFReduceError]] = {
            kinds.TIMEOUT: HFReduceTimeoutError,
            kinds.PEER_DIED: HFReducePeerError,
            kinds.MISMATCH: HFReduceMismatchError,
        }

    @classmethod
    def open(
        cls,
        topology: Topology,
        rank: int,
        group: dist.ProcessGroup,
        timeout: timedelta,
        chunk_bytes: int,
        allow_fallback: bool,
    ) -> ShmBackend | None:
        """Maps the host's staging segment (collective over ``group``); None when /dev/shm is too small
        and ``allow_fallback`` (every rank then returns None)."""
        engine = load_engine()
        local_rank, local_size = topology.local_rank, topology.local_size
        segment = engine.Communicator.segment_bytes(local_size, chunk_bytes)
        free = min(p.shm_free_bytes for p in topology.peers)
        if free < 2 * segment:
            shm_too_small(
                f"hfreduce needs {2 * segment / 2**20:.1f} MiB of free shared memory per host "
                f"({segment / 2**20:.1f} MiB for the communicator's staging segment and as much again kept free "
                f"for shared buffers) but /dev/shm has {free / 2**20:.1f} MiB free",
                allow_fallback,
            )
            return None
        spin = _SPIN_ITERS if local_size <= len(os.sched_getaffinity(0)) else 0
        native = create_shared(
            lambda name, create: engine.Communicator(
                name, local_rank, local_size, create, chunk_bytes, timeout.total_seconds(), spin
            ),
            segment,
            "the communicator's staging segment",
            topology=topology,
            group=group,
            allow_fallback=allow_fallback,
        )
        if native is None:
            return None
        native.wait_attached()
        backend = cls(native, topology, rank, group, allow_fallback, timeout.total_seconds())
        register_engine(backend)
        return backend

    # --------------------------------------------------------------------------------- collectives

    def all_reduce(self, tensor: torch.Tensor, divisor: float, blocking: bool = True) -> Any:
        n, dtype, address = tensor.numel(), engine_dtype(tensor.dtype), tensor.data_ptr()
        buffer = self._find_buffer(address, n * tensor.element_size()) if self._buffers else None
        if buffer is not None:
            native = self.native.all_reduce_buffer(buffer.shared, address - buffer.start, n, dtype, divisor, blocking)
        else:
            native = self.native.all_reduce(address, address, n, dtype, divisor, blocking)
        if blocking and native is not None:  # _checked, inlined on the hot path
            self.raise_if_failed(native)
        return native

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, divisor: float, blocking: bool = True) -> Any:
        n, dtype = output.numel(), engine_dtype(input.dtype)
        return self._checked(
            self.native.reduce_scatter(input.data_ptr(), output.data_ptr(), n, dtype, divisor, blocking), blocking
        )

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, blocking: bool = True) -> Any:
        n, dtype = input.numel(), engine_dtype(input.dtype)
        return self._checked(self.native.all_gather(input.data_ptr(), output.data_ptr(), n, dtype, blocking), blocking)

    def broadcast(self, tensor: torch.Tensor, src: int, blocking: bool = True) -> Any:
        return self.broadcast_local(tensor, self.topology.local_ranks.index(src), blocking)

    def broadcast_local(self, tensor: torch.Tensor, root: int, blocking: bool = True) -> Any:
        """Broadcast from local rank ``root`` of this host."""
        native = self.native.broadcast(tensor.data_ptr(), tensor.numel(), engine_dtype(tensor.dtype), root, blocking)
        return self._checked(native, blocking)

    def barrier(self, blocking: bool = True) -> Any:
        return self._checked(self.native.barrier(blocking), blocking)

    def agree(self, call: Any) -> None:
        """Raises :class:`HFReduceMismatchError` unless every local rank announces ``call`` (a Fingerprint)."""
        self._checked(self.native.agree(call, blocking=True), True)

    # ------------------------------------------------------------------------------------- the rest

    def alloc_buffer(self, numel: int, dtype: torch.dtype, barrier: Callable[[], None]) -> torch.Tensor:
        """A zero-filled tensor in a new shared segment; :meth:`all_reduce` of it (or of a contiguous view of
        it) reduces in place, with no copy in or out. Collective: all ranks allocate in the same order."""
        local_rank, local_size = self.topology.local_rank, self.topology.local_size
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        region = max(4096, -(-nbytes // 4096) * 4096)  # what the engine maps per local rank
        shared = create_shared(
            lambda name, create: load_engine().SharedBuffer(name, nbytes, local_size, create),
            region * local_size,
            f"alloc_buffer({numel}, {dtype}) ({region / 2**20:.1f} MiB for each of {local_size} local ranks)",
            topology=self.topology,
            group=self._group,
            allow_fallback=self._allow_fallback,
        )
        if shared is None:
            return torch.zeros(numel, dtype=dtype)
        barrier()  # every local rank has mapped it
        shared.unlink()
        tensor = torch.frombuffer(shared.region(local_rank), dtype=torch.uint8)[:nbytes].view(dtype)
        self._buffers.append(_Buffer(shared, tensor.data_ptr(), tensor.data_ptr() + shared.region_bytes))
        return tensor

    def raise_if_failed(self, native: Any) -> None:
        """Raises the error of a completed engine collective, if it failed, naming group ranks."""
        if not native.failed():
            return
        kind = native.error_kind()
        if kind == load_engine().ErrorKind.ABORTED:  # its rank is a global rank, of any host
            message = f"{native.error_message()} (this is group rank {self.rank})"
            raise HFReduceAbortedError(message, native.error_ranks())
        topology = self.topology
        ranks = [topology.local_ranks[r] for r in native.error_ranks()]
        if kind == load_engine().ErrorKind.MISMATCH:
            where = f"local ranks 0..{topology.local_size - 1} are group ranks {list(topology.local_ranks)}"
        else:
            where = f"group ranks {ranks}"
        message = native.error_message() + f" ({where}; this is group rank {self.rank})"
        error = self._errors.get(kind)
        if error is None:
            raise HFReduceError(message)
        raise error(message, ranks)

    def abort(self, rank: int, reason: str) -> None:
        """Ends every local rank's waits on this engine: ``rank`` (global) failed (see ``abort.py``)."""
        self.native.abort(rank, reason)

    def aborted(self) -> tuple[int, str] | None:
        """``(global rank, reason)`` once this host's engine was aborted, else None."""
        return self.native.aborted()

    def close(self) -> None:
        self.native.stop()

    def _checked(self, native: Any, blocking: bool) -> Any:
        """A blocking engine call returns None once it succeeded, else its failed Work (see csrc/bindings.cpp)."""
        if blocking and native is not None:
            self.raise_if_failed(native)
        return native

    def _find_buffer(self, start: int, nbytes: int) -> _Buffer | None:
        end = start + nbytes
        return next((b for b in self._buffers if b.start <= start and end <= b.end), None)
