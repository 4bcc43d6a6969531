"""The fp16 loss scaler of a model split across ranks: one decision to skip a step, taken by every rank alike."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

__all__ = ["agree_on_inf"]


def agree_on_inf(plugin: Any, owner: str) -> None:
    """Replaces a mixed-precision plugin's plain ``GradScaler`` by an agreeing one (Trainer and Fabric plugins).

    [Note: fp16 on a split model] ``GradScaler`` skips the optimizer step when it finds an inf/NaN in
    the gradients it unscales. Each rank here holds only a part of the gradients (a shard, a stage), so
    with a plain scaler one rank would skip while the others step, and the replicas would silently
    diverge. torch's ``ShardedGradScaler`` (what Lightning's FSDP precision uses) all-reduces the found-inf
    flag over the world before stepping; the plain scaler is replaced by one with the same settings and
    state, so a checkpoint's scaler state still loads. A custom scaler class cannot be converted safely.
    """
    scaler = getattr(plugin, "scaler", None)
    if scaler is None or isinstance(scaler, ShardedGradScaler):
        return
    if type(scaler) not in (torch.amp.GradScaler, torch.cuda.amp.GradScaler):
        raise TypeError(
            f"{owner} splits the model across ranks, so the fp16 loss scaler must agree on inf/NaN "
            f"over all of them; got {type(scaler).__name__}: pass MixedPrecision(..., scaler=torch.distributed."
            "fsdp.sharded_grad_scaler.ShardedGradScaler(...)) instead"
        )
    agreed = ShardedGradScaler(plugin.device, enabled=scaler.is_enabled(), process_group=None)
    if scaler.is_enabled():
        agreed.load_state_dict(scaler.state_dict())
    plugin.scaler = agreed
