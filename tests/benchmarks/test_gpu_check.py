"""``benchmarks/gpu_check.py``'s parity checks, run on CPU: the script's own logic is tested without a GPU.

A check that compares wrongly (bad parameter mapping, wrong slice of the batch) fails here too; the CUDA
copies of these paths run only where a GPU is.
"""

from __future__ import annotations

import pytest
import torch

from benchmarks import gpu_check, gpu_fit
from tests.distributed import run_distributed


@pytest.mark.parametrize("check", [gpu_check.check_ddp, gpu_check.check_pipeline])
def test_parity_checks_pass_on_cpu(check) -> None:
    (row,) = check("cpu")
    assert row.ok, row.detail
    assert "cpu" in row.check and "max rel err" in row.detail


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU exit")
def test_without_cuda_exits_zero(capsys, monkeypatch) -> None:
    monkeypatch.setattr("sys.argv", ["gpu_check.py"])
    assert gpu_check.main() == 0
    assert "no CUDA device" in capsys.readouterr().out


def test_fit_matrix_covers_every_strategy() -> None:
    labels = [case.label for case in gpu_fit.cases()]
    for world in (1, 2):
        for name in ("hai_ddp", "hai_fsdp", "hai_gpipe(checkpoint)", "hai_pipedream"):
            assert f"{name} on {world} process{'es' if world > 1 else ''}" in labels
    assert "hai_interleaved_1f1b on 2 processes" in labels
    assert "hai_ddp on 2 processes, no_sync + find_unused_parameters" in labels
    assert "hai_pipedream(dp x pp) on 4 processes" in labels


def test_fit_checks_pass_on_cpu() -> None:
    """The Trainer fits' comparison with one process, on CPU: no_sync with an unused parameter, and
    Interleaved1F1B with its sanity-check evaluation."""
    rows = gpu_fit.fit_rows("cpu", (2,), ("32-true",), names={"hai_ddp", "hai_interleaved_1f1b"})
    assert len(rows) == 3 and all(ok for _, ok, _ in rows), rows


def _wrong_reference_and_race(rank: int, world: int) -> tuple[float, float]:
    wrong = gpu_fit.fit_error(gpu_fit.Case("hai_ddp", 2, dp=4), "32-true", "cpu")  # dp=4: other rows
    return wrong, gpu_fit._race_worker(rank, world, "cpu")


def test_fit_check_can_fail_and_race_parity_on_cpu() -> None:
    """Compared with a reference on other rows, a fit is far off (the check is not vacuous); the stream-race
    worker's parity logic holds on CPU (its sleeps and side stream apply only on CUDA)."""
    results = run_distributed(_wrong_reference_and_race, 2, timeout=180)
    assert results[0][0] > gpu_fit.tolerance(gpu_fit.Case("hai_ddp", 2, dp=4), "32-true") * 100
    assert max(race for _, race in results) < gpu_fit.RACE_TOLERANCE  # its reason: beside it in gpu_fit


def test_fsdp_mode_checks_pass_on_cpu() -> None:
    """hai_fsdp's sharding strategies, cpu_offload (no effect on CPU) and activation checkpointing under
    bf16-mixed, compared with one fp32 process as on the GPU."""
    rows = gpu_check.check_fsdp_modes("cpu")
    labels = [row.check for row in rows]
    modes = ("'FULL_SHARD'", "'SHARD_GRAD_OP'", "'NO_SHARD'", "'HYBRID_SHARD'", "cpu_offload=True", "checkpointing")
    for mode in modes:
        assert any(mode in label for label in labels), mode
    assert all(row.ok for row in rows), rows


def test_pp_fsdp_check_passes_on_cpu() -> None:
    """PP x FSDP in the Trainer (4 processes: 2 pipelines of 2 sharded stages) under bf16-mixed, compared with one
    fp32 process as on the GPU."""
    (row,) = gpu_check.check_pp_fsdp("cpu")
    assert row.ok, row.detail
    assert "pp x fsdp" in row.check and "bf16-mixed on cpu" in row.check
