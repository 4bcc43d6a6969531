"""HYBRID_SHARD started as a user's two-node job starts (issue 27): two ``torchrun --nnodes 2 --node-rank N``
launches of 2 processes each, the nodes simulated by ``HFREDUCE_NODE_ID``, against one process (float64, SGD,
1e-10 as in test_sharding)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from lightning.fabric.plugins.environments.lightning import find_free_network_port

from tests.fsdp.models import CASES, sgd_reference, token_batches
from tests.fsdp.test_sharding import LR, STEPS

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_hybrid_shard_under_torchrun_on_two_nodes(tmp_path: Path) -> None:
    port = str(find_free_network_port())
    out = tmp_path / "result.pt"
    launches, files = [], []
    for node in (0, 1):
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "HFREDUCE_NODE_ID": f"node{node}"}
        args = ["--nnodes", "2", "--node-rank", str(node), "--nproc-per-node", "2", "--master-addr", "127.0.0.1"]
        command = [sys.executable, "-m", "torch.distributed.run", *args, "--master-port", port]
        log = (tmp_path / f"node{node}.log").open("w")  # a file: a full pipe would block the other node
        files.append(log)
        job = [*command, "-m", "tests.fsdp.hybrid_job", str(out)]
        launches.append(subprocess.Popen(job, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT))
    codes = [p.wait(timeout=600) for p in launches]
    for log in files:
        log.close()
    logs = [(tmp_path / f"node{node}.log").read_text()[-3000:] for node in (0, 1)]
    assert codes == [0, 0], "\n".join(logs)
    result = torch.load(out)
    assert result["groups"] == ("shm", 2, "hierarchical", 2)  # a node's ranks shard; replicas across nodes
    ref_losses, ref_state = sgd_reference(CASES["example"], token_batches(STEPS, 8), LR)
    torch.testing.assert_close(result["losses"], ref_losses, rtol=1e-10, atol=0)
    for key, value in ref_state.items():
        assert ((result["state"][key] - value).abs().max() / value.abs().max()).item() < 1e-10, key
