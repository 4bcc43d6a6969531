"""``forward_backward(..., grad_scaler=)``: fp16 autocast with loss scaling through a 2-stage PipeDream on CPU.

torch's ``ShardedGradScaler("cpu")`` with a fixed scale of 1024 (no growth in one step). One SGD step changes
the parameters as one fp32 process does (relative 2e-2: fp16 autocast's rounding); an inf in the last stage's
gradient makes both stages skip the step and halve the scale.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

from lightning_haiscale.pipeline import PipeDream, partition
from tests.distributed import run_distributed


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))


def _step(rank: int, world: int, inject_inf: bool) -> tuple[float, list[float], float]:
    full = _net()
    stage = partition(_net(), rank, world)
    before = {n: p.detach().clone() for n, p in stage.named_parameters()}
    pipe = PipeDream(stage, chunks=2)
    scaler = ShardedGradScaler("cpu", init_scale=1024.0, growth_interval=10**6)
    opt = torch.optim.SGD(stage.parameters(), lr=0.5)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 6, generator=g), torch.randint(0, 4, (8,), generator=g)
    with torch.autocast("cpu", dtype=torch.float16):
        pipe.forward_backward(
            x, criterion=lambda out, y: F.cross_entropy(out.float(), y) / 2, labels=(y,), grad_scaler=scaler
        )
    if inject_inf and rank == world - 1:
        next(stage.parameters()).grad.view(-1)[0] = float("inf")
    scaler.step(opt)
    scaler.update()
    F.cross_entropy(full(x), y).backward()
    errors = []
    for name, p in stage.named_parameters():
        ref = dict(full.named_parameters())[name]
        wanted = -0.5 * ref.grad
        errors.append(((p.detach() - before[name] - wanted).norm() / wanted.norm()).item())
    return (
        max(errors),
        [float((p.detach() - before[n]).abs().max()) for n, p in stage.named_parameters()],
        scaler.get_scale(),
    )


def _checks(rank: int, world: int) -> tuple:
    return _step(rank, world, inject_inf=False), _step(rank, world, inject_inf=True)


def test_scaled_fp16_step_matches_fp32_and_inf_skips_on_every_stage() -> None:
    for (error, _, scale), (_, moved, skipped_scale) in run_distributed(_checks, 2):
        assert error < 2e-2, f"the step's change is off by {error:.2e} (relative)"
        assert scale == 1024.0
        assert max(moved) == 0.0 and skipped_scale == 512.0
