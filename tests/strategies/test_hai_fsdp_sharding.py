"""``HaiFSDPStrategy(sharding_strategy=..., activation_checkpointing_policy=...)`` under the Trainer against one
process: ``FULL_SHARD``, ``SHARD_GRAD_OP``, ``NO_SHARD`` and the hybrid strategies, each without activation
checkpointing, with it by keyword and with it applied by hand (torch's ``apply_activation_checkpointing`` in
``configure_model``), on 2 and 4 ranks, on three models built from configs in the test: our GPT example, a
transformers ``GPT2LMHeadModel`` and a litgpt-style GPT (a ``ModuleList`` of blocks, the head tied to the embedding).

The 9 (sharding, checkpointing) cases run in one spawn per world size; the models take turns in a Latin square,
so each model meets every sharding strategy and every checkpointing mode at each world size. The 4 ranks are 2
simulated hosts x 2 (``HFREDUCE_NODE_ID``: the engine's path across hosts), where ``HYBRID_SHARD`` and
``_HYBRID_SHARD_ZERO2`` (shard within a host, replicate across) and ``HYBRID_SHARD`` over a ``(2, 2)`` mesh also
run, each with one checkpointing mode and model.
Each case: 2 SGD steps in float64 (``precision="64-true"``), every rank on its own rows
(``use_distributed_sampler=False``); the one process takes every rank's rows at once. The full checkpoint must
hold exactly the plain model's keys. Tolerance: relative 1e-9 (float64 rounding is ~1e-16 per operation; the
reduction order differs from one process's; a wrong gradient scale or a lost step is off by more than 1e-4);
transformers' loss values, 1e-6 (its loss from ``labels=`` upcasts the logits to float32).
"""

from __future__ import annotations

import itertools
from typing import Any

import lightning as L
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointWrapper,
    apply_activation_checkpointing,
    checkpoint_wrapper,
)
from torch.utils.data import TensorDataset
from transformers import GPT2Config, GPT2LMHeadModel
from transformers.models.gpt2.modeling_gpt2 import GPT2Block

import lightning_haiscale  # noqa: F401  (registers "hai_fsdp")
from examples.gpt.model import GPT, Block, config
from lightning_haiscale.strategies import HaiFSDPStrategy
from tests.distributed import run_distributed
from tests.fsdp.helpers import deterministic_init
from tests.strategies.helpers import quiet_fit

STEPS, ROWS, SEQ, VOCAB, LR = 2, 2, 8, 61, 0.5  # ROWS per rank; a large lr so that a wrong step shows
SHARDINGS = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD")
CHECKPOINTING = ("none", "keyword", "by_hand")


class LitBlock(nn.Module):
    """litgpt's block layout: ``norm_1``, ``attn`` (fused ``qkv``, ``proj``), ``norm_2``, ``mlp``."""

    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.norm_1, self.norm_2 = nn.LayerNorm(n_embd), nn.LayerNorm(n_embd)
        self.qkv, self.proj = nn.Linear(n_embd, 3 * n_embd), nn.Linear(n_embd, n_embd)
        self.fc, self.mlp_proj = nn.Linear(n_embd, 4 * n_embd), nn.Linear(4 * n_embd, n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(self.norm_1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))  # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, C)
        x = x + self.proj(y)
        return x + self.mlp_proj(F.gelu(self.fc(self.norm_2(x))))


class LitGPT(nn.Module):
    """litgpt's ``GPT`` in small: ``transformer.{wte, h, ln_f}`` and ``lm_head`` tied to ``wte``."""

    def __init__(self, n_layer: int = 2, n_embd: int = 24, n_head: int = 2) -> None:
        super().__init__()
        self.lm_head = nn.Linear(n_embd, VOCAB, bias=False)
        self.transformer = nn.ModuleDict(
            {
                "wte": nn.Embedding(VOCAB, n_embd),
                "h": nn.ModuleList(LitBlock(n_embd, n_head) for _ in range(n_layer)),
                "ln_f": nn.LayerNorm(n_embd),
            }
        )
        self.lm_head.weight = self.transformer.wte.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.transformer.wte(idx)
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))


def _gpt2() -> GPT2LMHeadModel:
    cfg = GPT2Config(
        n_layer=2, n_embd=24, n_head=2, vocab_size=VOCAB, n_positions=SEQ + 1, bos_token_id=0, eos_token_id=0,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=True,
    )  # fmt: skip
    return GPT2LMHeadModel(cfg)


def _gpt_example() -> GPT:
    return GPT(config("tiny", n_layer=2, n_embd=24, n_head=2, vocab_size=VOCAB, block_size=SEQ))


MODELS: dict[str, tuple[Any, type[nn.Module]]] = {
    "gpt_example": (_gpt_example, Block),
    "transformers_gpt2": (_gpt2, GPT2Block),
    "litgpt_style": (LitGPT, LitBlock),
}


