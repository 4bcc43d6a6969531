"""benchmarks/cross_host.py: the ring's cost per collective, the theory of hybrid and full sharding, and the
counter on a real run over 2 simulated hosts (the engine's own bindings included)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from benchmarks.cross_host import CrossHostBytes, full_shard_theory, hybrid_theory, sent_bytes
from lightning_haiscale.hfreduce import Communicator
from lightning_haiscale.testing import run_distributed


def test_ring_cost_and_theory() -> None:
    assert sent_bytes("all_reduce", 1000, 2) == 1000 and sent_bytes("all_reduce", 1000, 4) == 1500
    assert sent_bytes("all_gather", 1000, 4) == 3000 and sent_bytes("reduce_scatter", 1000, 4) == 750
    assert hybrid_theory(10**6, shard=2, replicate=2) == 2 * 10**6  # fp32 shard of half the model, all-reduced
    assert full_shard_theory(10**6, world=4, hosts=2) == 3 * 10**6  # 2 all-gathers + 1 reduce-scatter of a quarter
    with pytest.raises(ValueError, match="kind='gather' is not a counted collective"):
        sent_bytes("gather", 1, 2)


def _count(rank: int, world: int) -> dict:
    original = dist.all_reduce
    across, within = CrossHostBytes(["a", "b"]).install(), CrossHostBytes(["a", "a"]).install()
    comm = Communicator()  # 2 hosts: the hierarchical path, through hierarchical.py's own bindings
    across.counting = within.counting = True
    dist.all_reduce(torch.ones(1000))  # 4000 bytes handed in, sent once around a ring of 2
    comm.all_gather(torch.empty(200), torch.ones(100))  # 400 bytes of input, sent once
    comm.reduce_scatter(torch.empty(100), torch.ones(200))  # across hosts: 400 bytes after the host's own step
    across.counting = within.counting = False
    dist.all_reduce(torch.ones(1000))  # not counted
    comm.close()
    within.uninstall()
    across.uninstall()
    tally = across.tally
    return {"payload": tally.payload, "sent": tally.total_sent(), "control": tally.control_bytes,
            "within": within.tally.total_sent(), "restored": dist.all_reduce is original}  # fmt: skip


def test_counter_on_two_hosts_counts_the_engine_and_torch() -> None:
    for got in run_distributed(_count, 2, node_ids=["a", "b"], timeout=120):
        assert got["payload"] == {"all_reduce": 4000, "all_gather": 400, "reduce_scatter": 800}
        assert got["sent"] == 4000 + 400 + 400
        assert got["control"] > 0  # the engine's agreement on each call, int64, kept apart
        assert got["within"] == 0 and got["restored"]


def test_report_shows_the_bytes_across_hosts_beside_their_theory() -> None:
    from benchmarks import report

    row = {"technique": "hai_fsdp HYBRID_SHARD", "config": "GPT 57M, comm", "ours": "HYBRID_SHARD", "peer": "HSDP",
           "metric": "steps/s", "ours_value": 2.0, "peer_value": 1.0, "ours_cross_host_mb": 114.2,
           "ours_cross_host_theory_mb": 114.0, "peer_cross_host_mb": 114.5,
           "peer_cross_host_theory_mb": 114.0}  # fmt: skip
    block = report.summary([row], "x")
    assert "sent across hosts/rank/step ours / peer (theory)" in block
    assert "| 114.2 (114.0) / 114.5 (114.0) MB |" in block
    assert "sent across hosts" not in report.summary([{**row, "peer_cross_host_mb": None}], "x").split("| technique")[1]
