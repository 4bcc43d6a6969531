"""Fault injection on the collective engine: ranks that disagree, /dev/shm that runs out, peers that die
unreaped. Each case must end in a clear error on every rank, never a wrong number or a crash."""

from __future__ import annotations

import gc
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from lightning.fabric.plugins.environments.lightning import find_free_network_port
from torch import nn

from lightning_haiscale.ddp import DistributedDataParallel
from lightning_haiscale.hfreduce import (
    Communicator,
    HFReduceMismatchError,
    SharedMemoryTooSmallError,
)
from tests.distributed import run_distributed

ROOT = Path(__file__).resolve().parents[2]


def _all_reduce(n: int, dtype: torch.dtype = torch.float32, op: str = "sum") -> Callable[[Communicator], None]:
    return lambda comm: comm.all_reduce(torch.ones(n, dtype=dtype), op=op)  # type: ignore[arg-type]


def _all_gather(n: int) -> Callable[[Communicator], None]:
    return lambda comm: comm.all_gather(torch.empty(comm.world_size * n), torch.ones(n))


def _broadcast(src: int) -> Callable[[Communicator], None]:
    return lambda comm: comm.broadcast(torch.ones(8), src=src)


# case: (call of the ranks that differ, call of the others, what the error must say of each)
MISMATCHES = {
    "size": (_all_reduce(1001), _all_reduce(1000), "all_reduce(1001 x float32", "all_reduce(1000 x float32"),
    "size, chunked path": (
        _all_reduce(200_000),
        _all_reduce(300_000),
        "all_reduce(200000 x float32",
        "all_reduce(300000 x float32",
    ),
    "dtype": (_all_reduce(8, torch.float64), _all_reduce(8), "8 x float64", "8 x float32"),
    "collective": (_all_gather(8), _all_reduce(8), "all_gather(8 x float32 per rank)", "all_reduce(8 x float32"),
    "op": (_all_reduce(8, op="avg"), _all_reduce(8), "op=avg over", "op=sum"),
    "root": (_broadcast(1), _broadcast(0), "root=rank 1", "root=rank 0"),
    "empty": (_all_reduce(0), _all_reduce(5), "all_reduce(0 x float32", "all_reduce(5 x float32"),
}


def _mismatches(rank: int, world: int, odd: list[int], cases: list[str]) -> list[float]:
    """Runs each case on a fresh communicator: ranks in ``odd`` make the first call, the others the second.

    On one host every rank's error names both calls. Across hosts a rank names the calls it can see: its
    host's and those of its peers with the same local index on other hosts ("called differently" else).
    """
    elapsed = []
    for case in cases:
        theirs, ours, says_theirs, says_ours = MISMATCHES[case]
        comm = Communicator(timeout=timedelta(seconds=30))
        comm.all_reduce(torch.ones(4))  # a matching call first: the check is per call, not only the first
        start = time.monotonic()
        with pytest.raises(HFReduceMismatchError, match="Is there a distributed collective mismatch") as info:
            (theirs if rank in odd else ours)(comm)
        elapsed.append(time.monotonic() - start)
        message = str(info.value)
        seen_elsewhere = world > 2 and "on other hosts called differently" in message
        assert (says_theirs in message or seen_elsewhere) and says_ours in message, (case, message)
        assert info.value.mismatched_ranks, case
        with pytest.raises(Exception, match="unusable after an earlier failure"):
            comm.all_reduce(torch.ones(4))  # the ranks are out of step: the communicator refuses work
        comm.close()
    return elapsed


def test_ranks_that_disagree_all_raise_at_once_naming_each_call() -> None:
    for elapsed in run_distributed(_mismatches, 2, [1], list(MISMATCHES)):
        assert max(elapsed) < 5.0, elapsed  # at the call, not at the 30 s timeout


@pytest.mark.parametrize("odd", [[2, 3], [3]], ids=["one host differs", "one rank differs"])
def test_ranks_that_disagree_across_hosts_all_raise(odd: list[int]) -> None:
    cases = ["size", "root"] if len(odd) == 2 else ["size"]
    run_distributed(_mismatches, 4, odd, cases, node_ids=["a", "a", "b", "b"])


# ---------------------------------------------------------------------------------- peer died, not reaped

