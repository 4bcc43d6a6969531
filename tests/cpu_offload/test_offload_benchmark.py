"""The GPU benchmark's CPU-independent parts: arguments, a smoke run on CPU, the table, the JSON."""

import json

import pytest
import torch

from benchmarks import offload_gpu

SMOKE = ["--device", "cpu", "--config", "tiny", "--vocab", "256", "--batch", "2", "--seq", "32"]
SMOKE += ["--warmup", "1", "--steps", "1", "--min-bytes", "0"]


def test_smoke_run_on_cpu_writes_table_and_json(tmp_path, capsys):
    assert offload_gpu.main([*SMOKE, "--json", str(tmp_path / "r.json")]) == 0
    out = capsys.readouterr().out
    assert "gradient check (tiny GPT, ratios 0.3 and 1, with vs without offload): ok" in out
    header = next(line for line in out.splitlines() if line.lstrip().startswith("|"))
    for column in ("no offload", "ratio 0", "ratio 0.25", "ratio 0.5", "ratio 1", "save_on_cpu"):
        assert column in header
    assert "step, columns alternating (ms)" in out and "host time backward (ms)" in out
    assert "target ratio 0 within 5% of no offload (columns alternating)" in out
    payload = json.loads((tmp_path / "r.json").read_text())
    ratios = {r["name"]: r["achieved_ratio"] for r in payload["results"]}
    assert ratios["ratio 1"] == 1.0 and ratios["ratio 0"] == 0.0 and ratios["no offload"] is None


def test_table_reports_cut_and_targets():
    base = offload_gpu.Result("no offload", 100.0, 2000.0, 2100.0, 1000.0)
    half = offload_gpu.Result("ratio 0.5", 110.0, 1500.0, 1600.0, 500.0, 0.5, 100.0, 20.0)
    full = offload_gpu.Result("ratio 1", 150.0, 1100.0, 1200.0, 100.0, 1.0, 200.0, 40.0)
    peer = offload_gpu.Result("save_on_cpu", 300.0, 1100.0, 1200.0, 100.0)
    table = offload_gpu.format_table([base, half, full, peer])
    assert "activation cut (%)" in table and "50.0" in table and "1.10x" in table
    lines = offload_gpu.target_lines([base, half, full, peer])
    assert lines[0].endswith("True") and "2.00x" in lines[1] and lines[1].endswith("True")
    zero = offload_gpu.Result("ratio 0", 106.0)
    base.alternating_step_ms, zero.alternating_step_ms = 100.0, 104.0  # the alternating pass decides
    assert offload_gpu.target_lines([base, zero])[0].endswith("(columns alternating): 1.040x: True")
    zero.alternating_step_ms = None
    assert offload_gpu.target_lines([base, zero])[0].endswith("(sequential pass): 1.060x: False")
    assert "1.04x" in offload_gpu.format_table([base, offload_gpu.Result("ratio 0", 106.0, alternating_step_ms=104.0)])


@pytest.mark.parametrize("bad", [["--ratios", "0.5,1.5"], ["--steps", "0"]])
def test_bad_arguments_exit(bad):
    with pytest.raises(SystemExit):
        offload_gpu.parse_args(bad)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU exit")
def test_without_cuda_exits_zero_with_a_message(capsys):
    assert offload_gpu.main([]) == 0
    assert "no CUDA device" in capsys.readouterr().out
