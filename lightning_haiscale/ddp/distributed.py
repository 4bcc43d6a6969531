"""``DistributedDataParallel``: a drop-in for torch's, whose gradients are averaged by the hfreduce engine."""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Iterable
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_haiscale.ddp.reducer import Reducer
from lightning_haiscale.hfreduce import Communicator, kept_collectives, supports_dtype

__all__ = ["DistributedDataParallel"]


class DistributedDataParallel(nn.Module):
    """Data parallel over ``process_group``: same model on every rank, gradients averaged in backward.

    At wrap, parameters and buffers are copied from rank 0 to every rank. In backward, gradients are
    grouped in buckets (reverse registration order, ``bucket_cap_mb`` each); a bucket's averaging
    all-reduce starts on the engine's thread as soon as all its gradients are ready, and ``backward()``
    returns once every bucket is reduced. On CPU a gradient of at least 1 MiB is reduced where autograd put
    it, smaller ones are packed in shared-memory buckets (see ``lightning_haiscale.ddp.reducer``).

    Args:
        module: the model, already on its device.
        device_ids: as torch's: ``None`` for a CPU (or multi-device) module, else ``[device]``, the one CUDA
            device the module lives on (an index or a ``torch.device``); inputs are then moved to it in forward.
        process_group: the group to average over (default: the world).
        bucket_cap_mb: the most MiB of gradients in one bucket.
        find_unused_parameters: allow parameters that get no gradient in some backward.
        broadcast_buffers: copy rank 0's buffers (e.g. BatchNorm statistics) to every rank before a forward,
            as torch does: unless the previous forward ran without gradients or inside ``no_sync()``.
        communicator: an existing engine to use (its group and ``timeout``); default a new one over
            ``process_group`` with the engine's default deadline.

    :meth:`close` (or haiscale's ``reducer.stop()``) stops the engine when training is over (it also stops when
    the wrapper is garbage-collected). ``state_dict()`` and ``load_state_dict()`` are torch DDP's: keys carry the
    ``module.`` prefix, so a checkpoint saved from either wrapper loads into the other, and
    ``consume_prefix_in_state_dict_if_present(state, "module.")`` or ``ddp.module.state_dict()`` gives the
    bare module's (what haiscale's scripts save: ``model.module.module.state_dict()`` for a pipeline stage).
    """

    def __init__(
        self,
        module: nn.Module,
        device_ids: list[int | torch.device] | None = None,
        process_group: dist.ProcessGroup | None = None,
        bucket_cap_mb: float = 25,
        find_unused_parameters: bool = False,
        broadcast_buffers: bool = True,
        *,
        communicator: Communicator | None = None,
    ) -> None:
        super().__init__()
        _check_arguments(module, device_ids, bucket_cap_mb)
        self.module = module
        self.device_ids = device_ids
        self._input_device = _cuda_device(device_ids[0]) if device_ids else None
        self._sync_buffers_next = True  # torch's require_forward_param_sync
        self.process_group = process_group
        self.broadcast_buffers = broadcast_buffers
        self.find_unused_parameters = find_unused_parameters
        comm = communicator if communicator is not None else Communicator(process_group)
        _check_same_model(module, comm.group)
        with torch.no_grad():
            _broadcast_coalesced(comm, [*module.parameters(), *module.buffers()])
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self.reducer = Reducer(
            [p for _, p in named],
            comm,
            [n for n, _ in named],
            bucket_cap_bytes=int(bucket_cap_mb * 2**20),
            find_unused_parameters=find_unused_parameters,
        )

    @property
    def require_backward_grad_sync(self) -> bool:
        """False inside :meth:`no_sync` (torch DDP's attribute)."""
        return self.reducer.require_backward_grad_sync

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.broadcast_buffers and self._sync_buffers_next and self.reducer.comm.world_size > 1:
            buffers = list(self.module.buffers())
            if buffers:
                with torch.no_grad():
                    _broadcast_buffers(self.reducer.comm, buffers)
        self._sync_buffers_next = torch.is_grad_enabled() and self.require_backward_grad_sync
        if self._input_device is not None:
            args, kwargs = _to_device((args, kwargs), self._input_device)
        return self.module(*args, **kwargs)

    def no_sync(self) -> AbstractContextManager[None]:
        """Backwards inside this block accumulate gradients locally; the first backward after it averages
        (the reducer's ``no_sync``; see ``lightning_haiscale.grad_sync``)."""
        return self.reducer.no_sync()

    def close(self) -> None:
        """Stops the communication engine and removes the gradient hooks, when training is over. Idempotent.

        Backwards after it no longer average gradients. ``reducer.stop()`` (haiscale's spelling) does the same.
        """
        self.reducer.stop()


def _check_arguments(module: nn.Module, device_ids: list[Any] | None, bucket_cap_mb: float) -> None:
    if not dist.is_initialized():
        raise RuntimeError("DistributedDataParallel: call torch.distributed.init_process_group() first")
    if bucket_cap_mb <= 0:
        raise ValueError(f"bucket_cap_mb={bucket_cap_mb} must be positive")
    if device_ids is not None:
        _check_device_ids(module, device_ids)
    sparse = [name for name, m in module.named_modules() if getattr(m, "sparse", False) is True]
    if sparse:
        raise ValueError(f"modules {sparse} have sparse gradients, which hai_ddp does not support; use sparse=False")


