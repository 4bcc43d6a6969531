"""A GPT-2 style language model, small enough to read top to bottom (after nanoGPT).

The network is an ``nn.Sequential`` of ``Embeddings``, ``Block`` x n_layer and ``LMHead``, so pipeline
strategies can cut it into stages without a change; ``GPT`` is that sequence with a name.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class GPTConfig:
    block_size: int = 256  # longest context, in tokens
    vocab_size: int = 256  # byte-level tokens by default
    n_layer: int = 4  # transformer blocks
    n_head: int = 4  # attention heads per block
    n_embd: int = 128  # model width (d_model)
    dropout: float = 0.0  # 0 keeps runs deterministic, which the parity tests rely on
    bias: bool = True  # biases in Linear and LayerNorm, as GPT-2
    tie_weights: bool = True  # LM head shares the token embedding (GPT-2)


CONFIGS: dict[str, GPTConfig] = {
    "tiny": GPTConfig(),  # ~0.9M parameters: tests and the demo
    "small": GPTConfig(block_size=1024, n_layer=12, n_head=12, n_embd=768),  # GPT-2 small width
    "medium": GPTConfig(block_size=1024, n_layer=24, n_head=16, n_embd=1024),  # GPT-2 Medium
}


def config(name: str, **overrides: object) -> GPTConfig:
    """A named config with fields replaced, e.g. ``config("tiny", n_layer=2)``."""
    if name not in CONFIGS:
        raise ValueError(f"config={name!r} is unknown; choose one of {sorted(CONFIGS)}")
    return replace(CONFIGS[name], **overrides)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        if cfg.n_embd % cfg.n_head:
            raise ValueError(f"n_embd={cfg.n_embd} must be divisible by n_head={cfg.n_head}")
        self.n_head = cfg.n_head
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)  # q, k, v in one matmul
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape  # batch, time, channels
        q, k, v = self.c_attn(x).split(C, dim=2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        dropout = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True)  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C): heads side by side again
        return self.c_proj(y)


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x), approximate="tanh")))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class Embeddings(nn.Module):
    """Token plus learned position embeddings: (B, T) token ids -> (B, T, C)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.block_size = cfg.block_size
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        T = idx.size(1)
        if T > self.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size={self.block_size}")
        pos = torch.arange(T, device=idx.device)  # (T,)
        return self.drop(self.wte(idx) + self.wpe(pos))  # (B, T, C)


class LMHead(nn.Module):
    """Final LayerNorm and the projection to vocabulary logits: (B, T, C) -> (B, T, vocab)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(x))


class GPT(nn.Sequential):
    """``GPT(cfg)(idx)`` maps (B, T) token ids to (B, T, vocab) logits."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__(Embeddings(cfg), *(Block(cfg) for _ in range(cfg.n_layer)), LMHead(cfg))
        self.cfg = cfg
        if cfg.tie_weights:
            self[-1].lm_head.weight = self[0].wte.weight
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):  # GPT-2: scale residual projections by depth
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy: logits (B, T, vocab), targets (B, T)."""
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
