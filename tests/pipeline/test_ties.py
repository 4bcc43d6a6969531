"""Parameters shared by two stages, found by identity before any step (``pipeline.ties``), without processes."""

from torch import nn

from examples.gpt.model import GPT, config
from lightning_haiscale.pipeline import partition
from lightning_haiscale.pipeline.ties import Tie, find_ties


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


def test_partition_records_the_ties_on_every_stage() -> None:
    gpt = GPT(config("tiny", n_layer=2, n_embd=16, n_head=2, tie_weights=True))
    first, last = (partition(gpt, r, 2) for r in range(2))
    tie = Tie((0, 1), ("0.wte.weight", "3.lm_head.weight"))
    assert first.ties == last.ties == [tie]
    assert first.local_ties()[tie] is last.local_ties()[tie] is gpt[0].wte.weight
