"""The collectives sharding needs, as free functions over the hfreduce engine (as in FSDP2).

Every function issues exactly one engine collective (none for an empty tensor on every rank), so all
ranks issue the same sequence as long as they run the same units in the same order.
"""

from __future__ import annotations

from typing import cast

import torch
import torch.distributed as dist

from lightning_haiscale.fsdp.layout import UnitLayout
from lightning_haiscale.hfreduce import Communicator, Work, kept_collectives

__all__ = ["all_gather_shards", "all_reduce_grad", "broadcast_from_first", "gather_unit", "reduce_scatter_grads"]


def all_gather_shards(comm: Communicator, full: torch.Tensor, shard: torch.Tensor, async_op: bool) -> Work | None:
    """Fills ``full`` (world x shard elements) with every rank's ``shard`` in rank order."""
    return comm.all_gather(full, shard, async_op=async_op)


def gather_unit(comm: Communicator, unit: UnitLayout, flat_shard: torch.Tensor) -> torch.Tensor:
    """A fresh unsharded flat buffer of ``unit`` holding every rank's ``flat_shard`` (parameters or an
    optimizer state laid out like them), in the shard's dtype and device."""
    full = torch.empty(unit.padded_numel, dtype=flat_shard.dtype, device=flat_shard.device)
    all_gather_shards(comm, full, flat_shard.contiguous(), async_op=False)
    return full


def reduce_scatter_grads(comm: Communicator, shard_grad: torch.Tensor, full_grad: torch.Tensor) -> Work:
    """Starts averaging ``full_grad`` across ranks into this rank's slice ``shard_grad``; returns the handle."""
    return cast(Work, comm.reduce_scatter(shard_grad, full_grad, op="avg", async_op=True))  # async: always a Work


def all_reduce_grad(comm: Communicator, grad: torch.Tensor) -> Work:
    """Starts averaging ``grad`` across ranks in place; returns the handle."""
    return cast(Work, comm.all_reduce(grad, op="avg", async_op=True))  # async: always a Work


def broadcast_from_first(tensors: list[torch.Tensor], group: dist.ProcessGroup) -> None:
    """Copies the first rank of ``group``'s ``tensors`` to every rank (``sync_module_states``), before sharding,
    through ``torch.distributed`` (the engine's groups may be smaller than ``group``)."""
    source = dist.get_global_rank(group, 0)
    with torch.no_grad():
        for tensor in tensors:
            kept_collectives.broadcast(tensor.data, source, group)
