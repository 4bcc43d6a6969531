"""``benchmarks/gpu_check.py``'s parity checks, run on CPU: the script's own logic is tested without a GPU.

A check that compares wrongly (bad parameter mapping, wrong slice of the batch) fails here too; the CUDA
copies of these paths run only where a GPU is.
"""

from __future__ import annotations

import pytest
import torch

from benchmarks import gpu_check


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
