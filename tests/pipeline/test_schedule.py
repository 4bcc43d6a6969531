"""Schedules as data, checked without processes: textbook orders, completeness, no deadlock, live bounds."""

import pytest

from lightning_haiscale.pipeline.schedule import (
    Action,
    ActionType,
    Transfer,
    add_communication,
    build_schedule,
    format_grid,
    gpipe_order,
    interleaved_order,
    live_activation_peak,
    lower,
    one_f_one_b_order,
    post_ahead,
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
    with pytest.raises(RuntimeError, match=r"deadlocks(.|\n)*rank 0"):
        add_communication(compute, 2)


def _parse(schedule: dict[int, str]) -> dict[int, list[Action]]:
    return {rank: [Action.parse(a) for a in text.split()] for rank, text in schedule.items()}


def test_receives_posted_a_compute_ahead_deadlock_under_nccl() -> None:
    """The previous layout (each receive lifted one compute ahead) for PipeDream on 2 ranks, 2 microbatches:
    rank 1's receive for 1F1, posted before 1B0, holds its one stream, so the gradient it sends after 1B0
    queues behind it, while rank 0's send of 0F1 queues behind its receive of that gradient."""
    schedule = _parse(
        {
            0: "0F0 0SEND_F0 0RECV_B0 0F1 0SEND_F1 0RECV_B1 0B0 0B1",
            1: "1RECV_F0 1F0 1RECV_F1 1B0 1SEND_B0 1F1 1B1 1SEND_B1",
        }
    )
    validate(schedule, 2, 2, 2)
    with pytest.raises(
        RuntimeError, match=r"deadlocks under NCCL's rules(.|\n)*rank 1: next 1F1, stream waits on \['1RECV_F1'\]"
    ):
        simulate(schedule, 2)
    built = build_schedule(one_f_one_b_order, 2, 2)
    assert simulate(built, 2) > 0


def test_receives_in_another_order_than_the_sends_are_a_mismatch() -> None:
    schedule = _parse({0: "0F0 0SEND_F0 0F1 0SEND_F1", 1: "1RECV_F1 1RECV_F0 1F0 1F1"})
    validate(schedule, 2, 2, 2, forward_only=True)
    with pytest.raises(
        RuntimeError, match=r"rank 0's send #0 to rank 1 is 0SEND_F0.header.*receive #0.*1RECV_F1.header"
    ):
        simulate(schedule, 2, header_every_microbatch=True)


def test_both_ends_of_every_link_issue_the_same_messages_in_the_same_order() -> None:
    for order, model_chunks, ranks, chunks in SCHEDULE_CASES:
        schedule = build_schedule(order, ranks, chunks, model_chunks)
        for a in range(ranks):
            for b in range(ranks):
                ends = [
                    [Transfer(x).message for x in schedule[r] if not x.type.is_compute and _link(x, ranks) == (a, b)]
                    for r in (a, b)
                ]
                assert ends[0] == ends[1], (order.__name__, ranks, chunks, a, b)


def _link(action: Action, ranks: int) -> tuple[int, int]:
    t = Transfer(action)
    me, peer = action.stage % ranks, t.peer_stage % ranks
    return (me, peer) if t.is_send else (peer, me)


def test_a_payload_receive_waits_for_its_header_in_a_batch_of_its_own() -> None:
    program = lower(_parse({1: "1RECV_F0 1F0 1RECV_F1 1F1"})[1], header_every_microbatch=False)
    assert [str(i) if isinstance(i, Action) else [str(t) for t in i] for i in program] == [
        ["1RECV_F0.header"], ["1RECV_F0"], "1F0", ["1RECV_F1"], "1F1",
    ]  # fmt: skip


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


@pytest.mark.parametrize("header_every_microbatch", [False, True])
def test_posting_ahead_keeps_each_links_receive_order(header_every_microbatch: bool) -> None:
    """gloo's program (receives a compute earlier) pairs the same messages: from each peer rank the
    receives come in the lowered order, each once; a gradient receive never precedes its forward."""
    for order, model_chunks, ranks, chunks in SCHEDULE_CASES:
        for rank, actions in build_schedule(order, ranks, chunks, model_chunks).items():
            lowered = lower(actions, header_every_microbatch)
            ahead = post_ahead(lowered, header_every_microbatch)
            assert [i for i in ahead if isinstance(i, Action)] == [i for i in lowered if isinstance(i, Action)]

            for peer in range(ranks):  # gloo pairs messages by order per rank pair and direction
                same = _receives_from(ahead, peer, ranks) == _receives_from(lowered, peer, ranks)
                assert same, (order.__name__, ranks, chunks, rank, peer)
            done: set[Action] = set()
            for item in ahead:
                if isinstance(item, Action):
                    done.add(item)
                    continue
                for t in item:
                    if t.action.type is ActionType.RECV_B:
                        assert Action(t.action.stage, ActionType.FORWARD, t.action.microbatch) in done
                assert not any(t.header for t in item[:-1])  # a header still ends its batch


def test_posting_ahead_joins_a_receive_to_the_sends_issued_where_it_lands() -> None:
    """One ``batch_isend_irecv`` call instead of two (was: 17 calls a step on this rank, now 15)."""
    ahead = post_ahead(lower(build_schedule(one_f_one_b_order, 2, 8)[0], False), False)
    batches = [[str(t) for t in item] for item in ahead if not isinstance(item, Action)]
    assert ["0SEND_F0", "0RECV_B0"] in batches and ["0SEND_F7", "0RECV_B7"] in batches
    assert ["0SEND_F0.header"] in batches and len(batches) == 15
    gpipe = post_ahead(lower(build_schedule(gpipe_order, 2, 8)[0], False), False)
    assert (Transfer(Action.parse("0SEND_F7")), *map(Transfer, map(Action.parse, ("0RECV_B7", "0RECV_B6")))) in gpipe


def _receives_from(program: list, peer: int, ranks: int) -> list[Transfer]:
    transfers = [t for item in program if not isinstance(item, Action) for t in item]
    return [t for t in transfers if not t.is_send and t.peer_stage % ranks == peer]
