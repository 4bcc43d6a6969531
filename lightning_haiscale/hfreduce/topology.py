"""Which ranks of a process group share a host: the shape of the hierarchical algorithm.

[Note: telling hosts apart]
A host, for the engine, is the ranks that can map each other's ``/dev/shm`` segments and see each other's
pids (the engine's liveness check, csrc/communicator.cpp). A host name says neither: containers started
from one image often share one (or say ``localhost``) while each has its own ``/dev/shm``. So at discovery
every rank writes a probe file in its ``/dev/shm`` and, once all have reported theirs, checks which
probes it can see; ranks that see the same set of probes and share a pid namespace are one host. Where the
answer is not a partition (rank a sees b's probe but b does not see a's), or where ``HFREDUCE_NODE_ID``
names as one host ranks that cannot see each other, every rank raises the same error at once, since every
rank holds the same table. Each rank removes its probe before the exchange returns.
"""

from __future__ import annotations

import os
import secrets
import socket
from dataclasses import dataclass

import torch.distributed as dist

from lightning_haiscale.hfreduce import kept_collectives
from lightning_haiscale.hfreduce.errors import HFReduceError

NODE_ID_ENV = "HFREDUCE_NODE_ID"
"""Overrides the host identity, so tests can simulate several hosts on one machine (see [Note: telling hosts
apart]: ranks given one value must still share their /dev/shm)."""

SHM_DIR = "/dev/shm"


def node_id() -> str:
    """This process's host identity: ``$HFREDUCE_NODE_ID`` if set, else the host name."""
    return os.environ.get(NODE_ID_ENV) or socket.gethostname()


@dataclass(frozen=True)
class PeerInfo:
    """What a rank reports at discovery (the engine records each peer's pid itself, for liveness).

    Attributes:
        node: the host name, or ``$HFREDUCE_NODE_ID``.
        shm_free_bytes: free bytes in this rank's /dev/shm.
        probe: the file this rank wrote in its /dev/shm (None if it could not write one).
        pid_namespace: ``/proc/self/ns/pid``'s target: ranks in different pid namespaces cannot check each
            other's pids.
        named: whether ``node`` came from ``$HFREDUCE_NODE_ID``.
    """

    node: str
    shm_free_bytes: int
    probe: str | None = None
    pid_namespace: str = ""
    named: bool = False


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
    def from_peers(peers: list[PeerInfo], rank: int, seen: list[frozenset[int]] | None = None) -> Topology:
        """The hosts of ``peers``; ``seen[r]`` is the set of ranks whose probe rank ``r`` saw (see [Note:
        telling hosts apart]); without it, or where a rank wrote no probe, the reported nodes decide."""
        if seen is None or any(p.probe is None for p in peers):
            keys: list[object] = [(p.node, p.pid_namespace) for p in peers]
        elif any(p.named for p in peers):
            _check_named_hosts(peers, seen)
            keys = [p.node for p in peers]
        else:
            _check_partition(peers, seen)
            keys = [(seen[r], p.pid_namespace) for r, p in enumerate(peers)]
        by_key: dict[object, list[int]] = {}
        for group_rank, key in enumerate(keys):
            by_key.setdefault(key, []).append(group_rank)
        hosts = tuple(tuple(ranks) for ranks in by_key.values())
        host = next(h for h, ranks in enumerate(hosts) if rank in ranks)
        return Topology(hosts, host, hosts[host].index(rank), tuple(peers))

    @staticmethod
    def discover(group: dist.ProcessGroup, shm_free_bytes: int) -> Topology:
        """Collective over ``group``: every rank reports its node, free /dev/shm bytes and probe, then which
        probes it sees (two exchanges; see [Note: telling hosts apart])."""
        probe = _write_probe()
        try:
            me = PeerInfo(node_id(), shm_free_bytes, probe, _pid_namespace(), bool(os.environ.get(NODE_ID_ENV)))
            peers = kept_collectives.all_gather_object(me, group)
            mine = frozenset(r for r, p in enumerate(peers) if p.probe and os.path.exists(f"{SHM_DIR}/{p.probe}"))
            seen = kept_collectives.all_gather_object(mine, group)
        finally:
            if probe is not None:
                os.unlink(f"{SHM_DIR}/{probe}")
        return Topology.from_peers(peers, dist.get_rank(group), seen)


def _write_probe() -> str | None:
    # hidden, and not "lhs-*": not taken for a segment while it briefly exists; pid: whose it was, if one leaks
    name = f".lhs-probe-{os.getpid()}-{secrets.token_hex(8)}"
    try:
        os.close(os.open(f"{SHM_DIR}/{name}", os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
    except OSError:  # no writable /dev/shm: the engine cannot run here either, and says so later
        return None
    return name


def _pid_namespace() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


_FIX = (
    f"Set {NODE_ID_ENV} to one value per host (the same value on exactly the ranks that share a /dev/shm), "
    "or give each host its own host name"
)


def _check_named_hosts(peers: list[PeerInfo], seen: list[frozenset[int]]) -> None:
    """Ranks given one ``$HFREDUCE_NODE_ID`` must see each other's probes and pids."""
    for r, p in enumerate(peers):
        for q, other in enumerate(peers):
            if other.node != p.node or q == r:
                continue
            if q not in seen[r] or other.pid_namespace != p.pid_namespace:
                what = "cannot see the /dev/shm" if q not in seen[r] else "is in another pid namespace than"
                raise HFReduceError(
                    f"hfreduce: host identity clash: group ranks {r} and {q} both report host {p.node!r} "
                    f"({NODE_ID_ENV}={os.environ.get(NODE_ID_ENV, '')!r} here) but rank {r} {what} of rank {q}: "
                    f"they are not one host. {_FIX}"
                )


def _check_partition(peers: list[PeerInfo], seen: list[frozenset[int]]) -> None:
    """The probes seen must split the ranks into hosts: every rank sees exactly the ranks that see it."""
    for r, sees in enumerate(seen):
        for q in sees:
            if seen[q] != sees:
                raise HFReduceError(
                    f"hfreduce: host identity clash: group rank {r} (host {peers[r].node!r}) sees the /dev/shm of "
                    f"ranks {sorted(sees)} but rank {q} (host {peers[q].node!r}) sees those of ranks "
                    f"{sorted(seen[q])}, so the hosts cannot be told apart ({NODE_ID_ENV} is not set). {_FIX}"
                )
