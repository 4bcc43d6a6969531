"""Pipeline schedules as data: each rank's ordered list of actions, built, checked and printed by pure functions.

A schedule is ``dict[rank, list[Action]]``. The compute orders (``gpipe_order``, ``one_f_one_b_order``,
``interleaved_order``, ``forward_only_order``) say when each rank runs which stage's forward or backward;
``add_communication`` inserts the sends and receives; ``validate`` and ``simulate`` prove the result is
complete and cannot deadlock; ``format_grid`` prints it (the executor logs it when a step fails).

Stages are *virtual*: with ``P`` ranks and ``V`` model chunks there are ``S = P * V`` stages and stage
``s`` lives on rank ``s % P`` as that rank's chunk ``s // P`` (Megatron's interleaved layout).
"""

from __future__ import annotations

import enum
import re
from collections.abc import Callable
from dataclasses import dataclass

__all__ = [
    "Action",
    "ActionType",
    "add_communication",
    "build_schedule",
    "format_grid",
    "forward_only_order",
    "gpipe_order",
    "interleaved_order",
    "live_activation_peak",
    "one_f_one_b_order",
    "simulate",
    "validate",
]


class ActionType(enum.Enum):
    """What one step of a rank's schedule does."""

    FORWARD = "F"
    """Run a stage's forward on one microbatch (and the criterion on the last stage)."""
    BACKWARD = "B"
    """Run a stage's backward on one microbatch."""
    SEND_F = "SEND_F"
    """Send a stage's outputs to the next stage (asynchronous)."""
    RECV_F = "RECV_F"
    """Post the receive of a stage's inputs from the previous stage (waited on by its forward)."""
    SEND_B = "SEND_B"
    """Send the gradients of a stage's inputs to the previous stage (asynchronous)."""
    RECV_B = "RECV_B"
    """Post the receive of the gradients of a stage's outputs (waited on by its backward)."""

    @property
    def is_compute(self) -> bool:
        return self in (ActionType.FORWARD, ActionType.BACKWARD)


F, B = ActionType.FORWARD, ActionType.BACKWARD
_ACTION_RE = re.compile(r"^(\d+)(SEND_F|RECV_F|SEND_B|RECV_B|F|B)(\d+)$")


@dataclass(frozen=True)
class Action:
    """``stage``'s ``type`` on ``microbatch``; prints and parses as ``"1F0"`` or ``"0RECV_B3"``."""

    stage: int
    type: ActionType
    microbatch: int

    def __str__(self) -> str:
        return f"{self.stage}{self.type.value}{self.microbatch}"

    @classmethod
    def parse(cls, text: str) -> Action:
        match = _ACTION_RE.match(text.strip())
        if match is None:
            raise ValueError(f"action {text!r} is not of the form '<stage><type><microbatch>', e.g. '1F0'")
        return cls(int(match[1]), ActionType(match[2]), int(match[3]))


Order = Callable[[int, int, int, int], list[Action]]


def gpipe_order(rank: int, num_ranks: int, chunks: int, model_chunks: int = 1) -> list[Action]:
    """GPipe: every forward, then every backward in reverse order (the last microbatch's is still warm)."""
    _check_single_chunk("GPipe", model_chunks)
    return [Action(rank, F, m) for m in range(chunks)] + [Action(rank, B, m) for m in reversed(range(chunks))]


def one_f_one_b_order(rank: int, num_ranks: int, chunks: int, model_chunks: int = 1) -> list[Action]:
    """PipeDream-flush (1F1B): ``num_ranks - rank - 1`` warm-up forwards, alternation, then cool-down."""
    _check_single_chunk("PipeDream", model_chunks)
    forwards = [Action(rank, F, m) for m in range(chunks)]
    backwards = [Action(rank, B, m) for m in range(chunks)]
    return _one_f_one_b(forwards, backwards, warmup=num_ranks - rank - 1)


