"""Resuming an unmodified GPT-2 (tied head) from a pipeline checkpoint, at the same and at another pipeline size.

SGD with momentum 0.9, so a resume that lost or misplaced a momentum buffer (per stage, by parameter name)
shows; 4 steps saved at step 2 (an epoch's end), resumed there, must give the same bits as the run that went on.
"""

from __future__ import annotations

import os
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

import lightning_haiscale  # noqa: F401 - registers the strategies
from lightning_haiscale.strategies import Interleaved1F1BStrategy, PipeDreamStrategy
from tests.distributed import run_distributed
from tests.strategies.real_models import BATCH, MODELS, LitLM, build, tokens


def _fit(strategy: Any, tmp: str, ckpt_path: str | None = None, save: bool = False) -> L.Trainer:
    callbacks = [ModelCheckpoint(dirpath=tmp, filename="{step}", every_n_train_steps=2, save_top_k=-1)] if save else []
    trainer = L.Trainer(
        strategy=strategy, accelerator="cpu", devices=dist.get_world_size(), max_steps=4, logger=False,
        enable_checkpointing=save, callbacks=callbacks, enable_progress_bar=False, enable_model_summary=False,
        use_distributed_sampler=False, limit_val_batches=0,
    )  # fmt: skip
    make, loss = MODELS["gpt2"]
    module = LitLM(build(make), loss, momentum=0.9)
    trainer.fit(module, DataLoader(TensorDataset(tokens()), batch_size=BATCH), ckpt_path=ckpt_path)
    return trainer


def _resume(rank: int, world: int, tmp: str) -> None:
    whole = _fit(PipeDreamStrategy(chunks=2), tmp, save=True).strategy.lightning_module_state_dict()
    path = os.path.join(tmp, "step=2.ckpt")
    layouts = {"same 2 stages": PipeDreamStrategy(chunks=2), "4 stages": Interleaved1F1BStrategy(chunks=2)}
    for label, strategy in layouts.items():
        resumed = _fit(strategy, tmp, ckpt_path=path)
        got = resumed.strategy.lightning_module_state_dict()
        assert resumed.global_step == 4 and got.keys() == whole.keys()
        for k, v in whole.items():
            assert torch.equal(got[k], v), f"{label}: {k}"


def test_resume_is_bit_for_bit_at_the_same_and_another_pipeline_size(tmp_path: Any) -> None:
    run_distributed(_resume, 2, str(tmp_path), timeout=300)
