"""Real models for the strategy tests: tiny Hugging Face GPT-2 (tied head) and Llama built from configs (no
download), a litgpt-style module and the GPT example (both tied), each with the step its users write, and the
one-process reference they are compared with.

Models, data and SGD are float64, so a distributed run (gradients summed in another order) matches one
process to 1e-10.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM
from transformers.utils import logging as hf_logging

from examples.gpt.model import GPT, config
from lightning_haiscale.strategies import GPipeStrategy, Interleaved1F1BStrategy, PipeDreamStrategy

VOCAB, WIDTH, LAYERS, SEQ, BATCH, STEPS, LR = 32, 16, 8, 8, 4, 2, 0.5
TOL = {"rtol": 1e-10, "atol": 1e-12}  # float64 throughout: only the order of the microbatch sums differs


def gpt2() -> nn.Module:
    cfg = GPT2Config(
        n_layer=LAYERS, n_embd=WIDTH, n_head=2, vocab_size=VOCAB, n_positions=SEQ, use_cache=False,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return GPT2LMHeadModel(cfg)


def llama() -> nn.Module:
    cfg = LlamaConfig(
        num_hidden_layers=LAYERS, hidden_size=WIDTH, intermediate_size=32, num_attention_heads=2,
        num_key_value_heads=1, vocab_size=VOCAB, use_cache=False, bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )  # fmt: skip
    return LlamaForCausalLM(cfg)


class Block(nn.Module):
    """A pre-norm block taking the rotary-like tables as positional arguments, as litgpt's ``Block``."""

    def __init__(self) -> None:
        super().__init__()
        self.norm_1, self.attn = nn.LayerNorm(WIDTH), nn.Linear(WIDTH, 3 * WIDTH)
        self.norm_2 = nn.LayerNorm(WIDTH)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 32), nn.GELU(), nn.Linear(32, WIDTH))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        q, k, v = self.attn(self.norm_1(x)).split(WIDTH, dim=2)  # (B, T, C) each
        q, k = q * cos + k * sin, k * cos - q * sin
        x = x + F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.mlp(self.norm_2(x))


class LitGPTStyle(nn.Module):
    """litgpt's ``GPT`` layout: ``lm_head`` registered first, ``transformer.{wte,h,ln_f}``, tied head."""

    def __init__(self) -> None:
        super().__init__()
        self.lm_head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.transformer = nn.ModuleDict(
            {"wte": nn.Embedding(VOCAB, WIDTH), "h": nn.ModuleList(Block() for _ in range(LAYERS)),
             "ln_f": nn.LayerNorm(WIDTH)}
        )  # fmt: skip
        self.lm_head.weight = self.transformer.wte.weight
        angles = torch.arange(SEQ)[:, None] / 10 ** (torch.arange(WIDTH)[None] / WIDTH)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.transformer.wte(idx)
        cos, sin = self.cos[: idx.size(1)].to(x.dtype), self.sin[: idx.size(1)].to(x.dtype)
        for block in self.transformer.h:
            x = block(x, cos, sin)
        return self.lm_head(self.transformer.ln_f(x))


def hf_loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(input_ids=x, labels=x).loss


def logits_loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    logits = model(x[:, :-1])
    return F.cross_entropy(logits.reshape(-1, VOCAB), x[:, 1:].reshape(-1))


class LitLM(L.LightningModule):
    """The user's module: its step calls the model as the model's documentation says."""

    def __init__(
        self, model: nn.Module, loss: Callable[[nn.Module, torch.Tensor], torch.Tensor], momentum: float = 0.0
    ) -> None:
        super().__init__()
        self.model, self.loss, self.momentum = model, loss, momentum

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self.loss(self.model, batch[0])
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", self.loss(self.model, batch[0]))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=LR, momentum=self.momentum)


def tokens(dp: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH * STEPS * dp, SEQ), generator=torch.Generator().manual_seed(3))


