"""The one microbatch splitter (``split_batch``), its row count and sizes, without processes."""

import pytest
import torch

from lightning_haiscale.pipeline import split_microbatches
from lightning_haiscale.pipeline.pipelines import batch_rows, microbatch_sizes, split_batch


def test_split_batch_handles_nested_batches_and_names_both_numbers() -> None:
    batch = {"x": torch.arange(8).view(4, 2), "meta": "keep", "pair": (torch.arange(4), torch.tensor(1.0))}
    parts = split_batch(batch, 2)
    assert parts[1]["x"].tolist() == [[4, 5], [6, 7]] and parts[1]["meta"] == "keep"
    assert parts[0]["pair"][0].tolist() == [0, 1] and float(parts[0]["pair"][1]) == 1.0
    with pytest.raises(ValueError, match="chunks=3 does not divide batch size 4"):
        split_batch(batch, 3)
    assert [len(p) for p in split_batch(torch.arange(5), 2, even=False)] == [3, 2]


def test_split_microbatches_is_split_batch_over_the_arguments() -> None:
    x, scale = torch.arange(6).view(3, 2), 0.5
    parts = split_microbatches((x, scale), 3)
    assert [p[0].tolist() for p in parts] == [[[0, 1]], [[2, 3]], [[4, 5]]] and all(p[1] == scale for p in parts)
    with pytest.raises(ValueError, match="chunks=2 does not divide batch size 3"):
        split_microbatches((x,), 2)
    with pytest.raises(ValueError, match="a pipeline input is a 0-d tensor"):
        split_microbatches((torch.tensor(1.0),), 2)
    with pytest.raises(ValueError, match="chunks=0 must be at least 1"):
        split_microbatches((x,), 0)


@pytest.mark.parametrize("rows", [4, 5, 6, 7, 9])
def test_microbatch_sizes_are_the_sizes_of_the_split(rows: int) -> None:
    assert microbatch_sizes(rows, 4) == [len(p) for p in split_batch(torch.arange(rows), 4, even=False)]


def test_batch_rows_finds_the_first_batched_tensor() -> None:
    x = torch.zeros(5, 3)
    assert batch_rows(x) == 5 and batch_rows(torch.tensor(1.0)) is None
    assert batch_rows({"scale": torch.tensor(2.0), "tokens": (x, [torch.zeros(5)])}) == 5
    assert batch_rows(["text", 3]) is None
