"""Models users bring, for the sharding tests: a litgpt-style GPT written here, a tiny transformers GPT-2, and
the example GPT, each in float64 with a loss function and its block class (see SPEC 2.1)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from examples.gpt.model import GPT, config, lm_loss
from examples.gpt.model import Block as ExampleBlock

VOCAB, WIDTH, LAYERS, CONTEXT = 53, 24, 2, 8


class LitBlock(nn.Module):
    """litgpt's ``Block`` shape: ``norm_1``, ``attn`` (fused qkv, proj), ``norm_2``, ``mlp`` (fc, proj)."""

    def __init__(self, width: int, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.norm_1 = nn.LayerNorm(width)
        self.attn = nn.ModuleDict({"attn": nn.Linear(width, 3 * width), "proj": nn.Linear(width, width)})
        self.norm_2 = nn.LayerNorm(width)
        self.mlp = nn.ModuleDict({"fc": nn.Linear(width, 4 * width), "proj": nn.Linear(4 * width, width)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.attn["attn"](self.norm_1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))  # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, c)
        x = x + self.attn["proj"](y)
        return x + self.mlp["proj"](F.gelu(self.mlp["fc"](self.norm_2(x))))


class LitGPT(nn.Module):
    """litgpt's ``GPT`` layout: ``transformer.wte``, ``transformer.h`` (a ModuleList of blocks),
    ``transformer.ln_f`` and ``lm_head``, tied to ``wte`` or not."""

    def __init__(self, tie: bool) -> None:
        super().__init__()
        self.lm_head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.transformer = nn.ModuleDict(
            {
                "wte": nn.Embedding(VOCAB, WIDTH),
                "h": nn.ModuleList(LitBlock(WIDTH) for _ in range(LAYERS)),
                "ln_f": nn.LayerNorm(WIDTH),
            }
        )
        if tie:
            self.lm_head.weight = self.transformer["wte"].weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.transformer["wte"](idx)
        for block in self.transformer["h"]:
            x = block(x)
        return self.lm_head(self.transformer["ln_f"](x))


def _hf_gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(
        vocab_size=VOCAB,
        n_positions=CONTEXT,
        n_embd=WIDTH,
        n_layer=LAYERS,
        n_head=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    return GPT2LMHeadModel(cfg)


def _hf_block() -> type[nn.Module]:
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    return GPT2Block


def _lm(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return lm_loss(model(batch[:, :-1]), batch[:, 1:])


def _hf(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    # transformers' own loss (labels=) upcasts to float32; computed here it stays in float64
    return lm_loss(model(input_ids=batch[:, :-1]).logits, batch[:, 1:])


@dataclass(frozen=True)
class Case:
    """A model to build (in float64, seeded), its loss on a batch of token ids, and its block class."""

    build: Callable[[], nn.Module]
    loss: Callable[[nn.Module, torch.Tensor], torch.Tensor]
    block: Callable[[], type[nn.Module]]

    def model(self, seed: int = 0) -> nn.Module:
        torch.manual_seed(seed)
        return self.build().double()


CASES = {
    "example": Case(
        lambda: GPT(config("tiny", vocab_size=VOCAB, n_embd=WIDTH, n_head=2, n_layer=LAYERS, block_size=CONTEXT)),
        _lm,
        lambda: ExampleBlock,
    ),
    "litgpt": Case(lambda: LitGPT(tie=False), _lm, lambda: LitBlock),
    "litgpt_tied": Case(lambda: LitGPT(tie=True), _lm, lambda: LitBlock),
    "gpt2": Case(_hf_gpt2, _hf, _hf_block),
}


def token_batches(steps: int, global_batch: int, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (global_batch, CONTEXT), generator=g) for _ in range(steps)]


def sgd_reference(case: Case, data: list[torch.Tensor], lr: float) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process, the whole batch, SGD: the losses and the final state dict."""
    model = case.model()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for batch in data:
        loss = case.loss(model, batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}
