"""Host identity (see [Note: telling hosts apart] in topology.py): the probes each rank sees decide the hosts,
not the host name; a table that is not a partition, or an ``HFREDUCE_NODE_ID`` that joins ranks that cannot
see each other, raises the named error."""

from __future__ import annotations

import glob

import pytest

from lightning_haiscale.hfreduce import Communicator
from lightning_haiscale.hfreduce.errors import HFReduceError
from lightning_haiscale.hfreduce.topology import PeerInfo, Topology
from lightning_haiscale.testing import run_distributed


def _peers(nodes: list[str], named: bool = False, pid_ns: list[str] | None = None) -> list[PeerInfo]:
    spaces = pid_ns or ["pid:[1]"] * len(nodes)
    return [PeerInfo(n, 1 << 30, f"probe{r}", spaces[r], named) for r, n in enumerate(nodes)]


def test_one_host_name_with_two_dev_shm_is_two_hosts() -> None:
    seen = [frozenset({0, 2}), frozenset({1, 3}), frozenset({0, 2}), frozenset({1, 3})]
    topology = Topology.from_peers(_peers(["localhost"] * 4), 1, seen)
    assert topology.hosts == ((0, 2), (1, 3)) and topology.host == 1 and topology.local_rank == 0


def test_two_host_names_sharing_dev_shm_and_pids_are_one_host() -> None:
    seen = [frozenset({0, 1})] * 2
    assert Topology.from_peers(_peers(["a", "b"]), 0, seen).hosts == ((0, 1),)


def test_another_pid_namespace_is_another_host() -> None:
    seen = [frozenset({0, 1})] * 2
    topology = Topology.from_peers(_peers(["a", "a"], pid_ns=["pid:[1]", "pid:[2]"]), 0, seen)
    assert topology.hosts == ((0,), (1,))


def test_a_table_that_is_not_a_partition_raises_naming_the_ranks() -> None:
    seen = [frozenset({0, 1}), frozenset({1})]
    with pytest.raises(HFReduceError, match=r"clash: group rank 0 .* ranks \[0, 1\] but rank 1 .*HFREDUCE_NODE_ID"):
        Topology.from_peers(_peers(["h", "h"]), 0, seen)


def test_node_id_joining_ranks_that_cannot_see_each_other_raises() -> None:
    seen = [frozenset({0}), frozenset({1})]
    with pytest.raises(HFReduceError, match=r"ranks 0 and 1 both report host 'x' .* cannot see the /dev/shm"):
        Topology.from_peers(_peers(["x", "x"], named=True), 1, seen)


def test_node_id_still_splits_ranks_that_share_dev_shm() -> None:
    seen = [frozenset({0, 1})] * 2
    assert Topology.from_peers(_peers(["a", "b"], named=True), 0, seen).hosts == ((0,), (1,))


def _hosts(rank: int, world: int) -> tuple:
    with Communicator() as comm:
        return comm.topology.hosts, comm.backend


def test_discovery_on_one_machine_leaves_no_probe() -> None:
    before = set(glob.glob("/dev/shm/lhs-*"))
    assert run_distributed(_hosts, 2, timeout=120) == [(((0, 1),), "shm")] * 2
    assert run_distributed(_hosts, 2, node_ids=["a", "b"], timeout=120)[0] == (((0,), (1,)), "hierarchical")
    assert set(glob.glob("/dev/shm/lhs-*")) <= before
