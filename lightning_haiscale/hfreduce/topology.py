"""Which ranks of a process group share a host: the shape of the hierarchical algorithm."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

import torch.distributed as dist

NODE_ID_ENV = "HFREDUCE_NODE_ID"
"""Overrides the host name as the node identity, so tests can simulate several hosts on one machine."""


def node_id() -> str:
    """This process's host identity: ``$HFREDUCE_NODE_ID`` if set, else the host name."""
    return os.environ.get(NODE_ID_ENV) or socket.gethostname()


@dataclass(frozen=True)
class PeerInfo:
    """What a rank reports at discovery (the engine records each peer's pid itself, for liveness)."""

    node: str
    shm_free_bytes: int


@dataclass(frozen=True)
class Topology:
    """Hosts of a group, in order of their lowest group rank; ranks on a host in group-rank order.

    Attributes:
        hosts: ``hosts[h]`` lists the group ranks on host ``h``.
        host: index of this process's host.
        local_rank: this process's index within its host.
        peers: what each group rank reported, by group rank.
    """

    hosts: tuple[tuple[int, ...], ...]
    host: int
    local_rank: int
    peers: tuple[PeerInfo, ...]

    @property
    def local_size(self) -> int:
        return len(self.hosts[self.host])

    @property
    def num_hosts(self) -> int:
        return len(self.hosts)

    @property
    def local_ranks(self) -> tuple[int, ...]:
        """Group ranks on this host, by local rank."""
        return self.hosts[self.host]

    def cross_host_ranks(self, local_rank: int) -> tuple[int, ...]:
        """Group ranks with local index ``local_rank`` on every host, by host."""
        return tuple(ranks[local_rank] for ranks in self.hosts)

    @staticmethod
    def from_peers(peers: list[PeerInfo], rank: int) -> Topology:
        by_node: dict[str, list[int]] = {}
        for group_rank, peer in enumerate(peers):
            by_node.setdefault(peer.node, []).append(group_rank)
        hosts = tuple(tuple(ranks) for ranks in by_node.values())
        host = next(h for h, ranks in enumerate(hosts) if rank in ranks)
        return Topology(hosts, host, hosts[host].index(rank), tuple(peers))

    @staticmethod
    def discover(group: dist.ProcessGroup, shm_free_bytes: int) -> Topology:
        """Collective over ``group``: every rank reports its node and free /dev/shm bytes."""
        me = PeerInfo(node_id(), shm_free_bytes)
        peers: list[PeerInfo | None] = [None] * dist.get_world_size(group)
        dist.all_gather_object(peers, me, group=group)
        return Topology.from_peers([p for p in peers if p is not None], dist.get_rank(group))
