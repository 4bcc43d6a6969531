"""Communicator collectives against torch.distributed's own, on 2-4 processes and 2 simulated hosts.

Floating-point references sum the all-gathered inputs in rank order in the engine's accumulation type
(fp32 for 16-bit types), so one host is compared bit for bit. Across hosts the order differs and 16-bit
values are rounded twice (after the host sum, after the cross-host sum): the comparison allows 4 ulps
of the largest magnitude.
Integers are always exact.
"""

from __future__ import annotations

import os
import resource
import signal
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from lightning_haiscale.hfreduce import (
    Communicator,
    HFReducePeerError,
    HFReduceTimeoutError,
    SharedMemoryTooSmallError,
    engine_cpu_seconds,
    segments,
)
from tests.distributed import run_distributed

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64]


def _input(rank: int, n: int, dtype: torch.dtype, salt: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + 17 * n + salt)
    if dtype.is_floating_point:
        return (torch.randn(n, generator=g, dtype=torch.float64) * 4).to(dtype)
    return torch.randint(-(2**20), 2**20, (n,), generator=g, dtype=dtype)


def _gathered(t: torch.Tensor, world: int) -> list[torch.Tensor]:
    parts = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(parts, t)
    return parts


def _ordered_sum(parts: list[torch.Tensor], divisor: float = 1.0) -> torch.Tensor:
    wide = torch.float32 if parts[0].dtype in (torch.float16, torch.bfloat16) else parts[0].dtype
    acc = parts[0].to(wide).clone()
    for p in parts[1:]:
        acc += p.to(wide)
    if divisor != 1.0:
        acc /= divisor
    return acc.to(parts[0].dtype)


def _check(actual: torch.Tensor, expected: torch.Tensor, exact: bool) -> None:
    if exact or not expected.dtype.is_floating_point:
        assert torch.equal(actual, expected), (actual - expected).abs().max()
    else:
        eps = torch.finfo(expected.dtype).eps
        scale = expected.abs().max().item() if expected.numel() else 0.0  # cancellation makes rtol alone too strict
        torch.testing.assert_close(actual, expected, rtol=4 * eps, atol=4 * eps * scale)


def _collectives(rank: int, world: int, sizes: tuple[int, ...]) -> None:
    comm = Communicator(timeout=timedelta(seconds=60))
    exact = comm.num_hosts == 1
    for dtype in DTYPES:
        for n in sizes:
            x = _input(rank, n, dtype)
            parts = _gathered(x, world)
            expected = _ordered_sum(parts)
            got = x.clone()
            comm.all_reduce(got)
            _check(got, expected, exact)

            big = torch.cat([_input(r, n, dtype, salt=1) for r in range(world)]) + rank
            shard = torch.empty(n, dtype=dtype)
            comm.reduce_scatter(shard, big)
            _check(
                shard,
                _ordered_sum(_gathered(big, world)).view(world, max(n, 1) if n else 0, -1)[rank].view(-1)
                if n
                else shard,
                exact,
            )

            gathered = torch.empty(world * n, dtype=dtype)
            comm.all_gather(gathered, x)
            assert torch.equal(gathered, torch.cat(parts))

            b = x.clone()
            comm.broadcast(b, src=world - 1)
            assert torch.equal(b, parts[-1])
        if dtype.is_floating_point:
            x = _input(rank, 4097, dtype, salt=2)
            comm.all_reduce(x, op="avg")
            _check(x, _ordered_sum(_gathered(_input(rank, 4097, dtype, salt=2), world), world), exact)
    comm.barrier()
    comm.close()


@pytest.mark.parametrize(
    ("world", "node_ids"),
    [(2, None), (3, None), (4, None), (4, ["a", "a", "b", "b"]), (4, ["a", "b", "a", "b"])],
    ids=["world2", "world3", "world4", "2hosts_x2", "2hosts_interleaved"],
)
def test_collectives_match_torch_distributed(world: int, node_ids: list[str] | None) -> None:
    sizes = (0, 1, 7, 4097, 1_000_003) + ((16 * 2**20,) if world == 2 else ())
    run_distributed(_collectives, world, sizes, node_ids=node_ids, timeout=400)


