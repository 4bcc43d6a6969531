"""Schedules as data, checked without processes: textbook orders, completeness, no deadlock, live bounds."""

import pytest

from lightning_haiscale.pipeline.schedule import (
    Action,
    ActionType,
    add_communication,
    build_schedule,
    format_grid,
    gpipe_order,
    interleaved_order,
    live_activation_peak,
    one_f_one_b_order,
    simulate,
    validate,
)


def _compute(schedule: dict[int, list[Action]], rank: int) -> list[str]:
    return [str(a) for a in schedule[rank] if a.type.is_compute]


def test_action_prints_and_parses() -> None:
    for text in ("1F0", "0B7", "12SEND_F3", "3RECV_B10"):
        assert str(Action.parse(text)) == text
    assert Action.parse("2F5") == Action(2, ActionType.FORWARD, 5)
    with pytest.raises(ValueError, match="'1X0'"):
        Action.parse("1X0")


def test_one_f_one_b_is_the_textbook_order() -> None:
    stages, chunks = 4, 8
    for rank in range(stages):
        actions = [str(a) for a in one_f_one_b_order(rank, stages, chunks)]
        warmup = stages - rank - 1
        expected = [f"{rank}F{m}" for m in range(warmup)]
        for i in range(chunks - warmup):
            expected += [f"{rank}F{warmup + i}", f"{rank}B{i}"]
        expected += [f"{rank}B{m}" for m in range(chunks - warmup, chunks)]
        assert actions == expected
    assert [str(a) for a in one_f_one_b_order(0, 4, 2)] == ["0F0", "0F1", "0B0", "0B1"]


def test_gpipe_is_all_forwards_then_backwards() -> None:
    assert [str(a) for a in gpipe_order(1, 2, 3)] == ["1F0", "1F1", "1F2", "1B2", "1B1", "1B0"]


def test_interleaved_matches_megatron() -> None:
    # 2 ranks, 2 model chunks, 4 microbatches: stage s = chunk * 2 + rank; groups of 2 microbatches.
    assert [str(a) for a in interleaved_order(0, 2, 4, 2)] == [
        "0F0", "0F1", "2F0", "2F1", "0F2", "2B0", "0F3", "2B1", "2F2", "0B0", "2F3", "0B1", "2B2", "2B3", "0B2", "0B3",
    ]  # fmt: skip
    assert [str(a) for a in interleaved_order(1, 2, 4, 2)][:3] == ["1F0", "1F1", "3F0"]  # warm-up 2
    with pytest.raises(ValueError, match="chunks=6 must be a multiple of the number of pipeline ranks 4"):
        interleaved_order(0, 4, 6, 2)


ORDERS = [(gpipe_order, 1), (one_f_one_b_order, 1), (interleaved_order, 2), (interleaved_order, 3)]
# Interleaved schedules exist only for 2+ ranks and chunks that are a multiple of the ranks.
SCHEDULE_CASES = [
    (order, model_chunks, ranks, chunks)
    for order, model_chunks in ORDERS
    for ranks in (1, 2, 3, 4)
    for chunks in (1, 2, 3, 4, 8, 12)
    if model_chunks == 1 or (ranks > 1 and chunks % ranks == 0)
]


@pytest.mark.parametrize(("order", "model_chunks", "ranks", "chunks"), SCHEDULE_CASES)
def test_schedules_are_complete_and_deadlock_free(order, model_chunks, ranks, chunks) -> None:
    for forward_only in (False, True):
        schedule = build_schedule(order, ranks, chunks, model_chunks, forward_only=forward_only)
        sends = [a for acts in schedule.values() for a in acts if a.type.value.startswith("SEND")]
        recvs = [a for acts in schedule.values() for a in acts if a.type.value.startswith("RECV")]
        assert len(sends) == len(recvs)


@pytest.mark.parametrize("chunks", [1, 2, 4, 8])
def test_live_activations_stay_within_the_bounds(chunks: int) -> None:
    stages = 4
    for rank in range(stages):
        assert live_activation_peak(gpipe_order(rank, stages, chunks)) == chunks
        assert live_activation_peak(one_f_one_b_order(rank, stages, chunks)) == min(chunks, stages - rank)


def test_a_deadlocking_order_is_caught_with_the_grid() -> None:
    # Rank 0 waits for the gradient of microbatch 1 before it sent the forward rank 1 needs for it.
    compute = {
        0: [Action.parse(a) for a in ("0F0", "0B0", "0F1", "0B1")],
        1: [Action.parse(a) for a in ("1F1", "1B1", "1F0", "1B0")],
    }
    schedule = add_communication(compute, 2)
    validate(schedule, 2, 2, 2)
    with pytest.raises(RuntimeError, match=r"deadlocks(.|\n)*rank 0"):
        simulate(schedule, 2)


def test_validate_catches_missing_and_misplaced_actions() -> None:
    schedule = add_communication({0: [Action(0, ActionType.FORWARD, 0)], 1: []}, 2)
    with pytest.raises(ValueError, match="missing"):
        validate(schedule, 2, 2, 1)
    with pytest.raises(ValueError, match="stage 1 is on 1"):
        validate({0: [Action(1, ActionType.FORWARD, 0)]}, 2, 2, 1)


def test_grid_has_a_column_per_rank() -> None:
    grid = format_grid(build_schedule(one_f_one_b_order, 2, 2))
    assert grid.splitlines()[0].split() == ["step", "rank", "0", "rank", "1"]
    assert "1B0" in grid.splitlines()[2]
