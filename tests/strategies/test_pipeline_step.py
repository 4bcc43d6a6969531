"""The pipelined Lightning step's pieces without processes: capture and replay, and shadowing the module."""

from typing import Any

import lightning as L
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader

from lightning_haiscale.strategies import PipeDreamStrategy
from lightning_haiscale.strategies.pipeline_step import InputsCaptured, StageProxy, shadowed
from lightning_haiscale.testing.parity import BATCH, FLOAT64_TOLERANCES, STEPS, Classifier, data, reference


def test_capture_stops_at_the_network_call_and_replay_returns_the_output() -> None:
    proxy = StageProxy(nn.Linear(2, 2))
    x = torch.randn(3, 2)
    with proxy.capturing(), pytest.raises(InputsCaptured) as captured:
        proxy(x * 2)
    assert torch.equal(captured.value.inputs[0], x * 2)  # the same operation on the same tensor
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


def test_shadowed_restores_what_was_there() -> None:
    module = nn.Linear(1, 1)
    with shadowed(module, "forward", len):
        assert module.forward is len
    assert "forward" not in module.__dict__ and module(torch.ones(1)).shape == (1,)
    module.__dict__["extra_repr"] = str
    with shadowed(module, "extra_repr", len):
        assert module.extra_repr is len
    assert module.extra_repr is str


def test_a_training_step_splits_its_batch_once(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    """Was: the batch was split for replay and the captured inputs split again (3 tensor splits per step of an
    (x, y) batch, not 2). The parameters still match one process's SGD run on the same batches."""
    splits = []
    tensor_split = torch.tensor_split

    def counting(*args: Any, **kwargs: Any) -> Any:
        splits.append(args[0].shape)
        return tensor_split(*args, **kwargs)

    monkeypatch.setattr(torch, "tensor_split", counting)
    monkeypatch.delenv("PL_GLOBAL_SEED", raising=False)  # an earlier seed_everything() would reseed the sampler
    trainer = L.Trainer(
        strategy=PipeDreamStrategy(chunks=2), accelerator="cpu", devices=1, max_steps=STEPS, limit_val_batches=0,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=str(tmp_path), precision="64-true",  # float64: compared at FLOAT64_TOLERANCES
    )  # fmt: skip
    module = Classifier()
    try:
        trainer.fit(module, DataLoader(data(), batch_size=BATCH))
    finally:
        if dist.is_initialized():  # the strategy's one-process group: later tests in this process start clean
            dist.destroy_process_group()
    assert len(splits) == 2 * STEPS  # x and y, once each per step
    expected, _ = reference(STEPS, BATCH, dtype=torch.float64)
    for k, v in expected.items():
        torch.testing.assert_close(module.state_dict()[k], v, **FLOAT64_TOLERANCES)
