"""torch.distributed's blocking collectives, each ending in ``wait_and_keep``: the library calls these, never the
blocking forms, so that no gloo worker holds the last reference to one of its works when a script ends right after
it (see [Note: the last reference to a gloo work] in ``at_exit.py``; seen with torch's blocking forms: the arrival
check's all-gather, Fabric's all-reduce).

The object collectives pickle as ``all_gather_object`` and ``broadcast_object_list`` do, with the payload on the
group's collective device (CUDA under NCCL, else the CPU). Ranks are global, as torch's ``src``.
"""

from __future__ import annotations

import pickle
from typing import Any

import torch
import torch.distributed as dist

from lightning_haiscale.hfreduce.at_exit import wait_and_keep

__all__ = ["all_gather", "all_gather_object", "all_reduce", "barrier", "broadcast", "broadcast_object"]


def all_reduce(tensor: torch.Tensor, op: Any = dist.ReduceOp.SUM, group: dist.ProcessGroup | None = None) -> None:
    wait_and_keep(dist.all_reduce(tensor, op=op, group=group, async_op=True))


def broadcast(tensor: torch.Tensor, src: int, group: dist.ProcessGroup | None = None) -> None:
    wait_and_keep(dist.broadcast(tensor, src=src, group=group, async_op=True))


def all_gather(outputs: list[torch.Tensor], tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> None:
    wait_and_keep(dist.all_gather(outputs, tensor, group=group, async_op=True))


def barrier(group: dist.ProcessGroup | None = None, device_ids: list[int] | None = None) -> None:
    wait_and_keep(dist.barrier(group=group, async_op=True, device_ids=device_ids))


def broadcast_object(obj: Any, src: int, group: dist.ProcessGroup | None = None) -> Any:
    """Global rank ``src``'s ``obj`` on every rank of ``group``; ``src`` keeps its own object."""
    device = _device(group)
    mine = dist.get_rank() == src
    payload = pickle.dumps(obj) if mine else b""
    size = torch.tensor([len(payload)], dtype=torch.int64, device=device)
    broadcast(size, src, group)
    data = _bytes_tensor(payload, int(size.item()), device)
    broadcast(data, src, group)
    return obj if mine else pickle.loads(data.cpu().numpy().tobytes())


def all_gather_object(obj: Any, group: dist.ProcessGroup | None = None) -> list[Any]:
    """Every rank's ``obj``, in the group's rank order."""
    device = _device(group)
    payload = pickle.dumps(obj)
    size = torch.tensor([len(payload)], dtype=torch.int64, device=device)
    gathered = [torch.empty_like(size) for _ in range(dist.get_world_size(group))]
    all_gather(gathered, size, group)
    sizes = [int(s.item()) for s in gathered]
    datas = [torch.empty(max(sizes), dtype=torch.uint8, device=device) for _ in sizes]
    all_gather(datas, _bytes_tensor(payload, max(sizes), device), group)
    return [pickle.loads(data[:n].cpu().numpy().tobytes()) for data, n in zip(datas, sizes, strict=True)]


def _device(group: dist.ProcessGroup | None) -> torch.device:
    if dist.get_backend(group) == dist.Backend.NCCL:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _bytes_tensor(payload: bytes, length: int, device: torch.device) -> torch.Tensor:
    """``payload`` at the start of a ``length``-byte tensor on ``device`` (zero-filled past it)."""
    data = torch.zeros(length, dtype=torch.uint8, device=device)
    if payload:
        data[: len(payload)].copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
    return data
