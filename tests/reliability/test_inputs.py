"""Inputs that disagree across ranks or have the wrong type: an error before any step, on every rank."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_haiscale.cpu_offload import CPUOffload
from lightning_haiscale.ddp import DistributedDataParallel
from lightning_haiscale.pipeline import PipeDream, partition
from tests.distributed import run_distributed


class _Grid(nn.Module):
    def __init__(self, shape: tuple[int, int]) -> None:
        super().__init__()
        self.grid = nn.Parameter(torch.zeros(shape))


def _ddp_models_differ(rank: int, world: int) -> None:
    with pytest.raises(
        ValueError, match=r"'weight' is \[9, 8\] torch.float32 on rank 0 .* rank 1 has 'weight' \[8, 8\]"
    ):
        DistributedDataParallel(nn.Linear(8, 9 if rank == 0 else 8))
    # The same element count in another layout: a flat copy would "work" and scramble the values.
    with pytest.raises(ValueError, match=r"'grid' is \[4, 6\] .* rank 1 has 'grid' \[6, 4\]"):
        DistributedDataParallel(_Grid((4, 6) if rank == 0 else (6, 4)))
    with pytest.raises(ValueError, match="rank 0 has 1 parameters and buffers and rank 1 has 2"):
        DistributedDataParallel(nn.Linear(6, 4, bias=rank == 1))


def test_ddp_refuses_models_that_differ_across_ranks() -> None:
    run_distributed(_ddp_models_differ, 2)


def _labels_of_another_batch(rank: int, world: int) -> None:
    torch.manual_seed(0)
    model = PipeDream(partition(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)), rank, world), chunks=2)
    x, y = torch.randn(8, 4), torch.randn(2, 2)  # 2 label rows would broadcast against 4-row microbatches
    with pytest.raises(ValueError, match="labels have batch size 2 but the inputs have 8"):
        model.forward_backward(x, criterion=F.mse_loss, labels=(y,))
    before = [p.detach().clone() for p in model.parameters()]
    model.forward_backward(x, criterion=F.mse_loss, labels=(torch.randn(8, 2),))  # still usable
    assert any(p.grad is not None for p in model.parameters()) and before


def test_pipeline_labels_of_another_batch_size_fail_on_every_rank_before_the_step() -> None:
    run_distributed(_labels_of_another_batch, 2)


@pytest.mark.parametrize("balance", [[2.5, 3.5], [True, 1], ["3", "3"]])
def test_partition_balance_must_be_ints(balance: list) -> None:
    with pytest.raises(TypeError, match=r"balance=.* must hold whole layer counts"):
        partition(nn.Sequential(*[nn.Linear(2, 2) for _ in range(6)]), 0, 2, balance=balance)


@pytest.mark.parametrize("ratio", ["0.5", True, None])
def test_offload_ratio_must_be_a_number(ratio: object) -> None:
    with pytest.raises(TypeError, match=r"offload_ratio=.* must be a number between 0 and 1"):
        CPUOffload(offload_ratio=ratio)  # type: ignore[arg-type]
