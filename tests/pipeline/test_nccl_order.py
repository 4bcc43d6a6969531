"""Every schedule's point-to-point traffic, logged on gloo and replayed under NCCL's rules.

NCCL ignores tags: between two ranks the k-th send meets the k-th receive, and each rank runs its
transfers on one stream in the order it issued them (a batch from ``batch_isend_irecv`` runs as one
group; it completes when every transfer in it has met its match). gloo matches by tag and runs transfers
concurrently, so a pipeline can pass every gloo test and still fail at once on GPUs. Here each rank logs
its ``isend``/``irecv``/``batch_isend_irecv`` calls (peer, direction, bytes, order of issue) and the waits
on them, for evaluation, training and uneven training of every schedule, tuple boundaries and DP x PP,
issued as on NCCL (on gloo the executor posts receives a compute ahead: ``schedule.post_ahead``), and
checks the evaluation's output against one process. The parent replays the logs with FIFO-per-link,
one-stream semantics: sizes must match and nothing may deadlock. The replay is written here,
independently of ``schedule.simulate``, which models the same rules.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Generator
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
import torch.nn.functional as F

from lightning_haiscale.ddp import DistributedDataParallel
from lightning_haiscale.pipeline import PipeDream, make_subgroups, p2p, partition
from lightning_haiscale.testing.parity import FLOAT64_TOLERANCES, default_dtype
from tests.distributed import run_distributed
from tests.pipeline.test_pipelines import SCHEDULES, batch, build, mlp, tuple_model

Op = tuple[int, bool, int, int]  # (op id, is send, peer's global rank, bytes)
Event = tuple[str, list[Any]]  # ("issue", [Op, ...]) for one batch, or ("wait", [op id, ...])


class _Logged:
    """A work whose ``wait`` is logged."""

    def __init__(self, work: Any, log: list[Event], op_id: int) -> None:
        self.work, self.log, self.op_id = work, log, op_id

    def wait(self, *args: Any) -> Any:
        self.log.append(("wait", [self.op_id]))
        return self.work.wait(*args)

    def is_completed(self) -> bool:
        return self.work.is_completed()


@contextlib.contextmanager
def logged_p2p() -> Generator[list[Event], None, None]:
    """Logs every point-to-point call of this process while inside (torch's own and ours alike)."""
    log: list[Event] = []
    batch_ops: list[Op] | None = None
    originals = {name: getattr(c10d, name) for name in ("isend", "irecv", "batch_isend_irecv")}
    counter = itertools.count()

    def wrap(name: str) -> Callable[..., Any]:
        def call(tensor: torch.Tensor, peer: int | None = None, group: Any = None, tag: int = 0, **kw: Any) -> Any:
            group_peer = kw.get("group_dst" if name == "isend" else "group_src")
            if group_peer is not None:
                peer = dist.get_global_rank(group or dist.group.WORLD, group_peer)
            op = (next(counter), name == "isend", peer, tensor.numel() * tensor.element_size())
            if batch_ops is None:
                log.append(("issue", [op]))
            else:
                batch_ops.append(op)
            return _Logged(originals[name](tensor, group=group, tag=tag, **kw), log, op[0])

        return call

    def batched(ops: list[Any]) -> list[Any]:
        nonlocal batch_ops
        batch_ops = []
        try:
            works = originals["batch_isend_irecv"](ops)
            log.append(("issue", batch_ops))
        finally:
            batch_ops = None
        return works

    patches = {"isend": wrap("isend"), "irecv": wrap("irecv"), "batch_isend_irecv": batched}
    for name, fn in patches.items():  # batch_isend_irecv compares an op's function with c10d's isend
        setattr(c10d, name, fn)
        setattr(dist, name, fn)
    concurrent, p2p.runs_concurrently = p2p.runs_concurrently, lambda group: False  # issue as on NCCL
    try:
        yield log
    finally:
        p2p.runs_concurrently = concurrent
        for name, fn in originals.items():
            setattr(c10d, name, fn)
            setattr(dist, name, fn)


def replay(logs: dict[int, list[Event]]) -> str | None:
    """Runs the logged calls under NCCL's rules; returns what went wrong, or ``None``."""
    position = dict.fromkeys(logs, 0)
    streams: dict[int, list[set[tuple[int, int]]]] = {rank: [] for rank in logs}
    done: set[tuple[int, int]] = set()
    links: dict[tuple[int, int], tuple[list[tuple[int, int, int]], list[tuple[int, int, int]]]] = {}
    matched: dict[tuple[int, int], int] = {}
    while True:
        progressed = False
        for rank, events in logs.items():  # each rank's host issues and waits in its logged order
            while position[rank] < len(events):
                kind, items = events[position[rank]]
                if kind == "wait" and not all((rank, i) in done for i in items):
                    break
                if kind == "issue":
                    streams[rank].append({(rank, op_id) for op_id, *_ in items})
                    for op_id, is_send, peer, nbytes in items:
                        sends, recvs = links.setdefault((rank, peer) if is_send else (peer, rank), ([], []))
                        (sends if is_send else recvs).append((rank, op_id, nbytes))
                position[rank] += 1
                progressed = True
        for link, (sends, recvs) in links.items():  # the k-th send meets the k-th receive of its link
            k = matched.get(link, 0)
            while k < min(len(sends), len(recvs)):
                send, recv = sends[k], recvs[k]
                if send[2] != recv[2]:
                    sizes = f"of {send[2]} bytes meets a {recv[2]}-byte receive"
                    return f"rank {link[0]}'s send #{k} to rank {link[1]} {sizes}"
                if not all(streams[r] and (r, i) in streams[r][0] for r, i, _ in (send, recv)):
                    break  # one of them is queued behind an earlier batch on its rank's stream
                done.update({send[:2], recv[:2]})
                k += 1
                progressed = True
            matched[link] = k
        for stream in streams.values():
            while stream and stream[0] <= done:
                stream.pop(0)
                progressed = True
        if all(position[r] == len(logs[r]) and not streams[r] for r in logs):
            return None
        if not progressed:
            return "deadlock: " + "; ".join(
                f"rank {r} at event {position[r]}/{len(logs[r])}, {len(streams[r])} batches queued" for r in logs
            )


def test_replay_catches_a_mismatch_and_a_deadlock() -> None:
    ok = {0: [("issue", [(0, True, 1, 8)]), ("wait", [0])], 1: [("issue", [(0, False, 0, 8)]), ("wait", [0])]}
    assert replay(ok) is None
    sizes = {0: [("issue", [(0, True, 1, 8)])], 1: [("issue", [(0, False, 0, 16)])]}
    assert "8 bytes meets a 16-byte receive" in replay(sizes)
    # Each rank posts a receive first, on its one stream, then the send the other waits for.
    crossed = {r: [("issue", [(0, False, 1 - r, 8)]), ("issue", [(1, True, 1 - r, 8)])] for r in (0, 1)}
    assert replay(crossed).startswith("deadlock")
    assert replay({r: [("issue", [(0, False, 1 - r, 8), (1, True, 1 - r, 8)])] for r in (0, 1)}) is None  # a batch


def _cases(pipe: Any, dp_rank: int, dp_size: int) -> dict[str, Callable[[], Any]]:
    """An uneven evaluation (2, 2, 2, 1 rows), a training step and an uneven training step (3, 3, 1, 1)."""
    x, y = batch(0, dp_rank, dp_size)

    def uneven() -> Any:
        sizes = [3, 3, 1, 1]
        parts = list(zip(x[:8].split(sizes), y[:8].split(sizes), strict=True))
        inputs = [(p[0],) for p in parts] if pipe.is_first_stage else None
        return pipe.run_microbatches(inputs, lambda m, out: F.mse_loss(out, parts[m][1]), loss_scale=0.25, uneven=True)

    return {
        "evaluation": lambda: pipe(x[:7]),
        "train": lambda: pipe.forward_backward(x[:8], criterion=F.mse_loss, labels=(y[:8],)),
        "uneven train": uneven,
    }


def _check_output(out: Any, pipe: Any, reference: torch.nn.Module, x: torch.Tensor) -> None:
    if pipe.is_last_stage:
        torch.testing.assert_close(out, reference(x).detach(), **FLOAT64_TOLERANCES)  # float64: _log_world
    else:
        assert out is None


@default_dtype(torch.float64)
def _log_world(rank: int, world: int, layouts: tuple[int, ...]) -> dict[str, list[Event]]:
    logs: dict[str, list[Event]] = {}
    for pp_size in layouts:
        dp_group, pp_group = make_subgroups(pp_size)
        dp_size, dp_rank = world // pp_size, rank // pp_size
        for schedule in SCHEDULES:
            pipe, _ = build(schedule, 4, pp_group, dp_group if dp_size > 1 else None)
            for phase, run in _cases(pipe, dp_rank, dp_size).items():
                with logged_p2p() as log:
                    out = run()
                logs[f"pp {pp_size} x dp {dp_size} / {schedule} / {phase}"] = log
                if phase == "evaluation":  # the first call: parameters are still those of one process's model
                    _check_output(out, pipe, mlp(), batch(0, dp_rank, dp_size)[0][:7])
            for stage in pipe.stages:
                if isinstance(stage, DistributedDataParallel):
                    stage.reducer.stop()
    if world == 2:  # a boundary of three tensors of three dtypes, one of them without gradient
        pipe = PipeDream(partition(tuple_model(), rank, world, balance=[2, 1]), chunks=4)
        for phase, run in _cases(pipe, 0, 1).items():
            with logged_p2p() as log:
                out = run()
            logs[f"tuple boundary / {phase}"] = log
            if phase == "evaluation":
                _check_output(out, pipe, tuple_model(), batch(0)[0][:7])
    return logs


def _replay_all(per_rank: list[dict[str, list[Event]]]) -> None:
    failures = []
    for case in per_rank[0]:
        logs = {rank: per_rank[rank][case] for rank in range(len(per_rank))}
        assert any(logs.values()), f"{case}: no point-to-point call was logged"
        problem = replay(logs)
        if problem is not None:
            failures.append(f"{case}: {problem}")
    assert not failures, "\n".join(failures)


def test_every_schedule_pairs_up_under_nccl_rules_on_2_ranks() -> None:
    per_rank = run_distributed(_log_world, 2, (2,))
    assert len(per_rank[0]) == len(SCHEDULES) * 3 + 3
    _replay_all(per_rank)


def test_every_schedule_pairs_up_under_nccl_rules_with_4_stages_and_dp() -> None:
    per_rank = run_distributed(_log_world, 4, (4, 2), timeout=240)
    assert len(per_rank[0]) == 2 * len(SCHEDULES) * 3
    _replay_all(per_rank)
