"""The hai_ddp benchmark's floor of a shared core (``benchmarks/strategy_ddp.py``), on made-up step times."""

from __future__ import annotations

import pytest

from benchmarks.strategy_ddp import _floor


def _result(ddp: float, hai: float, free: float, engine: float, copy: float) -> dict[str, dict[str, float]]:
    return {
        "ddp": {"step_ms": ddp, "engine_cpu_ms": 0.0},
        "hai_ddp": {"step_ms": hai, "engine_cpu_ms": engine, "phase_copy_ms": copy},
        "no_comm": {"step_ms": free, "engine_cpu_ms": 0.0},
    }


def test_the_floor_is_no_comm_plus_the_reductions_cpu() -> None:
    # ddp spends 300 ms communicating; the reduction costs 70 + 5 ms of CPU: the floor step is 275 ms, which
    # removes 225 / 300 of ddp's communication time; hai_ddp at 290 ms is 15 ms above it.
    floor = _floor(_result(ddp=500, hai=290, free=200, engine=70, copy=5))
    assert floor == pytest.approx({"reduction_cpu_ms": 75, "floor_step_ms": 275, "floor_share": 0.75, "slack_ms": 15})


def test_a_free_reduction_allows_the_whole_share() -> None:
    assert _floor(_result(ddp=500, hai=200, free=200, engine=0, copy=0))["floor_share"] == 1.0
