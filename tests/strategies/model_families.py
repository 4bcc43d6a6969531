"""Model families beyond decoder-only language models, as their users train them: tiny Hugging Face ViT,
ViTMAE, T5, BART and a module with timm's ``VisionTransformer`` layout built
from configs (no download), each wrapped in the LightningModule a user writes (``self.model(**batch).loss``),
with dict batches, ``precision="64-true"`` (the model is built in float32 and Lightning converts it; the
batches are float64), SGD with momentum 0.9, and the one-process reference they are compared with.

Float64 throughout, so a pipeline (the same sums in another order) matches one process to 1e-10.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler
from transformers import (
    BartConfig,
    BartForConditionalGeneration,
    T5Config,
    T5ForConditionalGeneration,
    ViTConfig,
    ViTForImageClassification,
    ViTMAEConfig,
    ViTMAEForPreTraining,
)
from transformers.utils import logging as hf_logging

BATCH, STEPS, LR, MOMENTUM = 4, 3, 0.1, 0.9
TOL = {"rtol": 1e-10, "atol": 1e-12}  # float64: only the order of the microbatch sums differs
IMAGE = {"image_size": 8, "num_channels": 3, "hidden_size": 16, "num_hidden_layers": 4, "num_attention_heads": 2,
         "intermediate_size": 32, "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}  # fmt: skip


def vit() -> nn.Module:
    return ViTForImageClassification(ViTConfig(patch_size=4, num_labels=3, **IMAGE))


def vit_mae() -> nn.Module:
    cfg = ViTMAEConfig(
        patch_size=2, mask_ratio=0.5, decoder_hidden_size=8, decoder_num_hidden_layers=1,
        decoder_num_attention_heads=2, decoder_intermediate_size=16, **IMAGE,
    )  # fmt: skip
    return ViTMAEForPreTraining(cfg)


def t5() -> nn.Module:
    cfg = T5Config(
        vocab_size=32, d_model=16, d_kv=8, d_ff=32, num_layers=2, num_decoder_layers=4, num_heads=2,
        dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0, use_cache=False,
    )  # fmt: skip
    return T5ForConditionalGeneration(cfg)


def bart() -> nn.Module:
    cfg = BartConfig(
        vocab_size=32, d_model=16, encoder_layers=2, decoder_layers=4, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, dropout=0.0, attention_dropout=0.0,
        activation_dropout=0.0, max_position_embeddings=16, use_cache=False, pad_token_id=1, bos_token_id=0,
        eos_token_id=2, decoder_start_token_id=2,
    )  # fmt: skip
    return BartForConditionalGeneration(cfg)


def text_rows(rows: int) -> list[dict[str, torch.Tensor]]:
    """Source and target tokens (never the pad token, so every target token counts in the loss)."""
    x = torch.randint(3, 32, (rows, 8), generator=torch.Generator().manual_seed(5))
    y = torch.randint(3, 32, (rows, 6), generator=torch.Generator().manual_seed(6))
    return [{"input_ids": x[i], "labels": y[i]} for i in range(rows)]


class _TimmBlock(nn.Module):
    """timm's ViT ``Block``: pre-norm attention and MLP, residual adds."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, c = x.shape
        q, k, v = self.qkv(self.norm1(x)).reshape(b, n, 3, 2, c // 2).permute(2, 0, 3, 1, 4)
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, c))
        return x + self.mlp(self.norm2(x))