def _zero_copy_and_async(rank: int, world: int) -> float:
    comm = Communicator()
    buf = comm.alloc_buffer(3 * 4099, torch.float32)
    assert buf.numel() == 3 * 4099 and torch.all(buf == 0)
    buf.copy_(_input(rank, buf.numel(), torch.float32))
    expected = _ordered_sum(_gathered(buf, world), world)
    view = buf[4099 : 2 * 4099]  # a view at an offset reduces in place too
    comm.all_reduce(view, op="avg")
    comm.all_reduce(buf[:4099], op="avg")
    comm.all_reduce(buf[2 * 4099 :], op="avg")
    assert torch.equal(buf, expected)
    halves = comm.alloc_buffer(1001, torch.bfloat16)
    halves.copy_(_input(rank, 1001, torch.bfloat16))
    expected16 = _ordered_sum(_gathered(halves, world))
    comm.all_reduce(halves)
    assert torch.equal(halves, expected16)

    tensors = [_input(rank, 1 + 97 * i, torch.float32) for i in range(100)]
    expected = [_ordered_sum(_gathered(t, world)) for t in tensors]
    works = [comm.all_reduce(t, async_op=True) for t in tensors]
    for w in works:
        assert w.wait() is True and w.is_completed()
    for t, e in zip(tensors, expected, strict=True):
        assert torch.equal(t, e)

    before = time.process_time()
    time.sleep(1.0)
    idle_cpu = time.process_time() - before  # an idle communicator sleeps (no spinning thread)
    comm.close()
    return idle_cpu


def test_zero_copy_buffers_async_ops_and_idle_cpu() -> None:
    idle = run_distributed(_zero_copy_and_async, 2)
    assert max(idle) < 0.02, f"idle communicator used {max(idle):.3f} s of CPU in 1 s"


def _subgroup(rank: int, world: int) -> None:
    group = dist.new_group([1, 3], use_local_synchronization=True) if rank in (1, 3) else None
    if group is None:
        return
    comm = Communicator(group)
    t = torch.full((5,), float(rank))
    comm.all_reduce(t)
    assert torch.equal(t, torch.full((5,), 4.0))
    comm.close()


def test_communicator_over_a_subgroup() -> None:
    run_distributed(_subgroup, 4)


def _bad_input(rank: int, world: int) -> None:
    comm = Communicator()
    with pytest.raises(ValueError, match="contiguous"):
        comm.all_reduce(torch.zeros(4, 4).t())
    with pytest.raises(TypeError, match="complex64"):
        comm.all_reduce(torch.zeros(4, dtype=torch.complex64))
    with pytest.raises(TypeError, match=r"torch\.Tensor"):
        comm.all_reduce([1.0, 2.0])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="op='max'"):
        comm.all_reduce(torch.zeros(4), op="max")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="avg"):
        comm.all_reduce(torch.zeros(4, dtype=torch.int64), op="avg")
    with pytest.raises(ValueError, match=r"expected world_size \(2\) x 3 = 6"):
        comm.reduce_scatter(torch.zeros(3), torch.zeros(7))
    with pytest.raises(ValueError, match="src=5"):
        comm.broadcast(torch.zeros(3), src=5)
    with pytest.raises(ValueError, match="chunk_bytes"):
        Communicator(chunk_bytes=1000)
    t = torch.ones(3)
    comm.all_reduce(t)  # still usable: nothing above reached the engine
    assert torch.equal(t, torch.full((3,), 2.0))
    comm.close()


def test_bad_input_raises_before_any_collective() -> None:
    run_distributed(_bad_input, 2)


def _small_shm(rank: int, world: int) -> str:
    segments.shm_free_bytes = lambda: 1 << 20
    with pytest.raises(SharedMemoryTooSmallError, match="--shm-size"):
        Communicator()
    with pytest.warns(UserWarning, match="falling back to torch.distributed"):
        comm = Communicator(allow_fallback=True)
    t = torch.full((7,), float(rank + 1))
    comm.all_reduce(t, op="avg")
    assert torch.equal(t, torch.full((7,), 1.5))
    return comm.backend


def test_small_dev_shm_raises_or_falls_back() -> None:
    assert run_distributed(_small_shm, 2) == ["torch.distributed"] * 2


def _peer_killed(rank: int, world: int) -> float:
    comm = Communicator(timeout=timedelta(seconds=60))
    comm.barrier()
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(HFReducePeerError, match=r"local rank 1 .* died") as info:
        comm.all_reduce(torch.ones(1 << 20))
    assert info.value.dead_ranks == [1]
    return time.monotonic() - start


