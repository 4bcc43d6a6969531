"""Where each rank sits among the pipeline, shard and replicate dimensions: the one rank layout that the
pipelines' subgroups, hybrid sharding's groups and the pipeline strategies all read (torchtitan's
``ParallelDims`` plays this part there).

[Note: rank order]
A world of ``replicate_size x shard_size x pp_size`` ranks, the pipeline dimension innermost:
``rank = (replicate * shard_size + shard) * pp_size + stage``. So a pipeline is ``pp_size`` consecutive ranks
(stage-to-stage traffic stays on one host when a host holds whole pipelines), the data-parallel group of a
stage is every ``pp_size``-th rank from it, and with hosts of ``shard_size x pp_size`` ranks hybrid sharding
shards within a host and replicates across hosts: the layout of haiscale's ``make_subgroups`` and of torch
FSDP's default hybrid groups, composed.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import NamedTuple

import torch.distributed as dist

__all__ = ["RankGroups", "RankLayout"]


class RankGroups(NamedTuple):
    """This rank's process groups of a :class:`RankLayout`. ``shard`` and ``replicate`` are ``None`` without a
    replicate dimension (``replicate_size=1``): the data-parallel group is then the shard group."""

    pipeline: dist.ProcessGroup
    data_parallel: dist.ProcessGroup
    shard: dist.ProcessGroup | None
    replicate: dist.ProcessGroup | None


@dataclass(frozen=True)
class RankLayout:
    """``world_size`` ranks as ``replicate_size x shard_size x pp_size`` (see [Note: rank order]).

    ``dp_size = world_size / pp_size`` pipelines train data parallel; their data-parallel dimension is
    ``replicate_size`` groups of ``shard_size`` ranks (``replicate_size=1``: one group, plain data parallel or
    full sharding over it).
    """

    world_size: int
    pp_size: int = 1
    replicate_size: int = 1

    def __post_init__(self) -> None:
        for name in ("world_size", "pp_size", "replicate_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive int")
        if self.world_size % self.pp_size:
            raise ValueError(
                f"pp_size={self.pp_size} must divide the world size {self.world_size}: the world trains "
                "world_size / pp_size pipelines of pp_size stages"
            )
        if self.dp_size % self.replicate_size:
            raise ValueError(
                f"replicate_size={self.replicate_size} must divide the data-parallel size {self.dp_size} "
                f"(world size {self.world_size} / pp_size {self.pp_size})"
            )

    @property
    def dp_size(self) -> int:
        """Pipelines that train data parallel (every rank when ``pp_size=1``)."""
        return self.world_size // self.pp_size

    @property
    def shard_size(self) -> int:
        """Ranks a stage's state is sharded over."""
        return self.dp_size // self.replicate_size

    def stage(self, rank: int) -> int:
        """``rank``'s stage in its pipeline."""
        return self._check(rank) % self.pp_size

    def dp_rank(self, rank: int) -> int:
        """``rank``'s pipeline: its rank in its data-parallel group."""
        return self._check(rank) // self.pp_size

    def pipelines(self) -> list[list[int]]:
        """Every pipeline's ranks, stage 0 first."""
        pp = self.pp_size
        return [list(range(i * pp, (i + 1) * pp)) for i in range(self.dp_size)]

    def data_parallel_groups(self) -> list[list[int]]:
        """Every stage's data-parallel ranks, one per pipeline."""
        return [list(range(s, self.world_size, self.pp_size)) for s in range(self.pp_size)]

    def shard_groups(self) -> list[list[int]]:
        """Every group a stage's state is sharded over: per stage, ``replicate_size`` groups of ``shard_size``."""
        shard, pp = self.shard_size, self.pp_size
        return [[(r * shard + k) * pp + s for k in range(shard)] for s in range(pp) for r in range(self.replicate_size)]

    def replicate_groups(self) -> list[list[int]]:
        """Every group holding the same shard: per stage, ``shard_size`` groups of ``replicate_size``."""
        shard, pp = self.shard_size, self.pp_size
        return [[(r * shard + k) * pp + s for r in range(self.replicate_size)] for s in range(pp) for k in range(shard)]

    def groups(self, timeout: timedelta | None = None) -> RankGroups:
        """This rank's process groups, each bounded by ``timeout``. Collective: every rank calls it, with the
        same layout (the groups are made in one order on every rank)."""
        if not dist.is_initialized():
            raise RuntimeError("RankLayout.groups needs torch.distributed initialized (dist.init_process_group)")
        if dist.get_world_size() != self.world_size:
            raise ValueError(
                f"RankLayout(world_size={self.world_size}) but torch.distributed's world has "
                f"{dist.get_world_size()} ranks"
            )
        pipeline, _ = dist.new_subgroups_by_enumeration(self.pipelines(), timeout=timeout)
        data_parallel, _ = dist.new_subgroups_by_enumeration(self.data_parallel_groups(), timeout=timeout)
        if self.replicate_size == 1:
            return RankGroups(pipeline, data_parallel, None, None)
        shard, _ = dist.new_subgroups_by_enumeration(self.shard_groups(), timeout=timeout)
        replicate, _ = dist.new_subgroups_by_enumeration(self.replicate_groups(), timeout=timeout)
        return RankGroups(pipeline, data_parallel, shard, replicate)

    def _check(self, rank: int) -> int:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank={rank} is outside the layout's world of {self.world_size} ranks")
        return rank
