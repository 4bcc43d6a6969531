"""The shard and replicate process groups of a sharding strategy (see sharding [Note: one machine for every
strategy]), from a torch 2-D ``DeviceMesh``, a ``(replicate, shard)`` shape, torch FSDP1's ``(shard_group,
replicate_group)`` pair, or, by default, the hosts hfreduce discovers: shard within a host, replicate across.

[Note: hybrid groups by default]
Without a mesh, ``HYBRID_SHARD`` shards over each host's ranks and replicates over the ranks with the same
local index on every host, as torch FSDP does: every step's all-gather and reduce-scatter run in one host's
shared memory, and only the all-reduce of each rank's gradient shard crosses hosts (``HFREDUCE_NODE_ID``
simulates hosts). A ``(R, S)`` shape or mesh groups consecutive ranks (``RankLayout``'s [Note: rank
order]): shard group ``i`` is ranks ``[i*S, (i+1)*S)``, replicate group ``j`` is ranks ``j, j+S, ...``: with
``S`` ranks per host that is the default again.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from lightning_haiscale.fsdp.sharding import ShardingStrategy
from lightning_haiscale.hfreduce.topology import Topology
from lightning_haiscale.rank_layout import RankLayout

__all__ = ["ShardGroups", "check_device_mesh", "hybrid_groups", "strategy_groups"]

ShardGroups = tuple[dist.ProcessGroup, dist.ProcessGroup | None, dist.ProcessGroup]
"""(shard group, replicate group or None for one rank, the whole group of every rank of the model)."""

_CACHE: dict[tuple[Any, ...], tuple[dist.ProcessGroup, dist.ProcessGroup]] = {}  # one rendezvous per layout


def check_device_mesh(strategy: ShardingStrategy, device_mesh: Any) -> DeviceMesh | tuple[int, int] | None:
    """``device_mesh`` checked against ``strategy`` before any collective: ``None``, or for the hybrid strategies a
    2-D ``DeviceMesh`` or a ``(replicate, shard)`` shape (whose size the groups check against the world). The one
    check, which the wrapper and the Lightning strategies (at their construction) both call."""
    if device_mesh is None:
        return None
    if not strategy.hybrid:
        raise ValueError(
            f"device_mesh={device_mesh!r} describes hybrid sharding (replicate, shard) but sharding_strategy="
            f"{strategy.value!r}; pass sharding_strategy='HYBRID_SHARD' (or '_HYBRID_SHARD_ZERO2'), or leave "
            "device_mesh out"
        )
    if isinstance(device_mesh, DeviceMesh):
        if device_mesh.ndim != 2:
            raise ValueError(
                f"device_mesh has {device_mesh.ndim} dimensions; hybrid sharding needs a 2-D mesh (replicate, shard)"
            )
        return device_mesh
    ok = isinstance(device_mesh, Sequence) and not isinstance(device_mesh, str) and len(device_mesh) == 2
    if not (ok and all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in device_mesh)):
        raise TypeError(
            f"device_mesh={device_mesh!r} must be a (replicate, shard) tuple of two positive ints or a 2-D torch "
            "DeviceMesh"
        )
    return device_mesh[0], device_mesh[1]


def hybrid_groups(
    device_mesh: DeviceMesh | tuple[int, int] | None = None, group: dist.ProcessGroup | None = None
) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """This rank's (shard group, replicate group) of hybrid sharding over ``group`` (default the world), from a
    2-D ``DeviceMesh`` (dims: replicate, shard), a ``(replicate, shard)`` shape, or ``None``: the hosts (see
    [Note: hybrid groups by default]). Collective over ``group`` (except for a mesh, whose groups exist)."""
    device_mesh = check_device_mesh(ShardingStrategy.HYBRID_SHARD, device_mesh)
    if isinstance(device_mesh, DeviceMesh):
        return device_mesh.get_group(1), device_mesh.get_group(0)
    group = group if group is not None else dist.group.WORLD
    ranks = dist.get_process_group_ranks(group)
    if device_mesh is None:
        shard_lists = _hosts(group, ranks)
    else:
        layout = RankLayout(len(ranks), replicate_size=_shape(device_mesh, len(ranks))[0])
        shard_lists = [[ranks[r] for r in shard] for shard in layout.shard_groups()]
    return _groups(shard_lists)


def strategy_groups(
    strategy: ShardingStrategy,
    process_group: dist.ProcessGroup | tuple[dist.ProcessGroup, dist.ProcessGroup] | None,
    device_mesh: DeviceMesh | tuple[int, int] | None,
) -> ShardGroups:
    """The groups of ``strategy`` (see sharding [Note: one machine for every strategy]). Checks its arguments
    before any collective."""
    pair = isinstance(process_group, tuple)
    if not strategy.hybrid and pair:
        raise ValueError(
            f"process_group=(shard_group, replicate_group) describes hybrid sharding but sharding_strategy="
            f"{strategy.value}; pass sharding_strategy='HYBRID_SHARD' (or '_HYBRID_SHARD_ZERO2'), or leave it out"
        )
    device_mesh = check_device_mesh(strategy, device_mesh)
    if pair:
        if device_mesh is not None:
            raise ValueError("pass either process_group=(shard_group, replicate_group) or device_mesh, not both")
        shard, replicate = _pair(process_group)
        return shard, _more_than_one(replicate), _whole(shard, replicate)
    base = process_group if process_group is not None else dist.group.WORLD
    if strategy is ShardingStrategy.NO_SHARD:
        alone, _ = _groups([[r] for r in dist.get_process_group_ranks(base)])
        return alone, _more_than_one(base), base
    if not strategy.hybrid:
        return base, None, base
    shard, replicate = hybrid_groups(device_mesh, base)
    whole = base if process_group is not None or not isinstance(device_mesh, DeviceMesh) else _whole(shard, replicate)
    return shard, _more_than_one(replicate), whole


def _shape(device_mesh: tuple[int, int], world: int) -> tuple[int, int]:
    replicate, shard = device_mesh
    if replicate * shard != world:
        raise ValueError(
            f"device_mesh=({replicate}, {shard}) covers {replicate * shard} ranks but the group has {world}; "
            f"pass (replicate, shard) with replicate * shard == {world}"
        )
    return replicate, shard


def _hosts(group: dist.ProcessGroup, ranks: list[int]) -> list[list[int]]:
    """Each host's global ranks (see [Note: hybrid groups by default]). Collective over ``group``."""
    topology = Topology.discover(group, 0)
    sizes = sorted({len(host) for host in topology.hosts})
    if len(sizes) > 1:
        raise ValueError(
            f"HYBRID_SHARD without a device_mesh shards within each host, but hosts have {sizes} ranks; launch "
            "the same number of processes per host or pass device_mesh=(replicate, shard)"
        )
    return [[ranks[r] for r in host] for host in topology.hosts]


