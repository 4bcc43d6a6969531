"""``benchmarks/report.py``'s conversions and summary block, on made-up benchmark output (no timing)."""

from __future__ import annotations

import pytest

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
            {"name": "no hooks", "overhead_us_per_tensor": None, "hooks_us_per_tensor": None},
            {"name": "ratio 0 force_copy", "overhead_us_per_tensor": 4.0, "hooks_us_per_tensor": 1.0},
            {"name": "save_on_cpu", "overhead_us_per_tensor": 2.0, "hooks_us_per_tensor": 1.25},
        ],
    }
    rows = report.allreduce_rows(allreduce) + report.offload_hook_rows(hooks)
    ratios = [r["ours_value"] / r["peer_value"] for r in rows]
    assert [round(x, 6) for x in ratios] == [100.0, 8.0, 16.0, 0.5, 1.25]  # the hooks: in the step, then alone
    block = report.summary(rows, "python benchmarks/report.py")
    assert block.startswith(report.BEGIN) and block.endswith(report.END)
    assert "| 100.00x |" in block and "| 0.50x |" in block and "109 saved tensors" in block


def _ddp_row(config: str, ddp: float, hai: float, no_comm: float) -> dict:
    """A row as benchmarks/strategy_ddp.py writes it."""
    return {"technique": "hai_ddp", "config": config, "ours": "hai_ddp", "peer": "ddp (gloo)", "metric": "samples/s",
            "ours_value": hai, "peer_value": ddp, "ceiling_value": no_comm,
            "ours_rss_mib": 1472.0, "peer_rss_mib": 1479.0}  # fmt: skip


ROWS = [
    _ddp_row("comm: small 1x16", 4.84, 7.16, 9.68),  # issue 15's figures: 1.48x, ceiling 2.00x, about 65%
    _ddp_row("comm_adamw: small 1x16", 3.10, 4.26, 5.115),
    {"technique": "hai_fsdp", "config": "GPT 355M (GPT-2 Medium)", "ours": "hai_fsdp", "peer": "FSDP2",
     "metric": "samples/s", "ours_value": 0.246, "peer_value": 0.152, "ours_rss_mib": 5905.0,
     "peer_rss_mib": 5756.0, "ours_pss_mib": 5781.0, "peer_pss_mib": 5441.0},
    {"technique": "CPU offload hooks", "config": "tiny GPT", "ours": "CPUOffload", "peer": "save_on_cpu",
     "metric": "tensors/µs", "ours_value": 0.26, "peer_value": 0.45},
]  # fmt: skip


def test_share_of_the_peers_communication_time_removed() -> None:
    """(ddp - hai_ddp) / (ddp - no_comm) in step time, i.e. in 1 / samples/s."""
    assert round(report.comm_removed(ROWS[0]), 3) == round((1 / 4.84 - 1 / 7.16) / (1 / 4.84 - 1 / 9.68), 3)
    assert 0.64 < report.comm_removed(ROWS[0]) < 0.66 and round(report.ceiling_ratio(ROWS[0]), 2) == 2.0
    assert report.comm_removed(ROWS[2]) is None and report.ceiling_ratio(ROWS[2]) is None
    no_comm_time = dict(ROWS[0], ceiling_value=ROWS[0]["peer_value"])  # the peer spends nothing communicating
    assert report.comm_removed(no_comm_time) is None
    compute_bound = _ddp_row("compute: tiny 8x256", 83.9, 85.2, 86.4)  # communication is 3% of ddp's step
    assert round(report.ceiling_ratio(compute_bound), 2) == 1.03 and report.comm_removed(compute_bound) is None


def test_summary_columns_follow_the_rows() -> None:
    block = report.summary(ROWS, "python -m benchmarks.report --quick")
    header = next(line for line in block.splitlines() if line.startswith("| technique"))
    assert "no-comm ceiling" in header and "comm time removed" in header and "PSS" in header
    comm = next(line for line in block.splitlines() if "| comm: small" in line)
    assert "| 1.48x | 2.00x | 65% | 1472 / 1479 MiB (1.00) |  |" in comm
    fsdp = next(line for line in block.splitlines() if "GPT-2 Medium" in line)
    assert "5905 / 5756 MiB (1.03)" in fsdp and "5781 / 5441 MiB (1.06)" in fsdp
    assert f"Machine: {report.cpu_model()}" in block
    plain = report.summary(ROWS[3:], "x")  # no row has a ceiling or memory: no empty columns
    header = next(line for line in plain.splitlines() if line.startswith("| technique"))
    assert header == "| technique | config | ours | peer | metric | ours | peer | ratio |"


def test_allreduce_rows_take_every_peer_column() -> None:
    data = {
        "rows": [
            {"bytes": 4096, "engine_s": 5e-6, "buffer_s": 6e-6, "gloo_s": 1.5e-3, "deepspeed_s": 3.3e-6},
            {"bytes": 1 << 20, "engine_s": 7e-5, "buffer_s": 5e-5, "gloo_s": 1e-3, "deepspeed_s": 8.8e-5},
            {"bytes": 64 << 20, "engine_s": 5e-3, "buffer_s": 4e-3, "gloo_s": 4e-2, "deepspeed_s": None},
        ]
    }
    rows = report.allreduce_rows(data)
    got = {(r["peer"], r["config"]): round(report.ratio(r), 2) for r in rows}
    assert got == {
        ("gloo", "4 KiB fp32"): 300.0,
        ("gloo", "1 MiB fp32"): 14.29,
        ("gloo", "64 MiB fp32"): 8.0,
        ("gloo", "64 MiB fp32, alloc_buffer"): 10.0,
        ("DeepSpeed shm", "4 KiB fp32"): 0.66,
        ("DeepSpeed shm", "1 MiB fp32"): 1.26,  # DeepSpeed did not run at 64 MiB: no row
    }