def _check_device_ids(module: nn.Module, device_ids: list[Any]) -> None:
    """torch's rule: ``device_ids`` names the one CUDA device a single-device module lives on."""
    if len(device_ids) != 1:
        raise ValueError(f"device_ids={device_ids}: one device per process; pass device_ids=[local_rank]")
    device = _cuda_device(device_ids[0])
    found = {t.device for t in (*module.parameters(), *module.buffers())}
    if found and found != {device}:
        raise ValueError(
            f"device_ids={device_ids} names {device}, but the module is on {sorted(map(str, found))}: move it there "
            "first (module.to(device)), or pass device_ids=None for a CPU or multi-device module"
        )


def _cuda_device(device: int | str | torch.device) -> torch.device:
    device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    if device.type != "cuda" or device.index is None:
        raise ValueError(f"device_ids entries are CUDA device indices (or cuda:<i> devices), got {device}")
    return device


def _to_device(value: Any, device: torch.device) -> Any:
    """``value`` with every tensor in it (through tuples, lists and dicts) moved to ``device``."""
    if torch.is_tensor(value):
        return value.to(device, non_blocking=True)
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a namedtuple
        return type(value)(*(_to_device(v, device) for v in value))
    if isinstance(value, (tuple, list)):
        return type(value)(_to_device(v, device) for v in value)
    if isinstance(value, dict):
        return type(value)((k, _to_device(v, device)) for k, v in value.items())
    return value


def _broadcast_buffers(comm: Communicator, buffers: list[torch.Tensor]) -> None:
    """Copies rank 0's buffers to every rank: one broadcast per device, whatever their dtypes.

    [Note: buffer broadcast] Every buffer's bytes are packed (8-byte aligned) into one int64 tensor. CPU
    buffers go through the engine (a few microseconds); CUDA buffers through the process group (NCCL copies
    on the device, queued on the stream without stopping the host), not the engine's staging, which would
    make the host wait for the GPU before every forward.
    """
    by_device: OrderedDict[torch.device, list[torch.Tensor]] = OrderedDict()
    for t in buffers:
        by_device.setdefault(t.device, []).append(t)
    for device, group in by_device.items():
        sizes = [t.numel() * t.element_size() for t in group]
        padded = [-(-n // 8) * 8 for n in sizes]
        starts = [0, *itertools.accumulate(padded)]
        flat = torch.zeros(starts[-1], dtype=torch.uint8, device=device)
        for t, start, n in zip(group, starts, sizes, strict=False):
            flat[start : start + n].copy_(t.detach().reshape(-1).view(torch.uint8))
        words = flat.view(torch.int64)
        if device.type == "cuda":
            kept_collectives.broadcast(words, dist.get_global_rank(comm.group, 0), comm.group)
        else:
            comm.broadcast(words, src=0)
        if comm.rank != 0:
            for t, start, n in zip(group, starts, sizes, strict=False):
                # [Note: buffer versions] write through .data, as torch's C++ broadcast writes below autograd:
                # a buffer saved for backward by an earlier forward (BatchNorm's running statistics when a
                # pipeline runs several microbatches' forwards before their backwards, or two forwards before
                # one backward) keeps its version, so that backward does not fail as "modified by an inplace
                # operation"
                t.data.copy_(flat[start : start + n].view(t.dtype).view_as(t))


def _check_same_model(module: nn.Module, process_group: dist.ProcessGroup) -> None:
    """Every rank must wrap the same parameters and buffers (names, shapes, dtypes), as torch DDP checks:
    otherwise rank 0's values would be copied into differently shaped tensors and training would go on,
    wrong. Collective; every rank raises the same error."""
    mine = [(n, tuple(t.shape), t.dtype) for n, t in (*module.named_parameters(), *module.named_buffers())]
    world = dist.get_world_size(process_group)
    every = kept_collectives.all_gather_object(mine, process_group)
    for rank in range(1, world):
        theirs = every[rank]
        if theirs == every[0]:
            continue
        for (name0, shape0, dtype0), (name, shape, dtype) in zip(every[0], theirs, strict=False):
            if (name0, shape0, dtype0) != (name, shape, dtype):
                raise ValueError(
                    f"DistributedDataParallel expects the same model on every rank, but {name0!r} is "
                    f"{list(shape0)} {dtype0} on rank 0 and rank {rank} has {name!r} {list(shape)} {dtype}"
                )
        raise ValueError(
            f"DistributedDataParallel expects the same model on every rank, but rank 0 has {len(every[0])} "
            f"parameters and buffers and rank {rank} has {len(theirs)}"
        )


def _broadcast_coalesced(comm: Communicator, tensors: Iterable[torch.Tensor]) -> None:
    """Copies rank 0's ``tensors`` to every rank: one broadcast per (dtype, device)."""
    groups: OrderedDict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = OrderedDict()
    for t in tensors:
        groups.setdefault((t.dtype, t.device), []).append(t)
    for (dtype, _), group in groups.items():
        flat = torch.cat([t.detach().reshape(-1) for t in group])
        if supports_dtype(dtype):
            comm.broadcast(flat, src=0)
        else:  # e.g. bool buffers: rare and small, torch.distributed is fine
            kept_collectives.broadcast(flat, dist.get_global_rank(comm.group, 0), comm.group)
        if comm.rank == 0:
            continue
        offset = 0
        for t in group:
            t.copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()