def _groups(shard_lists: list[list[int]]) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """This rank's shard group (one of ``shard_lists``) and replicate group (the ranks at its index in every
    list). Collective over this rank's two groups only: each stage of a pipeline builds its own at once, and a
    world-wide enumeration would give one stage's groups the names of another's. Built once per layout."""
    key = tuple(map(tuple, shard_lists))
    if key not in _CACHE:
        replicate_lists = [list(ranks) for ranks in zip(*shard_lists, strict=True)]
        _CACHE[key] = (_own_group(shard_lists), _own_group(replicate_lists))
    return _CACHE[key]


def _own_group(lists: list[list[int]]) -> dist.ProcessGroup:
    ranks = next(ranks for ranks in lists if dist.get_rank() in ranks)
    return dist.new_group(ranks, use_local_synchronization=True)


def _pair(value: tuple[Any, ...]) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    if len(value) != 2 or not all(isinstance(g, dist.ProcessGroup) for g in value):
        raise TypeError(f"process_group={value!r} must be a ProcessGroup or a (shard_group, replicate_group) pair")
    return value[0], value[1]


def _whole(shard: dist.ProcessGroup, replicate: dist.ProcessGroup) -> dist.ProcessGroup:
    """The world, which a (shard, replicate) pair or a 2-D mesh must cover exactly."""
    size, world = dist.get_world_size(shard) * dist.get_world_size(replicate), dist.get_world_size()
    if size != world:
        raise ValueError(
            f"the shard group ({dist.get_world_size(shard)} ranks) times the replicate group "
            f"({dist.get_world_size(replicate)}) cover {size} ranks, not the world's {world}; hybrid sharding over "
            "part of the world takes process_group=<that part> and device_mesh=(replicate, shard)"
        )
    return dist.group.WORLD


def _more_than_one(group: dist.ProcessGroup) -> dist.ProcessGroup | None:
    return group if dist.get_world_size(group) > 1 else None
