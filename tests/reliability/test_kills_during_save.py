"""A rank SIGKILLed at any point of a checkpoint save leaves ``last.ckpt`` as the previous save or the new one,
never a mix: the job restarts under torchrun, resumes, and ends with the weights of a job never killed.

Was: the sharded format (DCP shards, ``.metadata``, ``meta.pt``) was written over ``last.ckpt`` in place, so a
kill left the previous ``.metadata`` beside new shard files; the pipelines wrote the full file and the stage
files one after the other, so a kill paired a new full file with old optimizer states. Now a folder is written
aside and swapped in by one rename, and a pipeline save is committed by its full file (see
``lightning_haiscale/adapter/checkpoint_files.py`` and ``strategies/pipeline_checkpoint.py``).

``restart_job.py`` logs every file operation of each rank in the saves at the end of epoch 1 (the epoch's
top-k checkpoint, the removal of the previous one, and ``last.ckpt``, which then exists: an overwrite). The
killed job is then killed before one of those operations per generation, on rank 0 (it commits) and rank 1,
and restarted each time. The audit hook that counts operations runs before each one, so "before operation
K" covers every gap between two operations, the last one's (after it, only a barrier is left) included.

``fabric_restart_job.py`` does the same with ``fabric.save`` under Fabric's ``hai_ddp`` and ``hai_fsdp``. Was:
their full file went through Lightning's ``_atomic_save``, whose temporary file under ``$TMPDIR`` a kill left
behind, and a Fabric restart under torchrun's defaults died in ``Gloo connectFullMesh failed``; now the file is
written beside ``last.ckpt`` and renamed there, and Fabric's process group is on the restart store.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.reliability.test_restarts import assert_same_weights, generations, leftover_segments, run_torchrun

MOST_KILLS = 8  # per job: each costs a restart of ~10 s here
FABRIC_JOB = Path(__file__).with_name("fabric_restart_job.py")


def kill_points(reference: Path, most: int | None = MOST_KILLS) -> list[str]:
    """``save:R:K`` for operations spread over rank 0's and rank 1's (rank 0's first and last included), or
    every operation of each rank when ``most`` is None."""
    points = []
    for rank, share in ((0, None if most is None else most - 2), (1, None if most is None else 2)):
        log = reference / f"save_ops_rank{rank}"
        ops = log.read_text().splitlines() if log.exists() else []  # a full file: rank 1 writes nothing
        if not ops:
            continue
        share = len(ops) if share is None else share
        chosen = sorted({round(i * (len(ops) - 1) / max(share - 1, 1)) for i in range(share)})
        points += [f"save:{rank}:{k + 1}" for k in chosen]
    return points


@pytest.mark.slow
@pytest.mark.long  # minutes: see conftest.py
@pytest.mark.parametrize("strategy", ["hai_fsdp_sharded", "hai_pipedream", "hai_fsdp", "hai_ddp"])
def test_a_kill_during_a_save_loses_nothing(strategy: str, tmp_path: Path) -> None:
    reference = run_torchrun(strategy, tmp_path / "reference", [])
    assert reference.returncode == 0, reference.stdout[-6000:]
    points = kill_points(tmp_path / "reference")
    killed = run_torchrun(strategy, tmp_path / "killed", points)
    assert_killed_job_lost_nothing(killed, tmp_path / "killed", points)
    assert_no_staging_left(tmp_path / "killed")
    assert_same_weights(tmp_path / "killed", tmp_path / "reference")


def assert_no_staging_left(workdir: Path) -> None:
    """No staging sibling (hidden) beside the checkpoints, and no temporary file (Lightning's ``_atomic_save``
    writes one in ``$TMPDIR``, which a kill leaves behind)."""
    assert [p.name for p in (workdir / "ckpt").iterdir() if p.name.startswith(".")] == []
    assert [p for p in (workdir / "tmp").iterdir() if p.is_file()] == []


def assert_killed_job_lost_nothing(killed: subprocess.CompletedProcess[str], workdir: Path, points: list[str]) -> None:
    """Every kill happened and cost one restart; no engine segment of any generation is left."""
    assert killed.returncode == 0, killed.stdout[-6000:]
    done = [i for i in range(len(points)) if (workdir / f"killed_save_{i}").exists()]
    assert done == list(range(len(points))), f"only kills {done} of {points} happened"
    counts, pids = generations(workdir)
    assert counts == set(range(len(points) + 1)), f"generations {sorted(counts)} for {len(points)} kills"
    assert leftover_segments(pids) == []


@pytest.mark.slow
@pytest.mark.parametrize(
    "strategy", ["hai_ddp", *(pytest.param(s, marks=pytest.mark.long) for s in ("hai_fsdp", "hai_fsdp_sharded"))]
)
def test_a_kill_during_fabric_save_loses_nothing(strategy: str, tmp_path: Path) -> None:
    """``fabric.save`` under Fabric's ``hai_ddp`` and ``hai_fsdp`` (a full file, a DCP folder), killed before
    every file operation of the save at epoch 1's end (a full file: 4, a folder: 8 on rank 0 and 2 on rank 1),
    each followed by a restart (~13 s here). Also: no staging sibling and no temporary file is left."""
    reference = run_torchrun(strategy, tmp_path / "reference", [], job=FABRIC_JOB)
    assert reference.returncode == 0, reference.stdout[-6000:]
    points = kill_points(tmp_path / "reference", most=None)
    killed = run_torchrun(strategy, tmp_path / "killed", points, job=FABRIC_JOB)
    assert_killed_job_lost_nothing(killed, tmp_path / "killed", points)
    assert sorted(p.name for p in (tmp_path / "killed" / "ckpt").iterdir()) == ["last.ckpt"]
    assert_no_staging_left(tmp_path / "killed")
    assert_same_weights(tmp_path / "killed", tmp_path / "reference")
