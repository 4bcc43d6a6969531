"""Pipeline schedules as data: each rank's ordered list of actions, built, checked and printed by pure functions.

A schedule is ``dict[rank, list[Action]]``. The compute orders (``gpipe_order``, ``one_f_one_b_order``,
``interleaved_order``, ``forward_only_order``) say when each rank runs which stage's forward or backward;
``add_communication`` inserts the sends and receives; ``validate`` and ``simulate`` prove the result is
complete and runs under NCCL's point-to-point rules; ``format_grid`` prints it (the executor logs it when a step fails).

Stages are *virtual*: with ``P`` ranks and ``V`` model chunks there are ``S = P * V`` stages and stage
``s`` lives on rank ``s % P`` as that rank's chunk ``s // P`` (Megatron's interleaved layout).

[Note: communication order] The schedule must run on NCCL, whose point-to-point rules are strict: tags
are ignored (between two ranks the k-th send meets the k-th receive), and a rank runs its transfers on
one stream in the order it issued them (a ``batch_isend_irecv`` group runs as one; it completes when each
transfer in it has met its match). A receive posted early therefore blocks every later send of its rank,
and the two ends of a link must issue its messages, in both directions, in one order. So:

- ``compute_rounds`` gives every compute a round (each compute and each message takes one round), and a
  message belongs to the round of the compute that produced it.
- ``add_communication`` puts each send and receive after its rank's last compute of a round up to the
  message's, and orders the transfers between two computes by (round, direction, receiving stage,
  microbatch): the same key at both ends, so each link's messages come in one order at both.
- ``lower`` turns a rank's actions into what the executor issues: computes, and batches (one
  ``batch_isend_irecv`` each) of the transfers between them. A shape header ends its batch; the payload
  it describes opens the next, which the receiver issues once the header has arrived (it sizes the
  buffer). Headers go with microbatch 0 of each edge, or with every microbatch when shapes vary.
- ``simulate`` runs the lowered schedule under the rules above and raises on a mismatch or a deadlock;
  ``build_schedule`` calls it, so a schedule that cannot run on NCCL fails when a pipeline is built.

On gloo, which runs transfers concurrently (no shared stream) and whose transfers are rendezvous,
``post_ahead`` posts receives a compute earlier so they overlap it; each peer's messages keep their order,
and gloo pairs them by that order too (every message has tag 0), so gloo runs check it.
"""

from __future__ import annotations

