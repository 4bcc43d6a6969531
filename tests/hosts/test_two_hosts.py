"""The cross-host path on two real hosts (see [Note: two hosts from namespaces] in conftest.py), with no
``HFREDUCE_NODE_ID``: parity of ``hai_ddp`` and ``hai_fsdp`` ``HYBRID_SHARD`` with one process when both hosts
have one host name, and a host that is killed or goes silent named within seconds on the survivors; no case
leaves a segment behind."""

from __future__ import annotations

import json
import time

import pytest
import torch

from lightning_haiscale.hfreduce.liveness import SILENT_S
from lightning_haiscale.testing.parity import BATCH, STEPS, assert_parity, reference
from tests.hosts.conftest import TwoHosts

_JOB_S = 240  # a loaded 2-core machine starts 6 Python processes with torch and Lightning


def _records(two_hosts: TwoHosts, ranks: range | list = range(4)) -> dict[int, dict]:
    return {r: json.loads((two_hosts.out / f"{r}.json").read_text()) for r in ranks}


def _no_segment_left(two_hosts) -> None:
    for host in two_hosts.hosts:
        if host.shm_left.exists():
            assert host.shm_left.read_text().split() == [], two_hosts.logs()


# each rank's engines: [group ranks, backend]; hai_ddp: one over all; HYBRID_SHARD: shards in a host, replicas across
_ENGINES = {
    "hai_ddp": lambda r: [[[0, 1, 2, 3], "hierarchical"]],
    "hai_fsdp_hybrid": lambda r: [[[0, 1] if r < 2 else [2, 3], "shm"], [[r % 2, r % 2 + 2], "hierarchical"]],
}


@pytest.mark.slow
@pytest.mark.parametrize("strategy", list(_ENGINES))
def test_one_host_name_on_two_hosts_trains_like_one_process(two_hosts: TwoHosts, strategy: str) -> None:
    """Containers from one image often share a host name: the engine must still see two hosts."""
    two_hosts.start(["fit", strategy], names=["node", "node"])
    assert two_hosts.wait(_JOB_S) == [0, 0], two_hosts.logs()
    records = _records(two_hosts)
    assert all(records[r]["engines"] == _ENGINES[strategy](r) for r in range(4)), records
    expected, _ = reference(STEPS, BATCH, dp=4, rows=BATCH * STEPS * 4, dtype=torch.float64)
    assert_parity(records[0]["weights"], expected, label=f"{strategy} on two hosts named alike")
    _no_segment_left(two_hosts)


def _survivors_name_the_lost_host(
    two_hosts: TwoHosts, lose: str, phase: str = "engine", timeout: float = _JOB_S
) -> list[float]:
    two_hosts.start(["loop", phase], names=["a", "b"], env={"JOB_TIMEOUT_S": str(timeout)})
    two_hosts.wait_for([f"ready{r}" for r in range(4)], _JOB_S)
    lost = time.time()
    getattr(two_hosts.hosts[1], lose)()
    codes = two_hosts.wait(_JOB_S, hosts=[0])  # the lost host is killed at teardown
    assert codes[0] not in (0, None), two_hosts.logs()
    # torchrun ends a host's other ranks once one has failed: the first survivor to raise always records
    records = _records(two_hosts, [r for r in (0, 1) if (two_hosts.out / f"{r}.json").exists()])
    assert records, two_hosts.logs()
    for record in records.values():
        assert ("HFReduce" in record["error"] or phase != "engine") and record["hosts"] == 2, record
    _no_segment_left(two_hosts)
    return [r["at"] - lost for r in records.values()]


def test_a_killed_host_is_named_within_seconds(two_hosts: TwoHosts) -> None:
    delays = _survivors_name_the_lost_host(two_hosts, "kill")
    print(f"killed host: named after {max(delays):.2f} s")
    assert max(delays) < 30, delays  # gloo sees the closed sockets: measured well under a second


def test_a_silent_host_is_named_within_seconds(two_hosts: TwoHosts) -> None:
    """Its link dropped: no socket closes, gloo would wait for the job's timeout (_JOB_S here)."""
    delays = _survivors_name_the_lost_host(two_hosts, "drop_link")
    print(f"silent host: named after {max(delays):.2f} s")
    assert max(delays) < SILENT_S + 20, delays  # the heartbeat's silence, and a loaded machine's margin


def test_a_silent_host_in_a_pipeline_is_named_within_seconds(two_hosts: TwoHosts) -> None:
    """A pipeline alone (no engine) spanning the hosts: a stage-to-stage transfer's wait ends naming the rank."""
    delays = _survivors_name_the_lost_host(two_hosts, "drop_link", phase="pipeline")
    print(f"silent host in a pipeline: named after {max(delays):.2f} s")
    assert max(delays) < SILENT_S + 20, delays
    assert "is silent: no heartbeat for" in two_hosts.logs(), two_hosts.logs()


def test_one_node_id_on_two_hosts_fails_at_once_naming_it(two_hosts: TwoHosts) -> None:
    """HFREDUCE_NODE_ID says one host, but the two cannot see each other's /dev/shm: the named error, at once."""
    two_hosts.start(["loop"], names=["a", "b"], env={"JOB_TIMEOUT_S": str(_JOB_S), "HFREDUCE_NODE_ID": "same"})
    assert two_hosts.wait(_JOB_S) == [1, 1], two_hosts.logs()
    records = _records(two_hosts, [r for r in range(4) if (two_hosts.out / f"{r}.json").exists()])
    assert {r // 2 for r in records} == {0, 1}, records  # torchrun may end a host's second rank first
    for record in records.values():
        assert "host identity clash" in record["error"] and "HFREDUCE_NODE_ID='same'" in record["error"], record
    delays = [r["at"] - r["started"] for r in records.values()]
    print(f"one HFREDUCE_NODE_ID on two hosts: raised after {max(delays):.2f} s")
    assert max(delays) < 5, records
    _no_segment_left(two_hosts)


def test_a_silent_host_during_a_barrier_is_named_in_seconds_and_ends_at_the_timeout(two_hosts: TwoHosts) -> None:
    """Outside the engine (gloo's barrier, as a checkpoint's), the survivors' logs name the silent rank within
    seconds, and the wait ends at the process group's timeout (the strategy's), then the process exits."""
    timeout = 25.0
    delays = _survivors_name_the_lost_host(two_hosts, "drop_link", phase="barrier", timeout=timeout)
    print(f"silent host during a barrier: ended after {max(delays):.2f} s (timeout {timeout} s)")
    assert timeout - 1 < max(delays) < timeout + 30, delays
    assert "is silent: no heartbeat for" in two_hosts.logs(), two_hosts.logs()
