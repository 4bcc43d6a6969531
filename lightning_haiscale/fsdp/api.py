"""Configuration of :class:`FullyShardedDataParallel`: small immutable policies, as in FSDP2."""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

__all__ = ["BackwardPrefetch", "MixedPrecision", "StateDictType"]


class BackwardPrefetch(enum.Enum):
    """When a unit's backward starts the all-gather of the unit whose backward comes next."""

    BACKWARD_PRE = enum.auto()
    """Before the current unit's gradients are computed: most overlap, two units unsharded at once."""
    BACKWARD_POST = enum.auto()
    """After the current unit's gradients are computed, before they are reduce-scattered: less memory."""


class StateDictType(enum.Enum):
    """What ``FullyShardedDataParallel.state_dict()`` returns."""

    FULL = "full"
    """Every parameter whole, on rank 0 only, on the CPU; loads into the bare module with ``load_state_dict``."""
    SHARDED = "sharded"
    """Each rank's own pieces with their layout; loads on any number of ranks."""


@dataclass(frozen=True)
class MixedPrecision:
    """Dtypes of the unsharded parameters and of gradient reduction; the shards stay in their own dtype.

    Attributes:
        param_dtype: dtype of the all-gathered parameters that forward and backward compute with.
        reduce_dtype: dtype in which gradients are reduce-scattered (default: ``param_dtype``).
        cast_forward_inputs: cast floating-point inputs of the root's forward to ``param_dtype``.
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True