import bisect
import enum
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = [
    "Action",
    "ActionType",
    "Batch",
    "Transfer",
    "TransferKey",
    "add_communication",
    "build_schedule",
    "check_chunks",
    "compute_rounds",
    "format_grid",
    "forward_only_order",
    "gpipe_order",
    "has_header",
    "header_of",
    "interleaved_order",
    "live_activation_peak",
    "lower",
    "one_f_one_b_order",
    "post_ahead",
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
    check_chunks(chunks, num_ranks, interleaved=True)
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


def check_chunks(chunks: Any, num_ranks: int | None = None, interleaved: bool = False) -> int:
    """``chunks``, the microbatches per batch: a positive int, and for Interleaved1F1B a multiple of the pipeline's
    ``num_ranks`` (when known). The one rule, which the pipelines, the batch splitter and the strategies (at their
    construction) all call."""
    if isinstance(chunks, bool) or not isinstance(chunks, int):
        raise TypeError(
            f"chunks={chunks!r} ({type(chunks).__name__}) must be an integer; the number of microbatches per batch, "
            "e.g. chunks=4"
        )
    if chunks < 1:
        raise ValueError(f"chunks={chunks} must be at least 1; the number of microbatches per batch, e.g. chunks=4")
    if interleaved and num_ranks is not None and chunks % num_ranks:
        raise ValueError(
            f"chunks={chunks} must be a multiple of the number of pipeline ranks {num_ranks} for Interleaved1F1B"
        )
    return chunks


def _check_single_chunk(name: str, model_chunks: int) -> None:
    if model_chunks != 1:
        raise ValueError(f"{name} runs one model chunk per rank, got model_chunks={model_chunks}; use Interleaved1F1B")


def add_communication(compute: dict[int, list[Action]], num_stages: int) -> dict[int, list[Action]]:
    """Inserts every send and receive where both ends of its link issue it in the same order.

    See [Note: communication order]. Raises ``RuntimeError`` with the grid when the compute orders
    deadlock (a forward or backward waits for a message that is never sent before it).
    """
    rounds = compute_rounds(compute, num_stages)
    round_of = {a: at for rank, actions in compute.items() for a, at in zip(actions, rounds[rank], strict=True)}
    # slots[rank][i]: the transfers after the rank's i-th compute (slot 0: before its first), with sort keys
    slots: dict[int, list[list[tuple[tuple[int, ...], Action]]]] = {
        rank: [[] for _ in range(len(actions) + 1)] for rank, actions in compute.items()
    }
    for rank, actions in compute.items():
        for action in actions:
            transfers = [(round_of[action], send) for send in _sends(action, num_stages)]
            producer = _message_of(action, num_stages)
            if producer is not None:
                transfers.append((round_of[producer], _recv_for(action)))
            for at, transfer in transfers:  # after the rank's last compute in a round <= the message's
                slot = bisect.bisect_right(rounds[rank], at)
                slots[rank][slot].append(((at, *_message_key(transfer)), transfer))
    schedule: dict[int, list[Action]] = {}
    for rank, actions in compute.items():
        ordered = [[a for _, a in sorted(slot, key=lambda item: item[0])] for slot in slots[rank]]
        schedule[rank] = ordered[0] + [
            a for action, after in zip(actions, ordered[1:], strict=True) for a in [action, *after]
        ]
    return schedule


def _message_key(transfer: Action) -> tuple[int, int, int]:
    """The same key at both ends of a message: (direction, receiving stage, microbatch)."""
    if transfer.type is ActionType.SEND_F:
        return (0, transfer.stage + 1, transfer.microbatch)
    if transfer.type is ActionType.RECV_F:
        return (0, transfer.stage, transfer.microbatch)
    if transfer.type is ActionType.SEND_B:
        return (1, transfer.stage - 1, transfer.microbatch)
    return (1, transfer.stage, transfer.microbatch)


def _message_of(action: Action, num_stages: int) -> Action | None:
    """The compute on the neighbouring stage whose output ``action`` consumes (``None``: it needs none)."""
    if action.type is F and action.stage > 0:
        return Action(action.stage - 1, F, action.microbatch)
    if action.type is B and action.stage < num_stages - 1:
        return Action(action.stage + 1, B, action.microbatch)
    return None


def _recv_for(action: Action) -> Action:
    return Action(action.stage, ActionType.RECV_F if action.type is F else ActionType.RECV_B, action.microbatch)


def compute_rounds(compute: dict[int, list[Action]], num_stages: int) -> dict[int, list[int]]:
    """The round in which each compute runs when every compute takes one round and a message one round.

    Raises ``RuntimeError`` with the grid when no rank can run its next compute (a deadlock).
    """
    rounds: dict[int, list[int]] = {rank: [] for rank in compute}
    finished: dict[Action, int] = {}
    now = 0
    while any(len(rounds[r]) < len(compute[r]) for r in compute):
        ran = []
        for rank, actions in compute.items():
            if len(rounds[rank]) == len(actions):
                continue
            action = actions[len(rounds[rank])]
            needed = _message_of(action, num_stages)
            if needed is None or finished.get(needed, now) < now:
                ran.append((rank, action))
        if not ran:
            stuck = {r: str(compute[r][len(rounds[r])]) for r in compute if len(rounds[r]) < len(compute[r])}
            raise RuntimeError(f"schedule deadlocks; blocked actions by rank: {stuck}\n{format_grid(compute)}")
        for rank, action in ran:
            rounds[rank].append(now)
            finished[action] = now
        now += 1
    return rounds


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
    for header_every_microbatch in (True,) if forward_only else (False, True):
        simulate(schedule, num_stages, header_every_microbatch)
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


@dataclass(frozen=True)
class Transfer:
    """One message of a send or receive action: the activation's shape header, or the payload itself."""

    action: Action
    header: bool = False

    def __str__(self) -> str:
        return f"{self.action}{'.header' if self.header else ''}"

    @property
    def is_send(self) -> bool:
        return self.action.type in (ActionType.SEND_F, ActionType.SEND_B)

    @property
    def peer_stage(self) -> int:
        """The stage at the other end of the message."""
        forward = self.action.type in (ActionType.SEND_F, ActionType.RECV_B)
        return self.action.stage + 1 if forward else self.action.stage - 1

    @property
    def message(self) -> tuple[int, int, int, bool]:
        """Identical at both ends of the message (and different for every other message of the step)."""
        return (*_message_key(self.action), self.header)

    @property
    def key(self) -> TransferKey:
        """This end of the message as a plain tuple, unique among a step's transfers (the stage's rank is implied):
        cheap to hash and compare, for tables of a step's transfers (the simulator's, the receive buffers')."""
        return (self.action.stage, self.action.type.value, self.action.microbatch, self.header)


TransferKey = tuple[int, str, int, bool]
"""``Transfer.key``: (stage, action type's value, microbatch, header)."""


Batch = tuple[Transfer, ...]


def has_header(action: Action, header_every_microbatch: bool) -> bool:
    """Whether an activation message carries a shape header: microbatch 0's, or every one's when shapes vary."""
    activation = action.type in (ActionType.SEND_F, ActionType.RECV_F)
    return activation and (header_every_microbatch or action.microbatch == 0)


def header_of(transfer: Transfer, header_every_microbatch: bool) -> Transfer | None:
    """The header whose arrival the receive ``transfer`` must wait for before it is posted (its buffer's size)."""
    if transfer.is_send or transfer.header or transfer.action.type is not ActionType.RECV_F:
        return None
    m = transfer.action.microbatch if header_every_microbatch else 0
    return Transfer(Action(transfer.action.stage, ActionType.RECV_F, m), header=True)


def lower(actions: list[Action], header_every_microbatch: bool) -> list[Action | Batch]:
    """One rank's actions as the executor issues them: computes, and batches of transfers issued together.

    Consecutive send and receive actions form one batch; a shape header ends its batch, so that the payload
    it describes, first in the next batch, is posted once the header has arrived (see [Note: communication
    order]).
    """
    program: list[Action | Batch] = []
    batch: list[Transfer] = []
    for action in actions:
        if action.type.is_compute:
            program += [tuple(batch), action] if batch else [action]
            batch = []
            continue
        if has_header(action, header_every_microbatch):
            program.append((*batch, Transfer(action, header=True)))
            batch = []
        batch.append(Transfer(action))
    return [*program, tuple(batch)] if batch else program


def post_ahead(program: list[Action | Batch], header_every_microbatch: bool) -> list[Action | Batch]:
    """``lower``'s program with receives posted one compute earlier, for backends that run transfers
    concurrently and pair them by order per link and direction only (gloo: no shared stream, so an early
    receive blocks nothing). Each receive that needs no header moves just before the previous compute, so
    its transfer (a rendezvous on gloo) overlaps that compute: into the batch issued there, if there is
    one without a header (one ``batch_isend_irecv`` call instead of two), else a batch of its own. The
    order of the
    receives is kept: a receive behind one that stays stays too. A gradient receive never moves above the
    forward of its microbatch (its buffer's shapes come from that forward).
    """
    groups: list[list[Batch]] = [[]]
    computes: list[Action] = []
    for item in program:
        if isinstance(item, Action):
            computes.append(item)
            groups.append([])
        else:
            groups[-1].append(item)
    for k in range(1, len(computes)):
        stayed = False  # receives from one rank pair in order: only a prefix of a group's receives moves
        moved: list[Transfer] = []
        kept_batches = []
        for batch in groups[k]:
            kept = []
            for t in batch:
                if not t.is_send and not stayed and _movable(t, computes[k - 1], header_every_microbatch):
                    moved.append(t)
                else:
                    kept.append(t)
                    stayed = stayed or not t.is_send
            if kept:
                kept_batches.append(tuple(kept))
        groups[k] = kept_batches
        if moved:
            _append_receives(groups[k - 1], tuple(moved))
    out: list[Action | Batch] = list(groups[0])
    for compute, batches in zip(computes, groups[1:], strict=True):
        out += [compute, *batches]
    return out


def _append_receives(batches: list[Batch], receives: Batch) -> None:
    """Adds ``receives`` to the last batch unless it ends with a header (a payload receive it sizes must wait
    for it), else as a batch of its own. Within a batch the order is kept, so each link's order is too."""
    if batches and not batches[-1][-1].header:
        batches[-1] = (*batches[-1], *receives)
    else:
        batches.append(receives)


def _movable(t: Transfer, previous: Action, header_every_microbatch: bool) -> bool:
    """Whether a receive may be posted before ``previous``: a header, or a payload sized by an earlier header."""
    if t.action.type is ActionType.RECV_B:
        return previous != Action(t.action.stage, F, t.action.microbatch)
    return t.header or not has_header(t.action, header_every_microbatch)


def simulate(schedule: dict[int, list[Action]], num_stages: int, header_every_microbatch: bool = False) -> int:
    """Runs the schedule under NCCL's point-to-point rules; returns the number of rounds it took.

    The rules: between two ranks the k-th send meets the k-th receive whatever its tag; each rank runs its
    batches in the order issued, one at a time, on one stream (a batch completes when every transfer in it
    met its match); a compute waits for its input's receive; a batch with a payload receive is issued once
    that payload's header has arrived. Raises ``RuntimeError`` with the grid when a send meets a receive of
    another message, or when no rank can make progress (a deadlock).
    """
    sim = _NcclModel(schedule, num_stages, header_every_microbatch)
    rounds = 0
    while not sim.finished():
        if not sim.step():
            raise RuntimeError(f"schedule deadlocks under NCCL's rules; {sim.blocked()}\n{format_grid(schedule)}")
        rounds += 1
    return rounds


class _NcclModel:
    """The state of ``simulate``: each rank's position, its stream of issued batches and each link's queues."""

    def __init__(self, schedule: dict[int, list[Action]], num_stages: int, header_every_microbatch: bool) -> None:
        self.schedule, self.num_stages, self.every = schedule, num_stages, header_every_microbatch
        self.programs = {rank: lower(actions, header_every_microbatch) for rank, actions in schedule.items()}
        self.position = dict.fromkeys(schedule, 0)
        self.streams: dict[int, list[set[TransferKey]]] = {rank: [] for rank in schedule}
        self.done: set[TransferKey] = set()
        self.links: dict[tuple[int, int], tuple[list[Transfer], list[Transfer], list[int]]] = {}

    def finished(self) -> bool:
        return all(self.position[r] == len(self.programs[r]) and not self.streams[r] for r in self.programs)

    def step(self) -> bool:
        """One round: every rank issues what it can and runs at most one compute; then transfers complete."""
        progressed = False
        for rank, program in self.programs.items():
            while self.position[rank] < len(program):
                item = program[self.position[rank]]
                if not self._ready(rank, item):
                    break
                self.position[rank] += 1
                progressed = True
                if isinstance(item, Action):
                    break
                self._issue(rank, item)
        return self._complete() or progressed

    def _rank(self, stage: int) -> int:
        return stage % len(self.schedule)

    def _ready(self, rank: int, item: Action | Batch) -> bool:
        if isinstance(item, Action):
            needed = _receives(item, self.num_stages)
            return all(Transfer(r).key in self.done for r in needed)
        headers = [header_of(t, self.every) for t in item]
        return all(h.key in self.done for h in headers if h is not None)

    def _issue(self, rank: int, batch: Batch) -> None:
        self.streams[rank].append({t.key for t in batch})
        for t in batch:
            peer = self._rank(t.peer_stage)
            link = (rank, peer) if t.is_send else (peer, rank)
            sends, recvs, _ = self.links.setdefault(link, ([], [], [0]))
            (sends if t.is_send else recvs).append(t)

    def _complete(self) -> bool:
        """Matches the k-th send and receive of each link while both are in their stream's running batch."""
        changed, any_change = True, False
        while changed:
            changed = False
            for (src, dst), (sends, recvs, matched) in self.links.items():
                while matched[0] < min(len(sends), len(recvs)):
                    send, recv = sends[matched[0]], recvs[matched[0]]
                    if send.message != recv.message:
                        raise RuntimeError(
                            f"schedule mismatches under NCCL's rules: rank {src}'s send #{matched[0]} to rank {dst} is "
                            f"{send}, but rank {dst}'s receive #{matched[0]} from rank {src} is {recv}\n"
                            f"{format_grid(self.schedule)}"
                        )
                    if not (self._running(src, send) and self._running(dst, recv)):
                        break
                    self.done |= {send.key, recv.key}
                    matched[0] += 1
                    changed = True
            for stream in self.streams.values():
                while stream and stream[0] <= self.done:
                    stream.pop(0)
                    changed = True
            any_change |= changed
        return any_change

    def _running(self, rank: int, transfer: Transfer) -> bool:
        stream = self.streams[rank]
        return bool(stream) and transfer.key in stream[0]

    def blocked(self) -> str:
        parts = []
        for rank, program in self.programs.items():
            at = self.position[rank]
            waiting = str(program[at]) if at < len(program) and isinstance(program[at], Action) else "issuing"
            running = sorted(_name(k) for k in self.streams[rank][0] - self.done) if self.streams[rank] else []
            parts.append(f"rank {rank}: next {waiting}, stream waits on {running}")
        return "; ".join(parts)


def _name(key: TransferKey) -> str:
    return str(Transfer(Action(key[0], ActionType(key[1]), key[2]), key[3]))


def live_activation_peak(actions: list[Action]) -> int:
    """The most microbatches whose forward ran and whose backward did not yet, over one rank's actions."""
    live = peak = 0
    for action in actions:
        live += {F: 1, B: -1}.get(action.type, 0)
        peak = max(peak, live)
    return peak


def format_grid(schedule: dict[int, list[Action]]) -> str:
    """One column per rank, one row per compute step: the table logged when a step fails."""
    columns = {rank: [str(a) for a in actions if a.type.is_compute] for rank, actions in schedule.items()}
    width = max([len(c) for col in columns.values() for c in col] + [6]) + 2
    header = "step".ljust(6) + "".join(f"rank {r}".ljust(width) for r in columns)
    rows = [header]
    for step in range(max((len(c) for c in columns.values()), default=0)):
        cells = "".join((col[step] if step < len(col) else "").ljust(width) for col in columns.values())
        rows.append(str(step).ljust(6) + cells)
    return "\n".join(rows)