def example_gpt() -> nn.Module:
    """The GPT example: an nn.Sequential (cut between its layers) with its head tied to the embedding."""
    return GPT(config("tiny", n_layer=LAYERS, n_embd=WIDTH, n_head=2, block_size=SEQ, vocab_size=VOCAB))


def build(make: Callable[[], nn.Module]) -> nn.Module:
    hf_logging.set_verbosity_error()
    torch.manual_seed(0)
    return make().double()


def one_process(
    make: Callable[[], nn.Module], loss: Callable, dp: int = 1, clip: float | None = None
) -> tuple[dict[str, torch.Tensor], float]:
    """The reference: ``dp`` replicas' batches of a step are one batch of ``dp * BATCH`` rows here (each row
    has as many tokens, so the mean of the replicas' mean losses is this batch's mean loss). Returns the state
    and the loss on the first validation batch after training. ``clip``: gradients clipped to that norm."""
    model = build(make)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    rows = BATCH * dp
    for step in range(STEPS):
        optimizer.zero_grad()
        loss(model, tokens(dp)[step * rows : (step + 1) * rows]).backward()
        if clip is not None:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)  # a tied weight counts once here
            assert norm > clip, f"clip={clip} must be below the gradient norm {float(norm)} to act"
        optimizer.step()
    with torch.no_grad():
        model.val_loss = float(loss(model, tokens()[:BATCH]))  # the first validation batch, after training
    return {f"model.{k}": v.detach().clone() for k, v in model.state_dict().items()}, model.val_loss


def fit(
    make: Callable[[], nn.Module], loss: Callable, strategy: Any, dp: int = 1, dp_rank: int = 0, **kwargs: Any
) -> L.Trainer:
    """``STEPS`` steps; replica ``dp_rank`` of ``dp`` reads rows ``dp_rank::dp`` in order (no shuffling)."""
    trainer = L.Trainer(
        strategy=strategy, accelerator="cpu", devices=torch.distributed.get_world_size(), max_steps=STEPS,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        use_distributed_sampler=False, limit_val_batches=1, num_sanity_val_steps=0, **kwargs,
    )  # fmt: skip
    data = TensorDataset(tokens(dp))
    sampler = DistributedSampler(data, num_replicas=dp, rank=dp_rank, shuffle=False)
    val = DataLoader(TensorDataset(tokens()[:BATCH]), batch_size=BATCH)
    trainer.fit(LitLM(build(make), loss), DataLoader(data, batch_size=BATCH, sampler=sampler), val)
    return trainer


MODELS = {
    "gpt2": (gpt2, hf_loss),
    "llama": (llama, hf_loss),
    "litgpt": (LitGPTStyle, logits_loss),
    "example": (example_gpt, logits_loss),
}
TIED = {
    "gpt2": ("model.transformer.wte.weight", "model.lm_head.weight"),
    "litgpt": ("model.transformer.wte.weight", "model.lm_head.weight"),
    "example": ("model.0.wte.weight", f"model.{LAYERS + 1}.lm_head.weight"),
}


def check(full: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], name: str, label: str) -> None:
    """The full state matches one process's, tied copies are equal, and it loads into the unsplit model."""
    assert sorted(full) == sorted(expected), label
    for k, v in expected.items():
        torch.testing.assert_close(full[k], v, **TOL, msg=f"{label} {k}")
    if name in TIED:
        first, second = TIED[name]
        assert torch.equal(full[first], full[second]), f"{label}: the tied copies differ"
    fresh = build(MODELS[name][0])  # the unsplit model takes the full checkpoint as it is
    fresh.load_state_dict({k.removeprefix("model."): v for k, v in full.items()}, strict=True)


def schedules(pp_size: int) -> dict[str, L.pytorch.strategies.Strategy]:
    """The three pipeline schedules on ``pp_size`` stages, by label (the model tests train each)."""
    return {
        "gpipe": GPipeStrategy(chunks=2, pp_size=pp_size),
        "pipedream": PipeDreamStrategy(chunks=2, pp_size=pp_size),
        "interleaved": Interleaved1F1BStrategy(chunks=pp_size, pp_size=pp_size),
    }