def interleaved_order(rank: int, num_ranks: int, chunks: int, model_chunks: int) -> list[Action]:
    """Megatron's interleaved 1F1B: microbatches go through the rank's chunks in groups of ``num_ranks``.

    Warm-up is ``2 * (num_ranks - rank - 1) + (model_chunks - 1) * num_ranks`` forwards.
    """
    if chunks % num_ranks:
        raise ValueError(
            f"chunks={chunks} must be a multiple of the number of pipeline ranks {num_ranks} for Interleaved1F1B"
        )
    group = num_ranks * model_chunks
    total = chunks * model_chunks

    def virtual(k: int, backward: bool) -> Action:
        rounds, pos = divmod(k, group)
        chunk = pos // num_ranks
        if backward:
            chunk = model_chunks - 1 - chunk
        return Action(chunk * num_ranks + rank, B if backward else F, rounds * num_ranks + pos % num_ranks)

    forwards = [virtual(k, False) for k in range(total)]
    backwards = [virtual(k, True) for k in range(total)]
    return _one_f_one_b(forwards, backwards, warmup=2 * (num_ranks - rank - 1) + (model_chunks - 1) * num_ranks)


def forward_only_order(rank: int, num_ranks: int, chunks: int, model_chunks: int = 1) -> list[Action]:
    """Pipelined evaluation: the forwards of the interleaved order (plain order when ``model_chunks == 1``)."""
    if model_chunks == 1:
        return [Action(rank, F, m) for m in range(chunks)]
    return [a for a in interleaved_order(rank, num_ranks, chunks, model_chunks) if a.type is F]


def _one_f_one_b(forwards: list[Action], backwards: list[Action], warmup: int) -> list[Action]:
    warmup = min(warmup, len(forwards))
    actions = forwards[:warmup]
    for forward, backward in zip(forwards[warmup:], backwards, strict=False):
        actions += [forward, backward]
    return actions + backwards[len(forwards) - warmup :]


def _check_single_chunk(name: str, model_chunks: int) -> None:
    if model_chunks != 1:
        raise ValueError(f"{name} runs one model chunk per rank, got model_chunks={model_chunks}; use Interleaved1F1B")


def add_communication(compute: dict[int, list[Action]], num_stages: int) -> dict[int, list[Action]]:
    """Inserts sends after each compute and posts each receive one compute ahead, so it overlaps work.

    A receive of gradients is not lifted above the forward of the same microbatch (its shapes come from
    that forward's outputs).
    """
    schedule: dict[int, list[Action]] = {}
    for rank, actions in compute.items():
        out: list[Action] = []
        pending = _receives(actions[0], num_stages) if actions else []
        for i, action in enumerate(actions):
            following = _receives(actions[i + 1], num_stages) if i + 1 < len(actions) else []
            lift = [r for r in following if not (r.type is ActionType.RECV_B and action == _forward_of(r))]
            out += pending + lift + [action] + _sends(action, num_stages)
            pending = [r for r in following if r not in lift]
        schedule[rank] = out
    return schedule


def _forward_of(action: Action) -> Action:
    return Action(action.stage, F, action.microbatch)


def _receives(action: Action, num_stages: int) -> list[Action]:
    if action.type is F and action.stage > 0:
        return [Action(action.stage, ActionType.RECV_F, action.microbatch)]
    if action.type is B and action.stage < num_stages - 1:
        return [Action(action.stage, ActionType.RECV_B, action.microbatch)]
    return []


def _sends(action: Action, num_stages: int) -> list[Action]:
    if action.type is F and action.stage < num_stages - 1:
        return [Action(action.stage, ActionType.SEND_F, action.microbatch)]
    if action.type is B and action.stage > 0:
        return [Action(action.stage, ActionType.SEND_B, action.microbatch)]
    return []


def build_schedule(
    order: Order, num_ranks: int, chunks: int, model_chunks: int = 1, forward_only: bool = False
) -> dict[int, list[Action]]:
    """Every rank's actions with communication, validated and simulated (raises on any flaw)."""
    if forward_only:
        order = forward_only_order
    num_stages = num_ranks * model_chunks
    compute = {r: order(r, num_ranks, chunks, model_chunks) for r in range(num_ranks)}
    schedule = add_communication(compute, num_stages)
    validate(schedule, num_ranks, num_stages, chunks, forward_only=forward_only)
    simulate(schedule, num_stages)
    return schedule


