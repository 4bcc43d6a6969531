"""Sharded checkpoints move between Lightning's ``FSDPStrategy`` and ``hai_fsdp`` both ways, and Lightning's
``consolidate_checkpoint`` reads ours.

Was: our folders held ``state_dict.*`` and ``optimizer_states.0.*``; Lightning's ``consolidate_checkpoint`` failed
with ``KeyError: 'model'``, and neither strategy resumed the other's folder. Now both write ``model``,
``optimizer_<i>`` and ``meta.pt`` (Lightning's layout; SPEC §3.1).

Lightning's ``FSDPStrategy`` refuses the CPU; a subclass wrapping with ``device_id=torch.device("cpu")`` runs there
(SPEC §3), which is all it takes to write and read its files. Each strategy trains the ``Classifier`` 6 steps in
float64 (the module and data built in float64: Lightning's FSDP has no ``"64-true"``) with SGD momentum 0.9,
saving a sharded checkpoint at step 3 (the first epoch's end); the other strategy resumes it there and must end
with the same bits as the run that went on (2 ranks: each gradient element is the same two float64 numbers summed
and halved by both). Lightning's ``python -m lightning.pytorch.utilities.consolidate_checkpoint`` turns our step-3
folder into one file whose ``state_dict`` loads strictly into the plain module and equals the one it makes of
Lightning's own step-3 folder, and whose ``optimizer_states`` hold every momentum buffer.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.precision import FSDPPrecision
from lightning.pytorch.strategies import FSDPStrategy
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel
from torch.utils.data import DataLoader, TensorDataset

import lightning_haiscale  # noqa: F401  (registers the strategies)
from lightning_haiscale.strategies import HaiFSDPStrategy
from lightning_haiscale.testing.parity import BATCH, Classifier, data
from tests.distributed import run_distributed

ROWS = 3 * 2 * BATCH  # one epoch: 3 steps of 2 ranks x BATCH rows


class CPUFSDPStrategy(FSDPStrategy):
    """Lightning's ``FSDPStrategy`` on the CPU: its own wrapper call, with the device torch needs there."""

    def _setup_model(self, model: nn.Module) -> nn.Module:
        return FullyShardedDataParallel(
            model, device_id=torch.device("cpu"), sharding_strategy=self.sharding_strategy, **self.kwargs
        )


class Float64(FSDPPrecision):
    """Lightning's FSDP has no ``"64-true"``: its ``"32-true"`` (which casts the module and the inputs to float32)
    leaving the float64 module and data as they are built."""

    def __init__(self) -> None:
        super().__init__("32-true")

    def convert_module(self, module: nn.Module) -> nn.Module:
        return module

    def convert_input(self, data: Any) -> Any:
        return data


def _strategy(name: str) -> Any:
    if name == "lightning":
        return CPUFSDPStrategy(state_dict_type="sharded", precision_plugin=Float64())
    return HaiFSDPStrategy(state_dict_type="sharded")


def _fit(name: str, tmp: Path, ckpt_path: Path | None = None) -> dict[str, torch.Tensor]:
    """6 steps, saving at step 3 into ``tmp/name`` (not when resuming); returns the whole final state on rank 0."""
    save = ckpt_path is None
    saver = ModelCheckpoint(dirpath=tmp / name, filename="{step}", every_n_train_steps=3, save_top_k=-1)
    trainer = L.Trainer(
        strategy=_strategy(name), accelerator="cpu", devices=2, max_steps=6, logger=False, enable_checkpointing=save,
        callbacks=[saver] if save else [], enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
    )  # fmt: skip
    x, y = data(ROWS).tensors
    trainer.fit(Classifier().double(), DataLoader(TensorDataset(x.double(), y), batch_size=BATCH), ckpt_path=ckpt_path)
    model = trainer.strategy.model
    if isinstance(model, FullyShardedDataParallel):  # Lightning's: the parameters whole on every rank, for a moment
        with FullyShardedDataParallel.summon_full_params(model, writeback=False):
            return {k: v.clone() for k, v in trainer.lightning_module.state_dict().items()}
    return model.full_state_dict()  # hai_fsdp's wrapper: on rank 0


def _both_ways(rank: int, world: int, tmp: str) -> None:
    tmp_path = Path(tmp)
    finals = {name: _fit(name, tmp_path) for name in ("lightning", "hai_fsdp")}
    for source, target in (("lightning", "hai_fsdp"), ("hai_fsdp", "lightning")):
        resumed = _fit(target, tmp_path, ckpt_path=tmp_path / source / "step=3.ckpt")
        if rank == 0:
            expected = finals[source]
            assert resumed.keys() == expected.keys(), (source, target)
            for k, v in expected.items():
                assert torch.equal(resumed[k], v), f"{source} -> {target}: {k}"
    dist.barrier()


@pytest.mark.slow  # 130 s on 2 loaded cores
def test_sharded_checkpoints_resume_under_each_others_strategy(tmp_path: Path) -> None:
    run_distributed(_both_ways, 2, str(tmp_path), timeout=400)
    consolidated = {}
    for name in ("lightning", "hai_fsdp"):
        folder = tmp_path / name / "step=3.ckpt"
        command = [sys.executable, "-m", "lightning.pytorch.utilities.consolidate_checkpoint", str(folder)]
        subprocess.run(command, check=True, capture_output=True, timeout=120)
        consolidated[name] = torch.load(f"{folder}.consolidated", weights_only=False)
    ours, theirs = consolidated["hai_fsdp"], consolidated["lightning"]
    plain = Classifier().double()
    plain.load_state_dict(ours["state_dict"], strict=True)
    assert ours["state_dict"].keys() == theirs["state_dict"].keys()
    for k, v in theirs["state_dict"].items():
        assert torch.equal(ours["state_dict"][k], v), k
    assert ours["global_step"] == theirs["global_step"] == 3
    buffers = ours["optimizer_states"][0]["state"]
    assert sorted(buffers) == sorted(name for name, _ in plain.named_parameters())
    for name, state in theirs["optimizer_states"][0]["state"].items():
        assert torch.equal(buffers[name]["momentum_buffer"], state["momentum_buffer"]), name
