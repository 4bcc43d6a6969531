"""The collectives Lightning asks of a strategy (``barrier``, ``broadcast``, ``reduce``/``all_reduce``,
``all_gather``), with Lightning's semantics, for every strategy of both faces.

Why not Lightning's own: they run torch's blocking collectives, which drop their work on return while gloo's
worker may still hold it; the worker's reference is then the last, and when the script ends right after (a Fabric
script whose last line is ``fabric.all_reduce(...)``), the worker frees the work's tensors while the interpreter
finalizes and the process aborts (seen: 5 runs in 119 of ``tests/exits/exit_job.py fabric``, loaded, every core
showing ``~AsyncAllreduceWork`` in ``ProcessGroupGloo::runLoop``; see [Note: the last reference to a gloo work] in
``hfreduce/at_exit.py``). Here each runs through ``hfreduce.kept_collectives``, which keeps its works.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.utilities.distributed import _all_gather_ddp_if_available
from lightning.fabric.utilities.types import ReduceOp

from lightning_haiscale.hfreduce import kept_collectives

__all__ = ["ExitSafeCollectives"]


def _initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


class ExitSafeCollectives:
    """A strategy's collectives over the world (or ``group``) whose works outlive the call (see the module).

    Mixed in before Lightning's strategy class, for the Trainer's strategies and Fabric's alike: ``reduce`` is the
    Trainer's name, ``all_reduce`` Fabric's. The host class provides ``root_device``.
    """

    root_device: torch.device

    def barrier(self, *args: Any, **kwargs: Any) -> None:
        if not _initialized():
            return
        nccl = dist.get_backend() == dist.Backend.NCCL  # NCCL must know the device, or it guesses GPU 0
        kept_collectives.barrier(device_ids=[self.root_device.index] if nccl else None)

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """``obj`` of global rank ``src``, pickled as ``broadcast_object_list`` does; ``src`` keeps its own."""
        return kept_collectives.broadcast_object(obj, src) if _initialized() else obj

    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean") -> Any:
        """In place, as Lightning's: ``"mean"``/``"avg"`` divide the sum by the group's size where the backend has
        no average (gloo); anything but a tensor is returned as is."""
        if not (isinstance(tensor, torch.Tensor) and _initialized()):
            return tensor
        group = dist.group.WORLD if group is None else group
        op, divide = _reduce_op(reduce_op, group)
        kept_collectives.all_reduce(tensor, op, group)
        if not divide:
            return tensor
        size = dist.get_world_size(group)
        return tensor.div_(size) if torch.is_floating_point(tensor) else tensor.copy_(tensor / size)

    all_reduce = reduce

    def all_gather(self, tensor: torch.Tensor, group: Any | None = None, sync_grads: bool = False) -> torch.Tensor:
        """Every rank's ``tensor`` (one shape on all), stacked on a new first dimension in rank order; with
        ``sync_grads``, Lightning's differentiable gather."""
        if sync_grads or not _initialized():
            return _all_gather_ddp_if_available(tensor, group=group, sync_grads=sync_grads)
        group = dist.group.WORLD if group is None else group
        tensor = tensor.contiguous()
        gathered = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
        kept_collectives.all_gather(gathered, tensor, group)
        return torch.stack(gathered)


def _reduce_op(reduce_op: ReduceOp | str | None, group: Any) -> tuple[Any, bool]:
    """torch's op for Lightning's ``reduce_op``, and whether the sum is to be divided (an average on gloo)."""
    if not isinstance(reduce_op, str):
        return (dist.ReduceOp.SUM if reduce_op is None else reduce_op), False
    name = "avg" if reduce_op.lower() == "mean" else reduce_op.lower()
    if name == "avg" and dist.get_backend(group) == dist.Backend.GLOO:
        return dist.ReduceOp.SUM, True
    return getattr(dist.ReduceOp, name.upper()), False
