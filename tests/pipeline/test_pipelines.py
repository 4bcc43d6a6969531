"""GPipe, PipeDream and Interleaved1F1B against a single-process run of the same model and data.

Every configuration of a world size runs inside one spawned job (process start-up dominates on 2 cores).
Parameters after 5 SGD steps must equal the single-process run's, in float64 (``default_dtype``) at
``FLOAT64_TOLERANCES`` (rtol 1e-9: rounding cannot reach it, [Note: parity tolerances] in
lightning_haiscale/testing/parity.py); shapes change between steps (batch and sequence length), so boundary
shapes are re-exchanged.
"""

from __future__ import annotations

import itertools
import os
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lightning_haiscale.ddp import DistributedDataParallel
from lightning_haiscale.pipeline import (
    GPipe,
    Interleaved1F1B,
    PipeDream,
    PipelineCommunicationError,
    SequentialModel,
    make_subgroups,
    partition,
)
from lightning_haiscale.testing.parity import FLOAT64_TOLERANCES, default_dtype
from tests.distributed import run_distributed

STEPS = [(16, 3), (16, 5), (16, 2), (8, 3), (16, 3)]  # (batch, sequence length) of each step
SCHEDULES = ("gpipe", "gpipe_checkpoint", "pipedream", "interleaved")


