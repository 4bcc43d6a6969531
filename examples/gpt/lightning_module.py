"""The GPT example as a plain LightningModule: nothing in it knows which strategy trains it."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict
from typing import Any

import lightning as L
import torch
from torchmetrics import MeanMetric
from torchmetrics.text import Perplexity

from examples.gpt.model import GPT, GPTConfig, config, lm_loss

__all__ = ["GPTLightningModule", "decay_groups"]


def decay_groups(named_parameters: Iterable[tuple[str, torch.nn.Parameter]], weight_decay: float) -> list[dict]:
    """AdamW parameter groups: weight decay on the matrices and embeddings, none on biases and LayerNorms.

    nanoGPT picks the matrices by shape (``p.dim() >= 2``). Here they are picked by name, because a sharding
    strategy hands the optimizer flat 1-D pieces under the original names (hai_fsdp: see
    ``FullyShardedDataParallel`` [Note: what the optimizer sees]): a name gives the same groups under every
    strategy, a shape does not.
    """
    decay, no_decay = [], []
    for name, param in named_parameters:
        (no_decay if name.endswith(".bias") or ".ln_" in name else decay).append(param)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [group for group in groups if group["params"]]


class GPTLightningModule(L.LightningModule):
    """Trains ``GPT(cfg)`` on (x, y) token batches with AdamW.

    The network is built in :meth:`configure_model`, not ``__init__``, so a sharding strategy can
    create it under its own initialization context; it is ``self.model``, the one ``nn.Sequential``
    pipeline strategies look for.

    Args:
        cfg: the model configuration: a config name (``"tiny"``, ``"small"``, ``"medium"``), a ``GPTConfig``
            such as ``config("tiny", n_layer=2)``, or its fields as a dict (from a checkpoint).
        lr: AdamW learning rate.
        weight_decay: AdamW weight decay of the matrices and embeddings (see :func:`decay_groups`).
    """

    flops_per_batch: int | None = None  # read by Lightning's ThroughputMonitor; None: no FLOPs figure

    def __init__(
        self, cfg: GPTConfig | dict[str, Any] | str = "tiny", lr: float = 1e-3, weight_decay: float = 0.1
    ) -> None:
        super().__init__()
        if isinstance(cfg, str):
            cfg = config(cfg)
        self.cfg = cfg if isinstance(cfg, GPTConfig) else GPTConfig(**cfg)
        # Plain types only, so checkpoints load with torch.load(weights_only=True) (Lightning's default).
        self.save_hyperparameters({"cfg": asdict(self.cfg), "lr": lr, "weight_decay": weight_decay})
        self.lr = lr
        self.weight_decay = weight_decay
        self.model: GPT | None = None
        self.val_loss = MeanMetric()
        self.val_ppl = Perplexity()

    def configure_model(self) -> None:
        if self.model is None:  # Lightning may call this again (e.g. trainer.validate after fit)
            self.model = GPT(self.cfg)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        if self.model is None:
            raise RuntimeError("GPTLightningModule.model is not built yet; call configure_model() first")
        return self.model(idx)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self(x)
        loss = lm_loss(logits, y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        logits = self(x)  # (B, T, vocab)
        self.val_loss.update(lm_loss(logits, y), weight=y.numel())
        self.val_ppl.update(logits.float(), y)
        self.log("val_loss", self.val_loss, prog_bar=True)
        self.log("val_ppl", self.val_ppl, prog_bar=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        groups = decay_groups(self.named_parameters(), self.weight_decay)
        return torch.optim.AdamW(groups, lr=self.lr, betas=(0.9, 0.95))
