"""What every plain-PyTorch example shares: process group set-up under torchrun, and a toy task."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch import nn


def init() -> tuple[int, int, torch.device]:
    """Joins the process group torchrun describes; returns (rank, world size, device)."""
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    torch.manual_seed(0)
    return dist.get_rank(), dist.get_world_size(), device


def toy_model(width: int = 64, depth: int = 4) -> nn.Sequential:
    """An MLP regression model as an nn.Sequential (pipelines cut it into stages)."""
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.GELU()]
    return nn.Sequential(*layers, nn.Linear(width, 1))


def toy_batch(rank: int, step: int, batch: int = 32, width: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """Each rank's own batch: y = sum of x's first half."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(batch, width, generator=g)
    return x, x[:, : width // 2].sum(dim=1, keepdim=True)
