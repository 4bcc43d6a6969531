"""Parameters shared by two stages, found by identity before any step (``pipeline.ties``), without processes."""

import pytest
from torch import nn

from examples.gpt.model import GPT, config
from lightning_haiscale.pipeline import partition
from lightning_haiscale.pipeline.ties import find_ties


def _tied_mlp() -> nn.Sequential:
    seq = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4), nn.Linear(4, 4))
    seq[3].weight = seq[0].weight
    return seq


def test_find_ties_names_the_parameter_in_each_stage() -> None:
    seq = _tied_mlp()
    parts = [seq[0:2], seq[2:4]]
    (tie,) = find_ties(parts)
    assert tie.stages == (0, 1) and tie.names == ("0.weight", "3.weight")
    assert find_ties([seq]) == []  # held by one stage only: autograd sums its two uses


@pytest.mark.parametrize("module", [_tied_mlp(), GPT(config("tiny", n_layer=2, n_embd=16, n_head=2, tie_weights=True))])
def test_partition_refuses_a_parameter_shared_across_ranks(module: nn.Sequential) -> None:
    last = f"{len(module) - 1}."
    for rank in range(2):
        with pytest.raises(ValueError, match=rf"'0\..*weight' \(stage 0\) = '{last}.*weight' \(stage 1\).*drift"):
            partition(module, rank, 2)


def test_partition_accepts_a_tie_inside_one_stage_and_refuses_interleaved_chunks_on_two_ranks() -> None:
    seq = _tied_mlp()
    assert len(partition(seq, 0, 1)) == 4  # one stage holds both uses
    with pytest.raises(ValueError, match=r"stage 0.*stage 3"):  # stage 3 of 4 lives on rank 1 of 2
        partition(seq, 0, 2, balance=[1, 1, 1, 1], num_model_chunks=2)
