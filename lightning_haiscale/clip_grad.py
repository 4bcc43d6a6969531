"""``clip_grad_norm_`` for a model whose parameters are split across ranks (FSDP shards, pipeline stages).

torch's ``clip_grad_norm_`` on one rank sees only that rank's part, so each part would be clipped by its
own norm. Here every rank's norm is combined over the group first (sum of p-th powers, or max for the
infinity norm), so each rank scales by the factor one process would use on the whole model.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist

from lightning_haiscale.hfreduce import kept_collectives

__all__ = ["clip_grad_norm_"]


def clip_grad_norm_(
    parameters: Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    process_group: dist.ProcessGroup | Sequence[dist.ProcessGroup] | None = None,
) -> torch.Tensor:
    """Scales the gradients so that their norm over every rank of ``process_group`` is at most ``max_norm``.

    Each rank passes its own, disjoint parameters (possibly none: a pipeline stage of activations only);
    every rank of the group must call it (a collective). Ranks that hold the same parameters (data-parallel
    replicas, after their gradient all-reduce) belong in different groups. Several groups combine in turn: a
    sharded pipeline stage passes ``(its shard group, its pipeline's group)``, the stage's norm, then the
    pipeline's. Returns the total norm (float32, or float64 for float64 gradients as torch's ``clip_grad_norm_``
    keeps it; on the parameters' device).
    """
    groups = list(process_group) if isinstance(process_group, Sequence) else [process_group]
    params = list(parameters)
    norm_type = float(norm_type)
    grads = [p.grad for p in params if p.grad is not None]
    device = params[0].device if params else _collective_device(groups[0])
    local = torch.nn.utils.get_total_norm(grads, norm_type) if grads else torch.zeros((), device=device)
    dtype = torch.promote_types(local.dtype, torch.float32)  # a float64 model's norm is not rounded to float32
    if norm_type == math.inf:
        total = local.to(dtype).reshape(1)
        for group in groups:
            kept_collectives.all_reduce(total, dist.ReduceOp.MAX, group)
    else:
        total = local.double().pow(norm_type).reshape(1)  # fp64: p-th powers of large norms stay finite
        for group in groups:
            kept_collectives.all_reduce(total, dist.ReduceOp.SUM, group)
        total = total.pow(1.0 / norm_type).to(dtype)
    total = total.reshape(())
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total


def _collective_device(group: dist.ProcessGroup | None) -> torch.device:
    """Where a rank without parameters puts its share: NCCL reduces CUDA tensors only."""
    if dist.get_backend(group) == dist.Backend.NCCL:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