def validate(
    schedule: dict[int, list[Action]], num_ranks: int, num_stages: int, chunks: int, forward_only: bool = False
) -> None:
    """Checks placement, completeness and order: each (stage, microbatch) forward once, backward once after it."""
    types = (F,) if forward_only else (F, B)
    seen: set[tuple[int, ActionType, int]] = set()
    for rank, actions in schedule.items():
        posted: set[Action] = set()
        for action in actions:
            if action.stage % num_ranks != rank:
                raise ValueError(f"{action} is on rank {rank}; stage {action.stage} is on {action.stage % num_ranks}")
            if action.type in (ActionType.RECV_F, ActionType.RECV_B):
                posted.add(action)
            if not action.type.is_compute:
                continue
            key = (action.stage, action.type, action.microbatch)
            if key in seen:
                raise ValueError(f"{action} appears twice\n{format_grid(schedule)}")
            if action.type is B and (action.stage, F, action.microbatch) not in seen:
                raise ValueError(f"{action} runs before its forward\n{format_grid(schedule)}")
            needed = _receives(action, num_stages)
            if any(r not in posted for r in needed):
                raise ValueError(f"{action} has no receive posted before it\n{format_grid(schedule)}")
            seen.add(key)
    missing = [(s, t, m) for s in range(num_stages) for t in types for m in range(chunks) if (s, t, m) not in seen]
    if missing:
        s, t, m = missing[0]
        raise ValueError(f"{len(missing)} actions are missing, e.g. {Action(s, t, m)}\n{format_grid(schedule)}")


def simulate(schedule: dict[int, list[Action]], num_stages: int) -> int:
    """Runs the schedule with non-blocking sends and receives and blocking computes; returns the rounds.

    A compute waits until the matching send has been issued. Raises ``RuntimeError`` with the grid when
    no rank can make progress (a deadlock).
    """
    position = dict.fromkeys(schedule, 0)
    sent: set[tuple[ActionType, int, int]] = set()
    rounds = 0
    while any(position[r] < len(schedule[r]) for r in schedule):
        progressed = False
        for rank, actions in schedule.items():
            while position[rank] < len(actions):
                action = actions[position[rank]]
                if not _ready(action, sent, num_stages):
                    break
                if action.type is ActionType.SEND_F:
                    sent.add((F, action.stage + 1, action.microbatch))
                elif action.type is ActionType.SEND_B:
                    sent.add((B, action.stage - 1, action.microbatch))
                position[rank] += 1
                progressed = True
                if action.type.is_compute:
                    break
        if not progressed:
            stuck = {r: str(schedule[r][position[r]]) for r in schedule if position[r] < len(schedule[r])}
            raise RuntimeError(f"schedule deadlocks; blocked actions by rank: {stuck}\n{format_grid(schedule)}")
        rounds += 1
    return rounds


def _ready(action: Action, sent: set[tuple[ActionType, int, int]], num_stages: int) -> bool:
    if action.type is F and action.stage > 0:
        return (F, action.stage, action.microbatch) in sent
    if action.type is B and action.stage < num_stages - 1:
        return (B, action.stage, action.microbatch) in sent
    return True


def live_activation_peak(actions: list[Action]) -> int:
    """The most microbatches whose forward ran and whose backward did not yet, over one rank's actions."""
    live = peak = 0
    for action in actions:
        live += {F: 1, B: -1}.get(action.type, 0)
        peak = max(peak, live)
    return peak


def format_grid(schedule: dict[int, list[Action]], compute_only: bool = True) -> str:
    """One column per rank, one row per step: the table logged when a step fails."""
    columns = {
        rank: [str(a) for a in actions if a.type.is_compute or not compute_only] for rank, actions in schedule.items()
    }
    width = max([len(c) for col in columns.values() for c in col] + [6]) + 2
    header = "step".ljust(6) + "".join(f"rank {r}".ljust(width) for r in columns)
    rows = [header]
    for step in range(max((len(c) for c in columns.values()), default=0)):
        cells = "".join((col[step] if step < len(col) else "").ljust(width) for col in columns.values())
        rows.append(str(step).ljust(6) + cells)
    return "\n".join(rows)
