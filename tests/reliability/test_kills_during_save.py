"""A rank SIGKILLed at any point of a checkpoint save leaves ``last.ckpt`` as the previous save or the new one,
never a mix: the job restarts under torchrun, resumes, and ends with the weights of a job never killed.

Was: the sharded format (DCP shards, ``.metadata``, ``meta.pt``) was written over ``last.ckpt`` in place, so a
kill left the previous ``.metadata`` beside new shard files; the pipelines wrote the full file and the stage
files one after the other, so a kill paired a new full file with old optimizer states. Now a folder is written
aside and swapped in by one rename, and a pipeline save is committed by its full file (see
``lightning_haiscale/checkpoint_files.py`` and ``strategies/pipeline_checkpoint.py``).

``restart_job.py`` logs every file operation of each rank in the saves at the end of epoch 1 (the epoch's
top-k checkpoint, the removal of the previous one, and ``last.ckpt``, which then exists: an overwrite). The
killed job is then killed before one of those operations per generation, on rank 0 (it commits) and rank 1,
and restarted each time. The audit hook that counts operations runs before each one, so "before operation
K" covers every gap between two operations, the last one's (after it, only a barrier is left) included.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.reliability.test_restarts import assert_same_weights, generations, leftover_segments, run_torchrun

MOST_KILLS = 8  # per job: each costs a restart of ~10 s here


def kill_points(reference: Path) -> list[str]:
    """``save:R:K`` for operations spread over rank 0's and rank 1's (rank 0's first and last included)."""
    points = []
    for rank, share in ((0, MOST_KILLS - 2), (1, 2)):
        log = reference / f"save_ops_rank{rank}"
        ops = log.read_text().splitlines() if log.exists() else []  # a full file: rank 1 writes nothing
        if not ops:
            continue
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
    assert killed.returncode == 0, killed.stdout[-6000:]
    done = [i for i in range(len(points)) if (tmp_path / "killed" / f"killed_save_{i}").exists()]
    assert done == list(range(len(points))), f"only kills {done} of {points} happened"
    counts, pids = generations(tmp_path / "killed")
    assert counts == set(range(len(points) + 1)), f"generations {sorted(counts)} for {len(points)} kills"
    assert leftover_segments(pids) == []
    assert_same_weights(tmp_path / "killed", tmp_path / "reference")
