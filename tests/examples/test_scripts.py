"""Every example script runs as its docstring says (2 CPU processes) and exits 0: examples do not rot.

The GPT example runs as `make demo` runs it (its YAML), shortened to a few steps.

Plain-PyTorch scripts run under torchrun; Lightning scripts start their own processes. The loss
printed by the plain training scripts must fall.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PLAIN = ["ddp", "fsdp", "pipeline", "cpu_offload", "hfreduce_allreduce"]
LIGHTNING = ["ddp", "fsdp", "pipeline", "cpu_offload"]
_LAUNCHER_VARIABLES = (
    "MASTER_ADDR",
    "MASTER_PORT",
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "NODE_RANK",
)


def _run(args: list[str], cwd: Path) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    # A script starts its own processes, as from a user's shell: no seed and no launcher's rendezvous (an
    # in-process Trainer earlier in the session leaves MASTER_PORT set, its store still listening there).
    for inherited in ("PL_GLOBAL_SEED", *_LAUNCHER_VARIABLES):
        env.pop(inherited, None)
    proc = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.parametrize("name", PLAIN)
def test_plain_example(name: str, tmp_path: Path) -> None:
    out = _run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", f"examples.plain.{name}"],
        tmp_path,
    )
    losses = [float(x) for x in re.findall(r"step \d+: loss ([\d.]+)", out)]
    if losses:
        assert losses[-1] < losses[0], out


@pytest.mark.parametrize("name", LIGHTNING)
def test_lightning_example(name: str, tmp_path: Path) -> None:
    _run([sys.executable, "-m", f"examples.lightning.{name}"], tmp_path)


def test_fabric_pipeline_example(tmp_path: Path) -> None:
    """docs/fabric.md's pipeline inside a Fabric script."""
    assert "final loss" in _run([sys.executable, "-m", "examples.fabric.pipeline"], tmp_path)


def test_gpt_example_as_make_demo_runs_it(tmp_path: Path) -> None:
    out = _run(
        [sys.executable, "-m", "examples.gpt.train", "--config", str(ROOT / "examples/gpt/demo.yaml"),
         "--trainer.max_steps=4", "--trainer.val_check_interval=2", "--trainer.limit_val_batches=1",
         "--trainer.log_every_n_steps=1", "--throughput.window_size=2", "--model.cfg.block_size=32",
         "--data.max_bytes=20000", f"--trainer.default_root_dir={tmp_path}"],
        tmp_path,
    )  # fmt: skip
    assert "world=2 steps=4" in out and "final validation loss" in out, out
