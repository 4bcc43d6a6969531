"""The hook-overhead benchmark: a smoke run of both models, the table, the JSON (no timing is asserted)."""

import json

import pytest

from benchmarks import offload_overhead

SMOKE = ["--warmup", "1", "--steps", "2", "--layers", "2", "--hook-repeats", "2"]
COLUMNS = ("no hooks", "ratio 0", "ratio 0 force_copy", "ratio 0.3 force_copy", "save_on_cpu", "detach only")


@pytest.mark.parametrize("model", ["gpt", "mlp"])
def test_smoke_run_writes_table_and_json(model, tmp_path, capsys):
    assert offload_overhead.main([*SMOKE, "--model", model, "--json", str(tmp_path / "r.json")]) == 0
    out = capsys.readouterr().out
    assert "ratio 0 force_copy overhead per saved tensor vs save_on_cpu's" in out
    payload = json.loads((tmp_path / "r.json").read_text())
    results = {r["name"]: r for r in payload["results"]}
    assert tuple(results) == COLUMNS and payload["saved_tensors"] > 0
    assert results["ratio 0"]["spans_counted"] == 0  # CPU tensors are not counted without force_copy
    assert results["ratio 0 force_copy"]["spans_counted"] > 0
    assert results["ratio 0 force_copy"]["achieved_ratio"] == 0.0
    assert 0.0 < results["ratio 0.3 force_copy"]["achieved_ratio"] < 1.0
    assert results["no hooks"]["overhead_us_per_tensor"] is None
    assert results["no hooks"]["hooks_us_per_tensor"] is None  # the hooks-alone table: every hooked column
    assert all(results[name]["hooks_us_per_tensor"] is not None for name in COLUMNS[1:])


def test_overheads_are_per_saved_tensor_and_relative_to_save_on_cpu():
    results = [
        offload_overhead.Result(name, step)
        for name, step in zip(COLUMNS, (1000, 1200, 1300, 2000, 1100, 1050), strict=True)
    ]
    offload_overhead.add_overheads(results, saved=100)
    by_name = {r.name: r for r in results}
    assert by_name["save_on_cpu"].overhead_us_per_tensor == 1.0
    assert by_name["ratio 0 force_copy"].overhead_us_per_tensor == 3.0 and by_name["ratio 0 force_copy"].vs_peer == 3.0
    table = offload_overhead.format_table(results)
    assert "3.00x" in table and "10.00" in table


@pytest.mark.parametrize("bad", [["--steps", "0"], ["--model", "resnet"], ["--hook-repeats", "0"]])
def test_bad_arguments_exit(bad):
    with pytest.raises(SystemExit):
        offload_overhead.parse_args(bad)