def mlp(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    widths = [6] + [16] * 7
    layers = [nn.Sequential(nn.Linear(a, b), nn.Tanh()) for a, b in itertools.pairwise(widths)]
    return nn.Sequential(*layers, nn.Linear(16, 3))  # 8 layers with parameters: 4 ranks x 2 model chunks


def batch(step: int, dp_rank: int = 0, dp_size: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s data for one data-parallel rank; the shards of all ranks make the global batch."""
    n, t = STEPS[step]
    g = torch.Generator().manual_seed(1000 + step)
    x, y = torch.randn(n * dp_size, t, 6, generator=g), torch.randn(n * dp_size, t, 3, generator=g)
    return x[dp_rank * n : (dp_rank + 1) * n], y[dp_rank * n : (dp_rank + 1) * n]


def reference_parameters(dp_size: int) -> dict[str, torch.Tensor]:
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(len(STEPS)):
        x, y = batch(step, 0, 1) if dp_size == 1 else _global_batch(step, dp_size)
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
    return {k: v.detach() for k, v in model.state_dict().items()}


def _global_batch(step: int, dp_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    shards = [batch(step, r, dp_size) for r in range(dp_size)]
    return torch.cat([s[0] for s in shards]), torch.cat([s[1] for s in shards])


def build(schedule: str, chunks: int, pp_group: dist.ProcessGroup, dp_group: dist.ProcessGroup | None):
    rank, size = dist.get_rank(pp_group), dist.get_world_size(pp_group)
    seq = mlp()
    wrap = (lambda m: DistributedDataParallel(m, process_group=dp_group)) if dp_group is not None else (lambda m: m)
    if schedule == "interleaved":
        chunks_ = partition(seq, rank, size, num_model_chunks=2)
        return Interleaved1F1B([wrap(c) for c in chunks_], chunks, pp_group), chunks_
    stage = partition(seq, rank, size)
    if schedule == "pipedream":
        return PipeDream(wrap(stage), chunks, pp_group), [stage]
    policy = "except_last" if schedule == "gpipe_checkpoint" else "never"
    return GPipe(wrap(stage), chunks, pp_group, checkpoint=policy), [stage]


def _mean_over(chunks: int):
    """haiscale's convention: the criterion divides by ``chunks``, so the summed gradients are the batch mean's."""
    return lambda out, y: F.mse_loss(out, y) / chunks


def train_and_compare(pp_size: int) -> list[str]:
    world = dist.get_world_size()
    dp_group, pp_group = make_subgroups(pp_size)
    dp_size, dp_rank = world // pp_size, dist.get_rank() // pp_size
    expected = reference_parameters(dp_size)
    done = []
    for schedule in SCHEDULES:
        for chunks in (1, 2, 4, 8):
            if schedule == "interleaved" and chunks % pp_size:
                with pytest.raises(ValueError, match=f"chunks={chunks} must be a multiple"):
                    build(schedule, chunks, pp_group, None)
                continue
            pipe, stages = build(schedule, chunks, pp_group, dp_group if dp_size > 1 else None)
            opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
            criterion = _mean_over(chunks)
            for step in range(len(STEPS)):
                x, y = batch(step, dp_rank, dp_size)
                opt.zero_grad()
                losses, _ = pipe.forward_backward(x, criterion=criterion, labels=(y,))
                assert (losses is None) != pipe.is_last_stage
                opt.step()
            label = f"{schedule}/{chunks}"
            for stage in stages:
                for name, value in stage.state_dict().items():
                    torch.testing.assert_close(value, expected[name], **FLOAT64_TOLERANCES, msg=f"{label} {name}")
            bound = min(chunks, pp_size - dist.get_rank(pp_group)) if schedule == "pipedream" else chunks
            if schedule == "interleaved":
                bound = 2 * chunks
            assert pipe.peak_live <= bound, (schedule, chunks, pipe.peak_live, bound)
            done.append(label)
            for stage in pipe.stages:
                if isinstance(stage, DistributedDataParallel):
                    stage.reducer.stop()
    return done


@default_dtype(torch.float64)
def _parity_world(rank: int, world: int, layouts: tuple[int, ...]) -> list[str]:
    return [c for pp in layouts for c in train_and_compare(pp)]


def test_parity_world_2() -> None:
    done = run_distributed(_parity_world, 2, (2,))
    assert len(done[0]) == 15


def test_parity_world_4_stages_and_dp() -> None:
    done = run_distributed(_parity_world, 4, (4, 2), timeout=240)
    assert len(done[0]) == 14 + 15


class Split(nn.Module):
    """(B, T, 6) -> (features, a no-grad bool mask, int64 positions): a boundary of three dtypes."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return torch.tanh(x), x[..., 0] > 0, torch.arange(x.size(1)).expand(x.size(0), -1)


class Merge(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(6, 3)

    def forward(self, h: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        return self.proj(h) * mask.unsqueeze(-1) + pos.unsqueeze(-1)


def tuple_model() -> SequentialModel:
    torch.manual_seed(0)
    return SequentialModel(nn.Linear(6, 6), Split(), Merge())


@default_dtype(torch.float64)
def _tuples_and_eval(rank: int, world: int) -> None:
    ref = tuple_model()
    stage = partition(tuple_model(), rank, world, balance=[2, 1])
    pipe = PipeDream(stage, chunks=2)
    x, y = batch(0)
    losses, outputs = pipe.forward_backward(x, criterion=F.mse_loss, labels=(y,), return_outputs=True)
    halves = [F.mse_loss(ref(xh), yh) for xh, yh in zip(x.chunk(2), y.chunk(2), strict=True)]
    sum(halves).backward()  # haiscale: each microbatch's loss backpropagated as it is, no 1/chunks
    for name, p in stage.named_parameters():
        torch.testing.assert_close(p.grad, ref.get_parameter(name).grad, **FLOAT64_TOLERANCES)
    if rank == 1:
        torch.testing.assert_close(outputs, ref(x).detach(), **FLOAT64_TOLERANCES)
        torch.testing.assert_close(losses, torch.stack(halves).detach(), **FLOAT64_TOLERANCES)
    with pytest.raises(ValueError, match="chunks=2 does not divide batch size 5"):
        pipe.forward_backward(x[:5], criterion=F.mse_loss, labels=(y[:5],))
    out = pipe(x[:5])  # evaluation: uneven microbatches (3 and 2) and a new shape
    if rank == 1:
        torch.testing.assert_close(out, ref(x[:5]).detach(), **FLOAT64_TOLERANCES)
    else:
        assert out is None


def test_tuple_boundaries_with_no_grad_tensors_and_evaluation() -> None:
    run_distributed(_tuples_and_eval, 2)


def _peer_lost(rank: int, world: int, how: str) -> float:
    """Rank 1 dies (or stalls) after one good step; rank 0's next step must raise, not hang."""
    group = dist.new_group([0, 1], timeout=timedelta(seconds=3))
    pipe = PipeDream(partition(mlp(), rank, world), 2, group)
    x, y = batch(0)
    pipe.forward_backward(x, criterion=F.mse_loss, labels=(y,))
    dist.barrier()
    if rank == 1:
        if how == "dies":
            os._exit(3)
        time.sleep(6)
        return 0.0
    start = time.monotonic()
    # Stage 0 runs 0F0 and 0F1 (its inputs are local), then waits for 0B0's gradient from stage 1.
    error = (
        r"pipeline stage 0 \(rank 0 of the pipeline group\) (timed out|failed) .* stage 1 \(rank 1\): .*by peer"
        if how == "dies"  # gloo: "Connection closed/reset by peer"
        else r"pipeline stage 0 \(rank 0 of the pipeline group\) timed out receiving 0B0's output gradient from "
        r"stage 1 \(rank 1\): .*Timed out(.|\n)*step +rank 0 +rank 1 *\n0 +0F0 +1F0 *\n1 +0F1 +1B0"
    )
    with pytest.raises(PipelineCommunicationError, match=error):
        pipe.forward_backward(x, criterion=F.mse_loss, labels=(y,))
    return time.monotonic() - start


@pytest.mark.parametrize(("how", "within"), [("dies", 2.0), ("stalls", 5.0)])
def test_lost_stage_raises_on_its_peer(how: str, within: float) -> None:
    """A dead stage is seen at once (gloo's closed connection); a stalled one at the group's 3 s timeout.
    Either error names the stage that waited, the action, the peer stage and prints the schedule."""
    elapsed = run_distributed(_peer_lost, 2, how, may_die={1}, timeout=60)[0]
    assert elapsed < within


def test_several_chunks_on_one_rank_are_refused_with_the_fix() -> None:
    with pytest.raises(ValueError, match=r"2 model chunks per rank need at least 2 pipeline ranks.*num_model_chunks=1"):
        Interleaved1F1B([nn.Linear(2, 2), nn.Linear(2, 2)], chunks=2)


class _Fails(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise ValueError("stage 1's own bug")


def _stage_error(rank: int, world: int) -> str:
    """Stage 1 raises in its own code and its process ends; rank 0's error must name that error."""
    pipe = PipeDream(partition(nn.Sequential(nn.Linear(4, 4), _Fails()), rank, world), 2)
    x, y = torch.randn(4, 4), torch.randn(4, 4)
    if rank == 1:
        with pytest.raises(ValueError, match="own bug"):
            pipe.forward_backward(x, criterion=F.mse_loss, labels=(y,))
        os._exit(3)
    with pytest.raises(PipelineCommunicationError) as error:
        pipe.forward_backward(x, criterion=F.mse_loss, labels=(y,))
    return str(error.value)


def test_a_stages_own_error_reaches_its_peers_error() -> None:
    message = run_distributed(_stage_error, 2, may_die={1}, timeout=60)[0]
    assert "global rank 1's own error: 1F0 raised ValueError: stage 1's own bug" in message, message
