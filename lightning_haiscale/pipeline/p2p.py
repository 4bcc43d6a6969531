"""Point-to-point transfer of a stage boundary: a tuple of tensors of any shapes and dtypes.

[Note: boundary protocol] An activation is one payload: the tensor itself when there is one contiguous
tensor, else every tensor's bytes packed into one ``uint8`` buffer at 16-byte aligned offsets. A
fixed-size ``int64`` header (number of tensors, then per tensor its dtype code, requires-grad flag, rank
and shape) precedes the payload of microbatch 0 of every step, so a shape that changes between steps (a
smaller last batch, a new sequence length) is always received exactly, never truncated. Within a
training step microbatches are even splits of one batch, so later microbatches reuse microbatch 0's
shapes and travel without a header (a stage whose output shapes differ between microbatches of one step
is reported by the sender). Uneven splits (evaluation, an uneven last batch) send a header with every
microbatch. A gradient message needs no header: its receiver sent the outputs whose gradients come
back; only tensors that require grad have gradients. Messages are matched by order, not by tag (NCCL
ignores tags): see [Note: communication order] in ``schedule``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from lightning_haiscale.use_counts import storage_use_count

__all__ = [
    "HEADER_SLOTS",
    "BufferPool",
    "Op",
    "TensorMeta",
    "decode_header",
    "empty_buffer",
    "encode_header",
    "exchange",
    "pack",
    "runs_concurrently",
    "unpack",
]

HEADER_SLOTS = 128
_ALIGN = 16
_DTYPES: list[torch.dtype] = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.complex64,
    torch.complex128,
]


@dataclass(frozen=True)
class TensorMeta:
    """What a receiver needs to allocate one boundary tensor."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool

    @classmethod
    def of(cls, t: torch.Tensor) -> TensorMeta:
        return cls(tuple(t.shape), t.dtype, t.requires_grad)

    @property
    def nbytes(self) -> int:
        return torch.Size(self.shape).numel() * self.dtype.itemsize


