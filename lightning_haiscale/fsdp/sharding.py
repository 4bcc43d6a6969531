"""How :class:`FullyShardedDataParallel` spreads parameters and gradients over ranks: torch FSDP's
``ShardingStrategy`` names, each a small policy (as FSDP2's dataclasses), chosen once at construction.

[Note: one machine for every strategy]
Every strategy is the same two groups: a *shard group* over which a unit's parameters are split (all-gathered
before use, gradients reduce-scattered), and a *replicate group* whose ranks hold the same shards and
all-reduce each reduced gradient shard (none when it would be one rank):

===================  ===========================  ==========================  =========================
strategy             shard group                  replicate group             parameters after forward
===================  ===========================  ==========================  =========================
FULL_SHARD           ``process_group``            none                        freed (gathered again)
SHARD_GRAD_OP        ``process_group``            none                        kept until backward ends
NO_SHARD             each rank alone              ``process_group``           kept until backward ends
HYBRID_SHARD         a host (or the mesh's dim 1) across hosts (mesh's dim 0)  freed (gathered again)
_HYBRID_SHARD_ZERO2  a host (or the mesh's dim 1) across hosts (mesh's dim 0)  kept until backward ends
===================  ===========================  ==========================  =========================

So ``NO_SHARD`` is data parallel whose gradients are all-reduced on the engine, and ``reshard_after_forward=
False`` is ``SHARD_GRAD_OP`` (or ``_HYBRID_SHARD_ZERO2``): one setting, not two.
"""

from __future__ import annotations

import enum
from typing import Any

__all__ = ["ShardingStrategy", "parse_sharding_strategy", "resolve_strategy"]


class ShardingStrategy(enum.Enum):
    """torch FSDP's sharding strategies (see [Note: one machine for every strategy])."""

    FULL_SHARD = "FULL_SHARD"
    """ZeRO-3: parameters, gradients and optimizer state split over every rank; a unit's parameters are
    gathered before its forward and again before its backward."""
    SHARD_GRAD_OP = "SHARD_GRAD_OP"
    """ZeRO-2: as FULL_SHARD, but a unit's gathered parameters stay from its forward to the end of its
    backward (one all-gather per step instead of two, more memory)."""
    NO_SHARD = "NO_SHARD"
    """Data parallel: every rank holds every parameter; gradients are all-reduced on the engine."""
    HYBRID_SHARD = "HYBRID_SHARD"
    """FULL_SHARD within each shard group (a host by default), replicated across them: gathers and
    reduce-scatters stay in a host's shared memory; only the gradient shards' all-reduce crosses hosts."""
    _HYBRID_SHARD_ZERO2 = "_HYBRID_SHARD_ZERO2"
    """HYBRID_SHARD with SHARD_GRAD_OP within each shard group."""

    @property
    def reshard_after_forward(self) -> bool:
        """Whether a unit's gathered parameters are freed after its forward."""
        return self in (ShardingStrategy.FULL_SHARD, ShardingStrategy.HYBRID_SHARD)

    @property
    def hybrid(self) -> bool:
        """Whether shards are replicated over a second group of ranks."""
        return self in (ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2)


_ZERO2 = {
    ShardingStrategy.FULL_SHARD: ShardingStrategy.SHARD_GRAD_OP,
    ShardingStrategy.HYBRID_SHARD: ShardingStrategy._HYBRID_SHARD_ZERO2,
}


def resolve_strategy(sharding_strategy: Any, reshard_after_forward: bool = True) -> ShardingStrategy:
    """The strategy named by ``sharding_strategy`` (our member, torch's ``ShardingStrategy`` member or its name,
    in any case), made ZeRO-2 by ``reshard_after_forward=False`` (see [Note: one machine for every strategy]).
    ``ValueError`` naming the choices for anything else."""
    if not isinstance(reshard_after_forward, bool):
        raise TypeError(f"reshard_after_forward={reshard_after_forward!r} must be True or False")
    strategy = parse_sharding_strategy(sharding_strategy)
    return strategy if reshard_after_forward else _ZERO2.get(strategy, strategy)


def parse_sharding_strategy(value: Any) -> ShardingStrategy:
    """``sharding_strategy`` as our member, from ours, torch's ``ShardingStrategy`` member or a name in any case: the
    one parser, which the wrapper and the Lightning strategies (at their construction) both call."""
    if isinstance(value, ShardingStrategy):
        return value
    name = value.name if isinstance(value, enum.Enum) else value
    if not isinstance(name, str):
        raise TypeError(f"sharding_strategy={value!r} must be a name such as 'FULL_SHARD' or torch's ShardingStrategy")
    if name.upper() not in ShardingStrategy.__members__:
        choices = ", ".join(repr(m.value) for m in ShardingStrategy)
        raise ValueError(
            f"sharding_strategy={value!r} must be one of {choices} (a name in any case, or a member of "
            "torch.distributed.fsdp.ShardingStrategy)"
        )
    return ShardingStrategy[name.upper()]