_ZOMBIE_RANK = """
import os, sys, time, torch, torch.distributed as dist
from datetime import timedelta
from lightning_haiscale.hfreduce import Communicator, HFReducePeerError
dist.init_process_group("gloo")
comm = Communicator(timeout=timedelta(seconds=30))
comm.barrier()
if dist.get_rank() == 1:
    os._exit(0)  # its parent (the test) does not reap it while rank 0 waits: a zombie
start = time.monotonic()
try:
    comm.all_reduce(torch.ones(10))
except HFReducePeerError as error:
    print(f"{time.monotonic() - start:.3f} {error}", flush=True)
    os._exit(0)
os._exit(1)
"""


def test_a_dead_unreaped_peer_is_reported_within_a_second() -> None:
    env = dict(
        os.environ,
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(find_free_network_port()),
        WORLD_SIZE="2",
        PYTHONPATH=str(ROOT),
    )
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _ZOMBIE_RANK], env=dict(env, RANK=str(r)), stdout=subprocess.PIPE, text=True
        )
        for r in range(2)
    ]
    try:
        out, _ = procs[0].communicate(timeout=120)
        state = Path(f"/proc/{procs[1].pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert state == "Z"  # rank 1 was still a zombie when rank 0 gave up on it
    assert procs[0].returncode == 0, out
    seconds, message = out.split(" ", 1)
    assert float(seconds) < 2.0 and "local rank 1" in message and "died" in message, out


# ------------------------------------------------------------------------------- /dev/shm too small

_SHM_MIB = 16


def _segments() -> list[str]:
    return sorted(p.name for p in Path("/dev/shm").glob("lhs-*"))  # not the multiprocessing semaphores


def _shm_too_small(rank: int, world: int) -> list[str]:
    # DDP's gradient bucket: ten 256 -> 512 layers, each gradient under the reducer's 1 MiB in-place size so
    # all share one packed bucket of 5.0 MiB per rank, 10 MiB per host, where 10 MiB is left after DDP's
    # communicator took its 6 MiB: it used to touch the pages and die of SIGBUS.
    with pytest.raises(SharedMemoryTooSmallError, match=r"alloc_buffer.*needs 10\.0 MiB.*--shm-size"):
        DistributedDataParallel(nn.Sequential(*(nn.Linear(256, 512) for _ in range(10))))
    gc.collect()
    assert _segments() == []
    comm = Communicator(timeout=timedelta(seconds=30))
    with pytest.raises(SharedMemoryTooSmallError, match=r"needs 12\.0 MiB.*--shm-size"):
        comm.alloc_buffer(3 << 19)  # 6 MiB per rank
    t = comm.alloc_buffer(1 << 10)  # still usable: the failure was caught before anything was mapped
    t.fill_(rank + 1)
    comm.all_reduce(t)
    assert torch.equal(t, torch.full_like(t, 3.0))
    del t
    comm.close()
    del comm
    gc.collect()
    with pytest.warns(UserWarning, match="falling back"):
        fallback = Communicator(allow_fallback=True)
        fallback.alloc_buffer(3 << 19)
    del fallback
    gc.collect()
    filler = Path("/dev/shm/filler")
    if rank == 0:
        filler.write_bytes(b"\0" * (6 << 20))  # 10 MiB free: the preflight wants twice the 6 MiB segment
    torch.distributed.barrier()
    with pytest.raises(SharedMemoryTooSmallError, match=r"needs 12\.0 MiB of free shared memory.*10\.0 MiB free"):
        Communicator()
    torch.distributed.barrier()
    if rank == 0:
        filler.unlink()
    torch.distributed.barrier()
    return _segments()


def _in_small_shm() -> None:
    """Entry point inside the private mount namespace (see the test)."""
    assert run_distributed(_shm_too_small, 2, timeout=300) == [[], []]
    assert _segments() == []


def test_small_dev_shm_raises_on_every_rank_and_leaves_nothing() -> None:
    unshare = shutil.which("unshare")
    probe = [unshare, "-m", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /dev/shm"] if unshare else None
    if probe is None or subprocess.run(probe, capture_output=True).returncode != 0:
        pytest.skip("needs `unshare -m` and mount (root or CAP_SYS_ADMIN)")
    script = "from tests.reliability.test_engine import _in_small_shm; _in_small_shm()"
    command = f"mount -t tmpfs -o size={_SHM_MIB}m tmpfs /dev/shm && exec {sys.executable} -c '{script}'"
    result = subprocess.run(
        [unshare, "-m", "sh", "-c", command],
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert result.returncode == 0, result.stdout + result.stderr