def test_chart_has_a_title_the_machine_line_ceilings_and_no_peer_bars() -> None:
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.patches import Rectangle

    fig = report.figure(ROWS)
    assert "peers" in fig._suptitle.get_text()
    assert any(t.get_text().startswith("Machine: ") and "cores; torch" in t.get_text() for t in fig.texts)
    speed, memory = fig.axes
    bars = [p for p in speed.patches if isinstance(p, Rectangle)]
    assert all(b.get_y() == 1.0 for b in bars)  # from the peer's 1x line: no bar of the peer itself

    def tops(filled: bool) -> list[float]:
        return [round(b.get_y() + b.get_height(), 2) for b in bars if b.get_fill() == filled]

    assert tops(True) == [round(report.ratio(r), 2) for r in ROWS]  # one bar per row (the offload row goes down)
    assert tops(False) == [2.0, 1.65]  # the ceilings
    labels = [t.get_text() for t in speed.texts]
    assert "1.48x\nceiling 2.00x\n65% of comm\nremoved" in labels
    assert "peer" not in [t.get_text() for t in speed.get_legend().get_texts()]
    assert len(memory.patches) == 3 + 1  # RSS for the 3 rows that have it, PSS for the one
    import matplotlib.pyplot as plt

    plt.close(fig)


def test_gpu_offload_rows_from_its_json() -> None:
    """offload_gpu.py writes its columns, not rows: ratio 0 against no offload, ratio 1 against save_on_cpu."""
    data = {
        "setup": "GPT config=medium (355M parameters, vocab 50257), batch 8, context 1024",
        "results": [
            {"name": "no offload", "step_ms": 75.5},
            {"name": "ratio 0", "step_ms": 100.0},
            {"name": "ratio 0.25", "step_ms": 133.4},
            {"name": "ratio 1", "step_ms": 378.5},
            {"name": "save_on_cpu", "step_ms": float("nan")},  # failed (out of memory): no row
        ],
    }
    rows = report.offload_gpu_rows(data)
    assert [(r["ours"], r["peer"], round(report.ratio(r), 2)) for r in rows] == [
        ("CPUOffload ratio 0", "no offload", 0.76)  # not every column ran in turns: the first pass, 75.5 / 100
    ]
    for r in data["results"]:
        r["alternating_step_ms"] = 93.3 if r["name"] == "ratio 0" else r["step_ms"]
    assert round(report.ratio(report.offload_gpu_rows(data)[0]), 2) == 0.81
    assert rows[0]["config"] == "GPT config=medium (355M parameters, vocab 50257), ratio 0"


def test_pipeline_split_rows_from_its_json() -> None:
    """pipeline_split.py writes one report: ours against torch's traced pipeline and against our Sequential path,
    each row with the larger spread of its two sides."""
    data = {
        "config": {"layers": 8, "width": 256, "chunks": 4, "batch": 16},
        "samples_per_s": {"ours": 20.0, "torch": 16.0, "ours_seq": 20.5},
        "spread": {"ours": 0.02, "torch": 0.05, "ours_seq": 0.01},
    }
    rows = report.pipeline_split_rows(data)
    assert [(r["peer"], round(report.ratio(r), 3), r["spread"]) for r in rows] == [
        ("torch pipelining (traced)", 1.25, 0.05),
        ("our nn.Sequential path", 0.976, 0.02),
    ]
    assert rows[0]["config"] == "GPT-2 8x256, 2 stages, 1F1B, 4 microbatches of 16 rows"


def test_same_side_spread_is_a_column_only_where_measured() -> None:
    """The pipeline benchmark's abba order runs each side twice; how far those runs are apart is its noise."""
    from benchmarks.strategy_pipeline import spread

    runs = {"ours": [{"step_s": 1.00}, {"step_s": 1.05}], "torch": [{"step_s": 0.90}, {"step_s": 0.99}]}
    assert round(spread(runs), 6) == 0.1  # torch's two runs: 0.99 / 0.90 - 1
    assert spread({"ours": [{"step_s": 2.0}], "torch": [{"step_s": 1.0}]}) == 0.0  # one run per side: no measure
    pipeline = {"technique": "pipeline, 2 stages", "config": "GPT", "ours": "GPipe", "peer": "torch ScheduleGPipe",
                "metric": "samples/s", "ours_value": 0.96, "peer_value": 1.0, "spread": 0.1}  # fmt: skip
    block = report.summary([*ROWS, pipeline], "x")
    assert "same-side spread" in next(line for line in block.splitlines() if line.startswith("| technique"))
    assert next(line for line in block.splitlines() if "| GPipe |" in line).endswith("| 10% |")
    plain = report.summary(ROWS, "x")
    assert "same-side spread" not in next(line for line in plain.splitlines() if line.startswith("| technique"))


def test_the_floor_share_stands_beside_the_share_removed() -> None:
    """hai_ddp's rows carry the share a reduction of the measured CPU cost allows; shown where the share is."""
    comm = dict(ROWS[0], floor_share=0.87, reduction_cpu_ms=74.3)
    compute = dict(_ddp_row("compute: tiny 8x256", 83.9, 85.2, 86.4), floor_share=0.5, reduction_cpu_ms=0.4)
    block = report.summary([comm, compute], "x")
    lines = block.splitlines()
    assert "share the reduction's own CPU allows" in next(line for line in lines if line.startswith("| technique"))
    assert "| 65% | 87% (74 ms CPU a step) |" in next(line for line in lines if "| comm: small" in line)
    assert "(74 ms" not in next(line for line in lines if "| compute:" in line)  # no share shown there
