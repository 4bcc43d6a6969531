"""The engine's CUDA staging (device to pinned host memory, reduce on the CPU, back to the device) on one GPU
shared by 2 processes, on one host and on 2 simulated hosts (the hierarchical path). Each collective runs on
a non-default stream right after a long GPU sleep that delays the write of its input: the engine must wait
for the caller's stream (not the default one) before copying, and the caller's stream must wait for the copy
back. All-gather outputs start as NaN: they are written, never read. Skipped without a GPU.
"""

from __future__ import annotations

import pytest
import torch

from lightning_haiscale.hfreduce import Communicator
from tests.distributed import run_distributed

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

SLEEP = 20_000_000  # GPU cycles (~10 ms): longer than the host takes to reach the copy


def _late(value: torch.Tensor) -> torch.Tensor:
    """``value`` written on the current stream only after a GPU sleep."""
    out = torch.full_like(value, float("nan") if value.is_floating_point() else -1)
    torch.cuda._sleep(SLEEP)
    return out.copy_(value)


def _staged_collectives(rank: int, world: int) -> list[str]:
    torch.cuda.set_device(0)
    comm = Communicator()
    failures = []
    side = torch.cuda.Stream()
    n = (5 << 20) // 4 + 3  # above the 4 MiB staging chunk and not a multiple of it
    with torch.cuda.stream(side):
        x = _late(torch.full((n,), float(rank + 1), device="cuda"))
        comm.all_reduce(x)
        summed = x.min().item(), x.max().item()
        out = torch.full((world * 4,), float("nan"), device="cuda")
        comm.all_gather(out, _late(torch.full((4,), float(rank), device="cuda")))
        gathered = out.cpu()
        big = _late(torch.arange(world * 4, dtype=torch.float32, device="cuda") * (rank + 1))
        piece = torch.empty(4, device="cuda")
        comm.reduce_scatter(piece, big, op="avg")
        scattered = piece.cpu()
        b = _late(torch.full((5,), float(rank), device="cuda"))
        comm.broadcast(b, src=world - 1)
        broadcast = b.cpu()
    side.synchronize()
    expected_sum = float(world * (world + 1) // 2)
    if summed != (expected_sum, expected_sum):
        failures.append(f"all_reduce gave min/max {summed}, expected {expected_sum}")
    if not torch.equal(gathered, torch.arange(world).repeat_interleave(4).float()):
        failures.append(f"all_gather gave {gathered.tolist()}")
    mean_scale = (world + 1) / 2
    # "avg" multiplies the sum by 1/world (one float32 rounding): allclose's rtol 1e-5 is 80 ulps of it
    if not torch.allclose(scattered, torch.arange(rank * 4, rank * 4 + 4).float() * mean_scale):
        failures.append(f"reduce_scatter gave {scattered.tolist()}")
    if not torch.equal(broadcast, torch.full((5,), float(world - 1))):
        failures.append(f"broadcast gave {broadcast.tolist()}")
    comm.close()
    return failures


@pytest.mark.parametrize("node_ids", [None, ["a", "b"]], ids=["one-host", "two-hosts"])
def test_staged_collectives_wait_for_the_callers_stream(node_ids: list[str] | None) -> None:
    assert run_distributed(_staged_collectives, 2, node_ids=node_ids) == [[], []]
