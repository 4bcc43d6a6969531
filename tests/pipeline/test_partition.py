"""Partitioning without processes: balance by parameters, explicit and measured; interleaved chunk order."""

import itertools

import pytest
import torch
from torch import nn

from lightning_haiscale.pipeline import SequentialModel, partition
from lightning_haiscale.pipeline.balance import balanced_counts
from lightning_haiscale.pipeline.partition import stage_layer_counts


def _mlp(widths: list[int]) -> nn.Sequential:
    return nn.Sequential(*(nn.Linear(a, b) for a, b in itertools.pairwise(widths)))


def test_balanced_counts_minimize_the_heaviest_stage() -> None:
    assert balanced_counts([1, 1, 1, 1], 2) == [2, 2]
    assert balanced_counts([10, 1, 1, 1, 1, 10], 3) == [1, 4, 1]
    assert balanced_counts([5, 5, 5], 3) == [1, 1, 1]


def test_partition_keeps_the_original_layer_names() -> None:
    seq = _mlp([4, 64, 4, 4, 4])
    first, second = (partition(seq, r, 2) for r in range(2))
    assert list(first._modules) == ["0"] and list(second._modules) == ["1", "2", "3"]
    full = {**first.state_dict(), **second.state_dict()}
    assert full.keys() == seq.state_dict().keys()
    x = torch.randn(3, 4)
    assert torch.equal(second(first(x)), seq(x))  # the same layers, the same operations: bit for bit


def test_explicit_balance_and_its_errors() -> None:
    seq = _mlp([4, 4, 4, 4, 4])
    assert len(partition(seq, 1, 2, balance=[3, 1])) == 1
    with pytest.raises(ValueError, match=r"balance=\[2, 1\] must be 2 positive layer counts .* summing to 4"):
        partition(seq, 0, 2, balance=[2, 1])
    with pytest.raises(ValueError, match="fewer than the 8 stages"):
        partition(seq, 0, 8)
    with pytest.raises(ValueError, match=r"Linear has no ModuleList or Sequential of two or more blocks"):
        partition(nn.Linear(2, 2), 0, 1)


def test_model_chunks_are_interleaved() -> None:
    seq = _mlp([4] * 9)  # 8 layers -> 8 parts of 1
    chunks = partition(seq, 1, 4, num_model_chunks=2)
    assert [list(c._modules) for c in chunks] == [["1"], ["5"]]


def test_time_balance_needs_an_example_and_cuts_slow_layers_apart() -> None:
    seq = nn.Sequential(nn.Linear(256, 256), nn.Tanh(), nn.Tanh(), nn.Linear(256, 256))
    with pytest.raises(ValueError, match="example_inputs"):
        partition(seq, 0, 2, balance="time")
    first = partition(seq, 0, 2, balance="time", example_inputs=(torch.randn(512, 256),))
    assert 1 <= len(first) <= 3
    assert all(p.grad is None for p in seq.parameters())


class _GPUSleep(nn.Module):
    """Queues a ~50 ms GPU kernel and returns at once: only a synchronized clock sees its time."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        torch.cuda._sleep(100_000_000)
        return x * 1.0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_time_balance_on_cuda_synchronizes_and_profiles_where_the_inputs_are() -> None:
    seq = nn.Sequential(_GPUSleep(), nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 64))  # on the CPU
    counts = stage_layer_counts(seq, 2, "time", example_inputs=(torch.randn(8, 64, device="cuda"),))
    assert counts == [1, 3], "the slow GPU layer was not timed as slow (no synchronization?)"
    assert all(p.device.type == "cpu" for p in seq.parameters()), "layers go back where they were"


def test_sequential_model_unpacks_tuples() -> None:
    class Split(nn.Module):
        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return x, x > 0

    class Mask(nn.Module):
        def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            return x * mask

    x = torch.randn(5)
    assert torch.equal(SequentialModel(Split(), Mask())(x), x.clamp(min=0))  # x * 1 and x * 0: exact