def _loss(name: str, model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    if name == "transformers_gpt2":
        return model(input_ids=tokens, labels=tokens).loss
    x, y = tokens[:, :-1], tokens[:, 1:]
    return F.cross_entropy(model(x).flatten(0, 1), y.flatten())


class _Module(L.LightningModule):
    def __init__(self, name: str, by_hand: bool) -> None:
        super().__init__()
        self.name, self.by_hand = name, by_hand
        self.model: nn.Module | None = None
        self.losses: list[float] = []

    def configure_model(self) -> None:
        if self.model is None:
            build, block = MODELS[self.name]
            self.model = build()
            if self.by_hand:
                check = lambda m: isinstance(m, block)  # noqa: E731
                apply_activation_checkpointing(self.model, checkpoint_wrapper_fn=checkpoint_wrapper, check_fn=check)

    def training_step(self, batch: tuple[torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = _loss(self.name, self.model, batch[0])
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        self.losses.append(mean.item() / dist.get_world_size())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=LR)


def _tokens(world: int) -> torch.Tensor:
    """(STEPS, world * ROWS, SEQ + 1) token ids: step s's rows of every rank."""
    return torch.randint(0, VOCAB, (STEPS, world * ROWS, SEQ + 1), generator=torch.Generator().manual_seed(3))


def _reference(name: str, tokens: torch.Tensor) -> tuple[dict[str, torch.Tensor], list[float]]:
    model = MODELS[name][0]()
    for module in model.modules():
        deterministic_init(module)
    model = model.double()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        loss = _loss(name, model, tokens[step])
        losses.append(loss.item())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return model.state_dict(), losses


Case = tuple[str, str, str, tuple[int, int] | None]  # sharding, checkpointing, model, device_mesh


def cases(world: int) -> list[Case]:
    """(sharding, checkpointing, model, mesh): a Latin square over the models, shifted per world size; on 4 ranks
    (2 simulated hosts) also the hybrid strategies, each with one checkpointing mode and model."""
    names = list(MODELS)
    grid = itertools.product(enumerate(SHARDINGS), enumerate(CHECKPOINTING))
    chosen: list[Case] = [(s, c, names[(i + j + world) % len(names)], None) for (i, s), (j, c) in grid]
    return chosen + (HYBRID if world == 4 else [])


HYBRID: list[Case] = [
    ("HYBRID_SHARD", "keyword", "litgpt_style", None),  # no mesh: shard within each host, replicate across
    ("_HYBRID_SHARD_ZERO2", "by_hand", "transformers_gpt2", None),
    ("HYBRID_SHARD", "none", "gpt_example", (2, 2)),  # a (replicate, shard) mesh
]


def _run_case(rank: int, world: int, sharding: str, checkpointing: str, name: str, mesh: Any) -> None:
    block = MODELS[name][1]
    ac = {"activation_checkpointing_policy": {block}} if checkpointing == "keyword" else {}
    strategy = HaiFSDPStrategy(
        auto_wrap_policy={block}, param_init_fn=deterministic_init, sharding_strategy=sharding, device_mesh=mesh, **ac
    )
    tokens = _tokens(world)
    mine = TensorDataset(tokens[:, rank * ROWS : (rank + 1) * ROWS].flatten(0, 1))
    module = _Module(name, by_hand=checkpointing == "by_hand")
    trainer = quiet_fit(module, strategy, STEPS, mine, ROWS, use_distributed_sampler=False, precision="64-true")
    assert trainer.strategy.model.sharding_strategy.value == sharding  # what the wrapper runs
    checkpointed = any(isinstance(m, CheckpointWrapper) for m in module.modules())
    assert checkpointed == (checkpointing != "none"), (sharding, checkpointing, name)
    full = trainer.strategy.model.full_state_dict()
    if rank != 0:
        return
    expected, losses = _reference(name, tokens)
    case = f"{sharding} (mesh {mesh}), checkpointing {checkpointing}, {name}"
    assert sorted(full) == sorted(f"model.{k}" for k in expected), case  # the plain model's keys, every one
    for key, value in expected.items():
        torch.testing.assert_close(full[f"model.{key}"], value, rtol=1e-9, atol=1e-12, msg=f"{case}: {key}")
    # transformers' loss (from labels=) upcasts the logits to float32: its values carry float32 rounding (~1e-7)
    loss_rtol = 1e-6 if name == "transformers_gpt2" else 1e-9
    torch.testing.assert_close(module.losses, losses, rtol=loss_rtol, atol=0, msg=f"{case}: {module.losses} {losses}")


def _all_cases(rank: int, world: int, selected: list[Case]) -> None:
    for case in selected:
        _run_case(rank, world, *case)
        dist.barrier()


@pytest.mark.parametrize(("world", "hosts"), [(2, None), (4, ["a", "a", "b", "b"])], ids=["2 ranks", "2 hosts x 2"])
def test_sharding_and_checkpointing_match_one_process(world: int, hosts: list[str] | None) -> None:
    run_distributed(_all_cases, world, cases(world), node_ids=hosts, timeout=600)
