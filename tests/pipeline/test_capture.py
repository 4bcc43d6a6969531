"""Capture and replay of step code around a pipeline, without processes."""

import pytest
import torch
from torch import nn

from lightning_haiscale.pipeline.capture import InputsCaptured, StageProxy, batch_rows, split_batch


def test_capture_stops_at_the_network_call_and_replay_returns_the_output() -> None:
    proxy = StageProxy(nn.Linear(2, 2))
    x = torch.randn(3, 2)
    with proxy.capturing(), pytest.raises(InputsCaptured) as captured:
        proxy(x * 2)
    torch.testing.assert_close(captured.value.inputs[0], x * 2)
    out = torch.ones(3, 2)
    with proxy.replaying(out):
        assert proxy(x) is out
    with pytest.raises(RuntimeError, match="split across pipeline stages"):
        proxy(x)


def test_replay_refuses_a_step_that_calls_the_network_twice() -> None:
    proxy = StageProxy(nn.Linear(2, 2))
    with pytest.raises(RuntimeError, match="called the pipelined network 2 times"), proxy.replaying(torch.ones(1)):
        proxy(torch.ones(1))
        proxy(torch.ones(1))


def test_split_batch_handles_nested_batches_and_names_both_numbers() -> None:
    batch = {"x": torch.arange(8).view(4, 2), "meta": "keep", "pair": (torch.arange(4), torch.tensor(1.0))}
    parts = split_batch(batch, 2)
    assert parts[1]["x"].tolist() == [[4, 5], [6, 7]] and parts[1]["meta"] == "keep"
    assert parts[0]["pair"][0].tolist() == [0, 1] and float(parts[0]["pair"][1]) == 1.0
    with pytest.raises(ValueError, match="chunks=3 does not divide batch size 4"):
        split_batch(batch, 3)
    assert [len(p) for p in split_batch(torch.arange(5), 2, even=False)] == [3, 2]


def test_batch_rows_finds_the_first_batched_tensor() -> None:
    x = torch.zeros(5, 3)
    assert batch_rows(x) == 5 and batch_rows(torch.tensor(1.0)) is None
    assert batch_rows({"scale": torch.tensor(2.0), "tokens": (x, [torch.zeros(5)])}) == 5
    assert batch_rows(["text", 3]) is None
