"""What the strategy tests share: a quiet CPU ``Trainer.fit`` on the harness's ranks, and language-model data."""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

from examples.gpt.model import GPTConfig


def quiet_fit(
    module: L.LightningModule, strategy: Any, steps: int, data: Any, batch_size: int, **trainer_kwargs: Any
) -> L.Trainer:
    """``steps`` optimizer steps on every rank of the group: no logger, checkpoints, progress bar or validation
    unless ``trainer_kwargs`` ask for them (``ckpt_path`` goes to ``fit``)."""
    options = {
        "devices": dist.get_world_size(),
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "limit_val_batches": 0,
        "num_sanity_val_steps": 0,
    }
    ckpt_path = trainer_kwargs.pop("ckpt_path", None)
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", max_steps=steps, **{**options, **trainer_kwargs})
    trainer.fit(module, train_dataloaders=DataLoader(data, batch_size=batch_size), ckpt_path=ckpt_path)
    return trainer


def lm_dataset(cfg: GPTConfig, rows: int) -> TensorDataset:
    """``rows`` random token sequences as (inputs, next-token targets)."""
    seq = torch.randint(0, cfg.vocab_size, (rows, cfg.block_size + 1), generator=torch.Generator().manual_seed(7))
    return TensorDataset(seq[:, :-1], seq[:, 1:])
