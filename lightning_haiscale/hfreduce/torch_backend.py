"""The fallback backend: plain ``torch.distributed`` collectives, when /dev/shm cannot hold the engine."""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.distributed as dist

from lightning_haiscale.hfreduce import kept_collectives
from lightning_haiscale.hfreduce.at_exit import wait_and_keep
from lightning_haiscale.hfreduce.backend import Backend

# torch 2.13 renamed the tensor collectives (the old names warn); older torch has only the old names.
reduce_scatter_tensor = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
all_gather_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def global_rank(group: dist.ProcessGroup, group_rank: int) -> int:
    return dist.get_global_rank(group, group_rank) if group is not dist.group.WORLD else group_rank


class TorchBackend(Backend):
    """``torch.distributed`` over the communicator's group (any device torch's backend takes)."""

    name: ClassVar[str] = "torch.distributed"
    reads_device_tensors: ClassVar[bool] = True

    def __init__(self, group: dist.ProcessGroup) -> None:
        self._group = group

    def all_reduce(self, tensor: torch.Tensor, divisor: float) -> None:
        flat = tensor.view(-1)
        kept_collectives.all_reduce(flat, group=self._group)
        if divisor != 1.0:
            flat.div_(divisor)

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, divisor: float) -> None:
        wait_and_keep(reduce_scatter_tensor(output, input, group=self._group, async_op=True))
        if divisor != 1.0:
            output.div_(divisor)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor) -> None:
        wait_and_keep(all_gather_tensor(output, input, group=self._group, async_op=True))

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        kept_collectives.broadcast(tensor, global_rank(self._group, src), self._group)

    def barrier(self) -> None:
        kept_collectives.barrier(self._group)

    def close(self) -> None:
        """Nothing to stop: the group is the caller's."""