def test_killed_peer_is_reported_within_seconds_not_the_timeout() -> None:
    elapsed = run_distributed(_peer_killed, 2, may_die={1})[0]
    assert elapsed < 5.0


def _peer_stalls(rank: int, world: int) -> float:
    comm = Communicator(timeout=timedelta(seconds=2))
    start = time.monotonic()
    if rank == 0:
        with pytest.raises(HFReduceTimeoutError, match=r"local ranks \[1\]") as info:
            comm.all_reduce(torch.ones(10))
        assert info.value.missing_ranks == [1]
    elapsed = time.monotonic() - start
    dist.barrier()  # rank 1 "stalls" until rank 0 has given up
    return elapsed


def test_stalled_peer_times_out_naming_it() -> None:
    elapsed = run_distributed(_peer_stalls, 2)[0]
    assert 1.9 < elapsed < 4.0


def _all_killed(rank: int, world: int, marker: str) -> None:
    comm = Communicator()
    comm.alloc_buffer(1024)
    Path(marker, str(rank)).write_text(str(os.getpid()))
    comm.all_reduce(torch.ones(1 << 22), async_op=True)
    os.kill(os.getpid(), signal.SIGKILL)


def _closed(rank: int, world: int) -> int:
    with Communicator() as comm:
        comm.alloc_buffer(1024)
    comm_with_error = Communicator(timeout=timedelta(seconds=1))
    if rank == 0:
        with pytest.raises(HFReduceTimeoutError):
            comm_with_error.all_reduce(torch.ones(4))
    dist.barrier()
    return os.getpid()


def _segments_of(pids: list[int]) -> list[str]:
    return [p.name for p in Path("/dev/shm").glob("lhs-*-*") if p.name.split("-")[1] in {str(pid) for pid in pids}]


def test_no_segment_remains_after_close_error_or_sigkill(tmp_path: Path) -> None:
    pids = run_distributed(_closed, 2)
    assert _segments_of(pids) == []
    run_distributed(_all_killed, 2, str(tmp_path), may_die={0, 1})
    killed = [int(p.read_text()) for p in tmp_path.iterdir()]
    assert len(killed) == 2 and _segments_of(killed) == []


def _sleeps_during_synchronous_calls(rank: int, world: int) -> int:
    comm = Communicator()
    t = torch.ones(1024)
    comm.all_reduce(t)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw
    for _ in range(2000):
        comm.all_reduce(t)
    slept = resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw - before
    comm.close()
    return slept


def test_a_synchronous_call_wakes_no_thread() -> None:
    """With one rank nothing is waited for, so no thread of the process should sleep (a voluntary context
    switch) during synchronous all-reduces. The engine's idle worker thread used to be woken by each one:
    about one context switch per call (see [Note: two condition variables] in csrc/communicator.h)."""
    assert run_distributed(_sleeps_during_synchronous_calls, 1)[0] < 100


def _engine_cpu(rank: int, world: int) -> tuple[float, float, float]:
    comm = Communicator()
    t = torch.ones(16 << 20)  # 64 MiB
    comm.all_reduce(t)  # on the caller's thread: not the engine's
    start = engine_cpu_seconds()
    for _ in range(3):
        comm.all_reduce(t)
    inline = engine_cpu_seconds() - start
    caller = time.thread_time()
    works = [comm.all_reduce(t, async_op=True) for _ in range(3)]
    for work in works:
        work.wait()
    caller = time.thread_time() - caller
    queued = engine_cpu_seconds() - start - inline
    comm.close()
    return inline, queued, caller


def test_engine_cpu_seconds_counts_the_worker_thread_alone() -> None:
    """The benchmark's floor (benchmarks/strategy_ddp.py [Note: the floor of a shared core]) rests on it:
    asynchronous all-reduces show up as the engine thread's CPU, synchronous ones (the caller's) do not."""
    inline, queued, caller = run_distributed(_engine_cpu, 1)[0]
    assert inline < 0.005, f"synchronous all-reduces counted as engine CPU: {inline:.3f} s"
    assert queued > 0.01 and queued > 4 * caller, f"3 async 64 MiB all-reduces: engine {queued}, caller {caller} s"
