"""The PP x FSDP benchmark's own logic (``benchmarks/strategy_pp_fsdp.py``), without processes: the stages it
builds, the theory its counts are read against, and rows that the report reads."""

from __future__ import annotations

from benchmarks import report
from benchmarks.strategy_pp_fsdp import CHUNKS, CONFIGS, PRESETS, Result, _records, build_stage, stage_sizes, theory
from examples.gpt.model import GPT


def test_the_stages_are_the_models_halves() -> None:
    model = PRESETS["smoke"].model
    sizes = [stage_sizes(build_stage(model, stage)) for stage in (0, 1)]
    whole = sum(p.numel() for p in GPT(model).parameters())
    assert sum(s["block_params"] + s["root_params"] for s in sizes) == whole
    assert [s["blocks"] for s in sizes] == [model.n_layer // 2] * 2
    assert all(s["ddp_calls"] >= 1 for s in sizes)


def test_theory_counts_gathers_once_and_per_microbatch() -> None:
    stage = {"blocks": 2, "block_params": 2**20, "root_params": 2**18, "ddp_calls": 3}
    text = theory(stage, "pp_fsdp")
    # once a step: 3 units, 4 (P_b + P_r) bytes = 5 MiB; per microbatch: m (2B + 1) calls, 4 m (2 P_b + P_r) bytes
    assert text["all_gather"] == f"once a step 3 / 5 MiB; per microbatch {CHUNKS * 5} / {4 * CHUNKS * 2.25:.0f} MiB"
    assert text["reduce"] == "3 / 5 MiB"
    assert theory(stage, "dp_pp") == {"all_reduce": "3 / 5 MiB"}


def _result(step_s: float, pss: float) -> Result:
    result = Result()
    rank = {"step_s": [step_s, step_s], "cpu_s": [step_s, step_s], "peak_pss_mib": pss, "peak_rss_mib": pss + 100}
    ranks = [rank] * 4
    result.add(ranks)
    result.add(ranks)
    return result


def test_rows_set_ours_beside_each_peer_for_the_report() -> None:
    results = {"pp_fsdp": _result(2.0, 800), "dp_pp": _result(1.0, 1000), "titan": _result(1.0, 1000)}
    rows = _records("GPT", 8, results, noise=0.0)
    assert [r["peer"] for r in rows] == [CONFIGS["titan"], CONFIGS["dp_pp"]]
    assert all(report.ratio(r) == 0.5 and r["ours_pss_mib"] / r["peer_pss_mib"] == 0.8 for r in rows)
    assert "PP x FSDP" in report.summary(rows, "x")