class TimmStyleViT(nn.Module):
    """timm's ``VisionTransformer`` layout: ``cls_token`` and ``pos_embed`` held by the model itself, beside
    ``patch_embed`` and the ``blocks`` Sequential, and used by its own ``_pos_embed`` before the blocks."""

    def __init__(self, dim: int = 16, depth: int = 4, classes: int = 3) -> None:
        super().__init__()
        self.patch_embed = nn.Module()
        self.patch_embed.proj = nn.Conv2d(3, dim, kernel_size=4, stride=4)
        self.cls_token = nn.Parameter(torch.randn(1, 1, dim) * 0.02)
        self.pos_embed = nn.Parameter(torch.randn(1, 5, dim) * 0.02)
        self.blocks = nn.Sequential(*(_TimmBlock(dim) for _ in range(depth)))
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, classes)

    def _pos_embed(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed.proj(x).flatten(2).transpose(1, 2)
        x = self.norm(self.blocks(self._pos_embed(x)))
        return self.head(x[:, 0])


def timm_vit() -> nn.Module:
    """timm's own ``VisionTransformer`` (the test using it skips where timm is not installed)."""
    from timm.models.vision_transformer import VisionTransformer

    return VisionTransformer(img_size=8, patch_size=4, num_classes=3, embed_dim=16, depth=4, num_heads=2, mlp_ratio=2)


def logits_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """timm's users compute the loss in the step from the model's logits."""
    return F.cross_entropy(model(batch["pixel_values"]), batch["labels"])


def hf_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return model(**batch).loss


def _images(rows: int, seed: int) -> torch.Tensor:
    return torch.randn(rows, 3, 8, 8, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def vit_rows(rows: int) -> list[dict[str, torch.Tensor]]:
    x = _images(rows, 1)
    labels = torch.randint(0, 3, (rows,), generator=torch.Generator().manual_seed(2))
    return [{"pixel_values": x[i], "labels": labels[i]} for i in range(rows)]


def mae_rows(rows: int) -> list[dict[str, torch.Tensor]]:
    """``noise`` decides each row's random mask, so every run masks the same patches."""
    x = _images(rows, 3)
    noise = torch.rand(rows, 16, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    return [{"pixel_values": x[i], "noise": noise[i]} for i in range(rows)]


Rows = Callable[[int], list[dict[str, torch.Tensor]]]
MODELS: dict[str, tuple[Callable[[], nn.Module], Rows, Callable[[nn.Module, dict], torch.Tensor]]] = {
    "vit": (vit, vit_rows, hf_loss),
    "vit_mae": (vit_mae, mae_rows, hf_loss),
    "t5": (t5, text_rows, hf_loss),
    "bart": (bart, text_rows, hf_loss),
    "timm_style": (TimmStyleViT, vit_rows, logits_loss),
}
OPTIONAL = {"timm": (timm_vit, vit_rows, logits_loss)}  # needs timm installed
TIED = {  # names of one parameter, which several stages hold
    "t5": ("shared.weight", "encoder.embed_tokens.weight", "decoder.embed_tokens.weight", "lm_head.weight"),
    "bart": ("model.shared.weight", "model.encoder.embed_tokens.weight", "model.decoder.embed_tokens.weight",
             "lm_head.weight"),
}  # fmt: skip


class LitModel(L.LightningModule):
    """The user's module: ``self.model(**batch).loss``, or the loss of the model's logits."""

    def __init__(self, model: nn.Module, loss: Callable[[nn.Module, dict], torch.Tensor]) -> None:
        super().__init__()
        self.model, self.loss = model, loss

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.loss(self.model, batch)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=LR, momentum=MOMENTUM)


def build(name: str) -> nn.Module:
    hf_logging.set_verbosity_error()
    torch.manual_seed(0)
    return {**MODELS, **OPTIONAL}[name][0]()


def _stack(rows: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {k: torch.stack([r[k] for r in rows]) for k in rows[0]}


def one_process(name: str, dp: int = 1) -> dict[str, torch.Tensor]:
    """The reference: ``dp`` replicas' batches of a step are one batch of ``dp * BATCH`` rows here."""
    model, (_, make_rows, loss) = build(name).double(), {**MODELS, **OPTIONAL}[name]
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    rows, data = BATCH * dp, make_rows(BATCH * dp * STEPS)
    for step in range(STEPS):
        optimizer.zero_grad()
        loss(model, _stack(data[step * rows : (step + 1) * rows])).backward()
        optimizer.step()
    return {f"model.{k}": v.detach().clone() for k, v in model.state_dict().items()}


def fit(name: str, strategy: Any, dp: int = 1, dp_rank: int = 0) -> L.Trainer:
    """``STEPS`` steps at ``64-true``; replica ``dp_rank`` of ``dp`` reads rows ``dp_rank::dp`` in order."""
    trainer = L.Trainer(
        strategy=strategy, accelerator="cpu", devices=torch.distributed.get_world_size(), max_steps=STEPS,
        precision="64-true", logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, use_distributed_sampler=False, num_sanity_val_steps=0,
    )  # fmt: skip
    _, make_rows, loss = {**MODELS, **OPTIONAL}[name]
    data = make_rows(BATCH * dp * STEPS)
    sampler = DistributedSampler(data, num_replicas=dp, rank=dp_rank, shuffle=False)
    trainer.fit(LitModel(build(name), loss), DataLoader(data, batch_size=BATCH, sampler=sampler))
    return trainer


def check(full: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], name: str, label: str) -> None:
    """The full state matches one process's and loads strictly into a fresh, unsplit model."""
    assert sorted(full) == sorted(expected), label
    for k, v in expected.items():
        torch.testing.assert_close(full[k], v, **TOL, msg=f"{label} {k}")
    for tied in TIED.get(name, ()):
        assert torch.equal(full[f"model.{tied}"], full[f"model.{TIED[name][0]}"]), f"{label}: {tied} untied"
    build(name).double().load_state_dict({k.removeprefix("model."): v for k, v in full.items()}, strict=True)
