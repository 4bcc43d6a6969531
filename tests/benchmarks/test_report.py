"""``benchmarks/report.py``'s conversions and summary block, on made-up benchmark output (no timing)."""

from __future__ import annotations

from benchmarks import report


def test_rows_and_summary_from_benchmark_json() -> None:
    allreduce = {
        "rows": [
            {"bytes": 4096, "engine_s": 1e-5, "gloo_s": 1e-3, "buffer_s": 2e-5},
            {"bytes": 64 << 20, "engine_s": 0.005, "gloo_s": 0.04, "buffer_s": 0.0025},
        ]
    }
    hooks = {
        "saved_tensors": 109,
        "results": [
            {"name": "no hooks", "overhead_us_per_tensor": None},
            {"name": "ratio 0 force_copy", "overhead_us_per_tensor": 4.0},
            {"name": "save_on_cpu", "overhead_us_per_tensor": 2.0},
        ],
    }
    rows = report.allreduce_rows(allreduce) + report.offload_hook_rows(hooks)
    ratios = [r["ours_value"] / r["peer_value"] for r in rows]
    assert [round(x, 6) for x in ratios] == [100.0, 8.0, 16.0, 0.5]
    block = report.summary(rows, "python benchmarks/report.py")
    assert block.startswith(report.BEGIN) and block.endswith(report.END)
    assert "| 100.00x |" in block and "| 0.50x |" in block and "109 saved tensors" in block