def encode_header(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The fixed-size header describing ``tensors``; raises when they do not fit in ``HEADER_SLOTS``."""
    values = [len(tensors)]
    for t in tensors:
        if t.dtype not in _DTYPES:
            raise TypeError(f"a stage boundary tensor has dtype {t.dtype}, which pipelines do not carry")
        values += [_DTYPES.index(t.dtype), int(t.requires_grad), t.dim(), *t.shape]
    if len(values) > HEADER_SLOTS:
        raise ValueError(
            f"a stage boundary of {len(tensors)} tensors needs {len(values)} header slots, more than {HEADER_SLOTS}"
        )
    return torch.tensor(values + [0] * (HEADER_SLOTS - len(values)), dtype=torch.int64)


def decode_header(header: torch.Tensor) -> list[TensorMeta]:
    values = header.tolist()
    metas, i = [], 1
    for _ in range(values[0]):
        code, grad, ndim = values[i : i + 3]
        shape = tuple(values[i + 3 : i + 3 + ndim])
        metas.append(TensorMeta(shape, _DTYPES[code], bool(grad)))
        i += 3 + ndim
    return metas


def _offsets(metas: Sequence[TensorMeta]) -> tuple[list[int], int]:
    offsets, end = [], 0
    for m in metas:
        offsets.append(end)
        end += -(-m.nbytes // _ALIGN) * _ALIGN
    return offsets, end


def pack(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """One contiguous buffer to send: the tensor itself when possible, else the packed bytes."""
    if len(tensors) == 1 and tensors[0].is_contiguous():
        return tensors[0].detach()
    metas = [TensorMeta.of(t) for t in tensors]
    offsets, total = _offsets(metas)
    buffer = torch.empty(max(total, 1), dtype=torch.uint8, device=tensors[0].device if tensors else "cpu")
    for t, m, off in zip(tensors, metas, offsets, strict=True):
        if m.nbytes:
            buffer[off : off + m.nbytes].copy_(t.detach().contiguous().reshape(-1).view(torch.uint8))
    return buffer


def empty_buffer(metas: Sequence[TensorMeta], device: torch.device) -> torch.Tensor:
    """A receive buffer for ``metas`` (the same layout ``pack`` produces)."""
    if len(metas) == 1:
        return torch.empty(metas[0].shape, dtype=metas[0].dtype, device=device)
    return torch.empty(max(_offsets(metas)[1], 1), dtype=torch.uint8, device=device)


def unpack(buffer: torch.Tensor, metas: Sequence[TensorMeta]) -> list[torch.Tensor]:
    """The tensors in a received ``buffer`` (views of it; no copy)."""
    if len(metas) == 1:
        return [buffer]
    offsets, _ = _offsets(metas)
    return [buffer[off : off + m.nbytes].view(m.dtype).view(m.shape) for m, off in zip(metas, offsets, strict=True)]


class BufferPool:
    """Receive buffers kept from one step to the next, one per message of a step (see [Note: buffer reuse]).

    [Note: buffer reuse] torch's ``PipelineStage`` allocates its receive buffers once; a fresh buffer
    per message and step costs an allocation, and page faults whenever the allocator gave the memory
    back. The pool keeps one buffer per ``key`` (a message of the step: stage, kind, microbatch) and
    hands out a new view of it (``detach()``), never the buffer itself. So every holder of the memory (a
    pending receive's work, the tensors autograd saves, a gradient ``AccumulateGrad`` takes without a
    copy, an output of the last stage that views its input, a user's reference) holds a tensor of its
    own on the buffer's storage, and torch counts those: a buffer is handed out again only when its
    storage has no holder but the pool, and has the layout asked for; otherwise the message gets a new
    buffer. A buffer is therefore never written while anything can still read it; reuse only saves the
    allocation. (torch's CUDA graph trees check a storage's count the same way before reusing memory.)
    One buffer per message keeps reuse whole: the buffers of one step are all in use at once.
    """

    def __init__(self) -> None:
        self._buffers: dict[tuple[Any, ...], tuple[torch.Tensor, int | None]] = {}

    def get(self, key: tuple[Any, ...], metas: Sequence[TensorMeta], device: torch.device) -> torch.Tensor:
        """A view of the buffer for message ``key`` laid out for ``metas`` (``empty_buffer``'s layout)."""
        kept = self._buffers.get(key)
        if kept is None or not _fits(kept[0], metas, device) or not _unheld(*kept):
            buffer = empty_buffer(metas, device)
            kept = self._buffers[key] = (buffer, storage_use_count(buffer))
        return kept[0].detach()

    def clear(self) -> None:
        """Drops every buffer (after a failed step, whose receives may still be pending)."""
        self._buffers.clear()


def _fits(buffer: torch.Tensor, metas: Sequence[TensorMeta], device: torch.device) -> bool:
    if buffer.device != device:
        return False
    if len(metas) == 1:
        return buffer.dtype == metas[0].dtype and tuple(buffer.shape) == metas[0].shape
    return buffer.dtype == torch.uint8 and buffer.numel() == max(_offsets(metas)[1], 1)


def _unheld(buffer: torch.Tensor, alone: int | None) -> bool:
    """Whether nothing but the pool's ``buffer`` uses its storage, as when it was made (``alone``: its count
    then, see :mod:`lightning_haiscale.use_counts`). Without torch's count the answer is no: every message then
    gets a fresh buffer, correct at the allocation's cost."""
    return alone is not None and storage_use_count(buffer) == alone


class _StagedWork:
    """A gloo transfer of a CUDA tensor through host memory (gloo's send/recv read host pointers only).
    ``wait()`` completes it: a received tensor is copied to the device then."""

    def __init__(self, work: dist.Work, host: torch.Tensor, device_tensor: torch.Tensor | None) -> None:
        self.work, self.host, self.device_tensor = work, host, device_tensor

    def is_completed(self) -> bool:
        return self.work.is_completed() and self.device_tensor is None

    def wait(self) -> bool:
        self.work.wait()
        if self.device_tensor is not None:
            self.device_tensor.copy_(self.host)
            self.device_tensor = None
        return True


@dataclass(frozen=True)
class Op:
    """One send (``is_send``) or receive of ``tensor`` to or from ``peer``, a rank of the group."""

    is_send: bool
    tensor: torch.Tensor
    peer: int


def runs_concurrently(group: dist.ProcessGroup | None) -> bool:
    """Whether the group's backend runs transfers concurrently, each pair matched by order per link and
    direction only (gloo), rather than one stream per rank in issue order (NCCL, and any other backend).
    A pipeline of one rank without ``torch.distributed`` transfers nothing: either order serves."""
    if not (dist.is_available() and dist.is_initialized()):
        return False
    return dist.get_backend(group) == dist.Backend.GLOO


def exchange(ops: Sequence[Op], group: dist.ProcessGroup | None) -> list[dist.Work | _StagedWork]:
    """Issues ``ops`` as one batch (one NCCL group: they progress together); returns a work per op.

    See [Note: communication order] in ``schedule``: both ends of a link issue their ops in the same order.
    """
    if not ops:
        return []
    staged = ops[0].tensor.is_cuda and dist.get_backend(group) == dist.Backend.GLOO
    wire = [_host(op.tensor, op.is_send) if staged else op.tensor for op in ops]
    p2p_ops = [
        dist.P2POp(dist.isend if op.is_send else dist.irecv, t, group=group, group_peer=op.peer)
        for op, t in zip(ops, wire, strict=True)
    ]
    works = dist.batch_isend_irecv(p2p_ops)
    if len(works) != len(ops):  # a coalescing backend (NCCL) returns one work for the whole batch
        works = [works[-1]] * len(ops)
    if not staged:
        return list(works)
    return [_StagedWork(w, t, None if op.is_send else op.tensor) for op, t, w in zip(ops, wire, works, strict=True)]


def _host(tensor: torch.Tensor, is_send: bool) -> torch.Tensor:
    return tensor.cpu() if is_send else torch.empty(tensor.shape, dtype=tensor.dtype)
