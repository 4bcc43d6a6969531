"""``Trainer(strategy=HaiFSDPStrategy(sharding_strategy="HYBRID_SHARD"), num_nodes=2)`` started as a user's two-node
job starts (issue 27): two ``torchrun --nnodes 2 --node-rank N`` launches of 2 processes each, the nodes simulated by
``HFREDUCE_NODE_ID``, a litgpt-style model with activation checkpointing by keyword, against one process (float64,
SGD; tolerance as ``test_hai_fsdp_sharding.py``'s)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch
from lightning.fabric.plugins.environments.lightning import find_free_network_port

from tests.strategies.test_hai_fsdp_sharding import _reference, _tokens

ROOT = Path(__file__).resolve().parents[2]


def test_trainer_hybrid_shard_under_torchrun_on_two_nodes(tmp_path: Path) -> None:
    port, out = str(find_free_network_port()), tmp_path / "result.pt"
    launches, logs = [], [tmp_path / f"node{node}.log" for node in (0, 1)]
    for node, log in enumerate(logs):
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "HFREDUCE_NODE_ID": f"node{node}"}
        args = ["--nnodes", "2", "--node-rank", str(node), "--nproc-per-node", "2", "--master-addr", "127.0.0.1"]
        job = [sys.executable, "-m", "torch.distributed.run", *args, "--master-port", port]
        job += ["-m", "tests.strategies.hai_fsdp_hybrid_job", str(out)]
        with log.open("w") as sink:  # a file: a full pipe would block the other node
            launches.append(subprocess.Popen(job, cwd=ROOT, env=env, stdout=sink, stderr=subprocess.STDOUT))
    codes = [p.wait(timeout=600) for p in launches]
    assert codes == [0, 0], "\n".join(log.read_text()[-3000:] for log in logs)
    result = torch.load(out, weights_only=True)
    assert tuple(result["groups"]) == (2, 2)  # each node's 2 ranks shard; the 2 nodes replicate
    expected, losses = _reference("litgpt_style", _tokens(4))
    assert sorted(result["state"]) == sorted(f"model.{k}" for k in expected)
    for key, value in expected.items():
        torch.testing.assert_close(result["state"][f"model.{key}"], value, rtol=1e-9, atol=1e-12, msg=key)
    torch.testing.assert_close(result["losses"], losses, rtol=1e-9, atol=0)
