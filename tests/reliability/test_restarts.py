"""Under ``torchrun --max-restarts`` with torchrun's defaults, a job whose rank is SIGKILLed restarts once per
kill and resumes from ``last.ckpt`` to the same weights, bit for bit, as a job never killed.

Was: every restarted generation read the killed one's gloo addresses from torchrun's shared store and died in
``Gloo connectFullMesh failed``, so one kill cost several restarts or the whole job (pytorch#135712; see
``lightning_haiscale/adapter/process_group.py``).
The job is ``restart_job.py``: a float64 MLP, SGD with momentum, 2 ranks, 4 epochs of 4 steps, a checkpoint
at each epoch's end; rank 1 kills itself at steps 5 and 11, so each resume redoes steps (see [Note: where a
resume is exact] there). Compared per rank (its parameters, shard or stage) with the same job never killed:
same strategy, same ranks, so the same arithmetic in the same order: equality is exact.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

JOB = Path(__file__).with_name("restart_job.py")
ROOT = Path(__file__).resolve().parents[2]
KILLS = [5, 11]
JOB_TIMEOUT_S = 420  # a generation starts in ~10 s here; several tests may share the 2 cores


def run_torchrun(
    strategy: str, workdir: Path, kills: list[int] | list[str], job: Path = JOB
) -> subprocess.CompletedProcess[str]:
    """``torchrun --standalone --nproc-per-node 2 --max-restarts 3 restart_job.py ...`` (or ``job``; more restarts
    for more kills), with torchrun's defaults (no ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE``) and ``TMPDIR`` at
    ``workdir/tmp``; stopped if it overruns."""
    (workdir / "tmp").mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCH_DISABLE_SHARE", "TORCHELASTIC", "MASTER_"))}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", TMPDIR=str(workdir / "tmp"))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    command += ["--max-restarts", str(max(3, len(kills))), str(job), strategy, str(workdir), *map(str, kills)]
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True)  # fmt: skip
    try:
        out, _ = process.communicate(timeout=JOB_TIMEOUT_S)
    finally:
        if process.poll() is None:
            _stop(process, workdir)
    return subprocess.CompletedProcess(command, process.returncode, out if process.returncode is not None else "")


def _stop(torchrun: subprocess.Popen[str], workdir: Path) -> None:
    """Ends an overrunning job: SIGTERM to torchrun (it stops its workers), then SIGKILL to whatever is left
    (torchrun starts each worker in a session of its own, so they are found by the pids they logged)."""
    torchrun.terminate()
    try:
        torchrun.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(torchrun.pid, signal.SIGKILL)
        torchrun.wait()
    for pid in generations(workdir)[1] if (workdir / "generations").exists() else ():
        try:
            if str(JOB) in Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " "):
                os.kill(pid, signal.SIGKILL)
        except (FileNotFoundError, ProcessLookupError):
            pass


def generations(workdir: Path) -> tuple[set[int], set[int]]:
    """The restart counts the workers started under, and their pids."""
    rows = [line.split() for line in (workdir / "generations").read_text().splitlines()]
    return {int(g) for g, _, _ in rows}, {int(p) for _, _, p in rows}


def leftover_segments(pids: set[int]) -> list[str]:
    """The engine's /dev/shm segments created by one of ``pids`` (its names start ``lhs-<creator pid>-``)."""
    return [name for name in os.listdir("/dev/shm") if name.startswith("lhs-") and int(name.split("-")[1]) in pids]


def final_weights(workdir: Path) -> list[dict[str, torch.Tensor]]:
    return [torch.load(workdir / f"weights_rank{r}.pt")["weights"] for r in range(2)]


LONG = pytest.mark.long  # 80-105 s each here; hai_ddp runs in every suite (see conftest.py)


@pytest.mark.slow
@pytest.mark.parametrize(
    "strategy",
    ["hai_ddp", *(pytest.param(s, marks=LONG) for s in ("hai_fsdp", "hai_fsdp_sharded", "hai_pipedream"))],
)
def test_each_kill_costs_one_restart_and_nothing_else(strategy: str, tmp_path: Path) -> None:
    killed = run_torchrun(strategy, tmp_path / "killed", KILLS)
    assert killed.returncode == 0, killed.stdout[-6000:]
    counts, pids = generations(tmp_path / "killed")
    assert counts == set(range(len(KILLS) + 1)), f"generations {sorted(counts)} for {len(KILLS)} kills"
    assert all((tmp_path / "killed" / f"killed_{s}").exists() for s in KILLS)
    assert "connectFullMesh" not in killed.stdout
    reference = run_torchrun(strategy, tmp_path / "reference", [])
    assert reference.returncode == 0, reference.stdout[-6000:]
    _, reference_pids = generations(tmp_path / "reference")
    assert leftover_segments(pids | reference_pids) == []
    assert_same_weights(tmp_path / "killed", tmp_path / "reference")
    assert_no_higher_start(tmp_path / "killed")


def assert_no_higher_start(workdir: Path) -> None:
    """A restarted generation starts no higher than the first: RSS within 10 %, no more threads, at most 2 more
    open files (a resumed fit has read a checkpoint), per rank, at its first step."""
    rows = [line.split() for line in (workdir / "resources").read_text().splitlines()]
    first = {int(r): (float(rss), int(fds), int(threads)) for g, r, rss, fds, threads in rows if g == "0"}
    for g, r, rss, fds, threads in rows:
        rss0, fds0, threads0 = first[int(r)]
        assert float(rss) < 1.1 * rss0 and int(fds) <= fds0 + 2 and int(threads) <= threads0, (
            f"generation {g} rank {r} started at RSS {rss} MiB, {fds} fds, {threads} threads; the first at "
            f"{rss0:.1f}, {fds0}, {threads0}"
        )


def assert_same_weights(got_dir: Path, want_dir: Path) -> None:
    for rank, (got, want) in enumerate(zip(final_weights(got_dir), final_weights(want_dir), strict=True)):
        assert got.keys() == want.keys()
        for name in want:
            assert torch.equal(got[name], want[name]), f"rank {rank} {name} differs after resuming"
