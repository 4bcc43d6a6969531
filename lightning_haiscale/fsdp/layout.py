"""The public face of a :class:`FullyShardedDataParallel`'s sharding: which units it has and, per unit, each
original parameter's names, shape and the slice of it this rank holds (see param_group [Note: flat layout]).

Checkpoint code (``state_dict``, ``optim_state``, ``dcp``) reads this and the flat shards it describes, never
the wrapper's private state. A :class:`ShardLayout` is immutable data: the wrapper builds it once, when it
shards the module.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "SHARDED_FORMAT",
    "ParamSlice",
    "ShardLayout",
    "UnitLayout",
    "check_format",
    "check_matched",
    "copy_overlap",
    "to_cpu",
]

SHARDED_FORMAT = "lightning_haiscale.fsdp.sharded/1"


@dataclass(frozen=True)
class ParamSlice:
    """An original parameter and the piece of it (elements ``[start, end)`` of the flattened parameter) that
    this rank holds at ``shard_offset`` of its unit's flat shard. The piece may be empty (``start == end``).

    Attributes:
        names: its keys in the root module's ``state_dict()`` (several for a shared parameter; the first is the
            key of the optimizer state and of the sharded state dict). They are not always its attribute paths
            (see names [Note: state-dict keys are not parameter names]).
        shape: its original shape.
        start: first element of the flattened parameter in this rank's piece.
        end: one past the last element in this rank's piece.
        shard_offset: where the piece starts in the unit's flat shard.
    """

    names: tuple[str, ...]
    shape: torch.Size
    start: int
    end: int
    shard_offset: int

    @property
    def name(self) -> str:
        return self.names[0]

    @property
    def numel(self) -> int:
        """Elements of the whole parameter."""
        return math.prod(self.shape)


@dataclass(frozen=True)
class UnitLayout:
    """One sharded unit: its parameters in flat order, and the size of each rank's flat shard."""

    params: tuple[ParamSlice, ...]
    shard_numel: int
    world_size: int

    @property
    def padded_numel(self) -> int:
        """Elements of the unsharded flat buffer (every rank's shard, in rank order)."""
        return self.shard_numel * self.world_size

    def piece(self, param: ParamSlice, flat_shard: torch.Tensor) -> torch.Tensor:
        """``param``'s piece as a view of a flat shard of this unit (the parameters', or an optimizer state's)."""
        return flat_shard[param.shard_offset : param.shard_offset + param.end - param.start]

    def full_views(self, full: torch.Tensor) -> list[torch.Tensor]:
        """Every parameter as a view, in its original shape, of an unsharded flat buffer of this unit."""
        sizes = [p.numel for p in self.params]
        pad = self.padded_numel - sum(sizes)
        views = torch.split(full, sizes + ([pad] if pad else []))
        return [view.view(p.shape) for view, p in zip(views, self.params, strict=False)]


@dataclass(frozen=True)
class ShardLayout:
    """How a wrapped module is sharded on this rank.

    Attributes:
        units: the units in module order (the root's first, when it owns parameters).
        rank: this rank in the sharding group.
        world_size: ranks in the sharding group.
        keys: the bare module's ``state_dict()`` keys, in order (parameters and buffers).
    """

    units: tuple[UnitLayout, ...]
    rank: int
    world_size: int
    keys: tuple[str, ...]

    def params(self) -> Iterator[tuple[UnitLayout, ParamSlice]]:
        """Every original parameter (once, even when shared) with its unit."""
        for unit in self.units:
            for param in unit.params:
                yield unit, param


def check_matched(layout: ShardLayout, buffer_keys: Iterable[str], call: str) -> None:
    """``KeyError`` naming the keys unless every state-dict key of ``layout`` is a parameter or a buffer, and
    every parameter has a state-dict key: a checkpoint must neither drop a shard nor hold a key that fills none
    (see names [Note: state-dict keys are not parameter names])."""
    keys = set(layout.keys)
    covered = set(buffer_keys) | {name for _, param in layout.params() for name in param.names}
    no_tensor = [k for k in layout.keys if k not in covered]
    no_key = [param.name for _, param in layout.params() if not keys.intersection(param.names)]
    if no_tensor or no_key:
        raise KeyError(
            f"{call}: state-dict keys {no_tensor} match no shard or buffer, and parameters {no_key} have no "
            "state-dict key: a state_dict() hook of the module drops or renames them; remove it or save the keys"
        )


def to_cpu(tensor: torch.Tensor) -> torch.Tensor:
    """A CPU copy that owns its memory: one copy, never a second "offload" copy of a CPU tensor."""
    tensor = tensor.detach()
    return tensor.clone() if tensor.device.type == "cpu" else tensor.cpu()


def copy_overlap(dst: torch.Tensor, dst_start: int, src: torch.Tensor, src_start: int) -> int:
    """Copies the common elements of two pieces of one flattened tensor; returns how many."""
    lo = max(dst_start, src_start)
    hi = min(dst_start + dst.numel(), src_start + src.numel())
    if hi <= lo:
        return 0
    dst[lo - dst_start : hi - dst_start].copy_(src.reshape(-1)[lo - src_start : hi - src_start])
    return hi - lo


def check_format(shard: Mapping[str, Any]) -> None:
    """``ValueError`` unless ``shard`` is a sharded state dict of this package (see state_dict [Note: sharded
    format])."""
    if shard.get("format") != SHARDED_FORMAT:
        found = shard.get("format")
        raise ValueError(f"not a hai_fsdp sharded state dict (format {found!r}, expected {SHARDED_FORMAT!r})")
