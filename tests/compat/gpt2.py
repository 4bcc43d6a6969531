"""What haiscale's published GPT-2 scripts import from their ``gpt.py``, shrunk, and the one-process reference.

The scripts train ``gpt2_medium(...).core`` (an ``nn.Sequential``) with ``GPTLoss(chunks)`` on pipelines and
``GPTLoss()`` alone, the same learning rate and global batch: the criterion divides each microbatch's
mean loss by ``chunks`` and ``forward_backward`` sums the microbatches' gradients. The reference trains the
same model on one process over the same global batches with the plain mean loss; SGD (with momentum, so a
resumed optimizer state matters) shows any gradient-scale difference, which Adam would hide.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from examples.gpt.model import GPT, config
from lightning_haiscale.testing.parity import FLOAT64_RTOL, assert_parity, default_dtype

CFG = config("tiny", vocab_size=32, n_embd=16, n_head=2, n_layer=6, block_size=8, tie_weights=False)  # 8 layers
GLOBAL_BATCH = 16  # rows of every step's global batch, split over the data-parallel replicas
STEPS = 4
LR, MOMENTUM, MAX_NORM = 0.5, 0.9, 0.05  # MAX_NORM: small enough that clipping acts (checked)
# The compat tests run in float64 (model, data, optimizer: every world and reference under
# ``default_dtype(torch.float64)``), so rounding cannot decide them: [Note: parity tolerances] in
# lightning_haiscale/testing/parity.py. In float32 the weights grow to ~10 at this learning rate and another
# summation order of the microbatches' gradients moved GPipe's stage 0 by 3.3e-6 on an AVX-512 EPYC (issue 23).
DTYPE = torch.float64
RTOL = FLOAT64_RTOL


class GPTLoss(nn.Module):
    """Next-token cross-entropy of ``(logits, tokens)``, divided by ``chunks`` (haiscale's pipeline criterion)."""

    def __init__(self, chunks: int = 1) -> None:
        super().__init__()
        self.chunks = chunks

    def forward(self, logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        logits, targets = logits[:, :-1], tokens[:, 1:]  # (B, T-1, V), (B, T-1)
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1)) / self.chunks


def gpt() -> GPT:
    torch.manual_seed(12345)
    return GPT(CFG)


def global_batch(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(66229 + step)
    return torch.randint(0, CFG.vocab_size, (GLOBAL_BATCH, CFG.block_size), generator=g)


def shard(tokens: torch.Tensor, dp_rank: int, dp_size: int) -> torch.Tensor:
    rows = tokens.size(0) // dp_size
    return tokens[dp_rank * rows : (dp_rank + 1) * rows]


@default_dtype(DTYPE)
def reference(clip_groups: Iterable[Iterable[str]], steps: int = STEPS) -> dict:
    """One process over the global batches: per-step mean losses, final state, evaluation loss.

    ``clip_groups``: names of the parameters each pipeline rank holds; ``torch.nn.utils.clip_grad_norm_``
    called on a rank's ``model.parameters()`` clips by that rank's own norm, so the reference does the same.
    """
    model = gpt()
    params = dict(model.named_parameters())
    groups = [[params[n] for n in names] for names in clip_groups]
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    losses, clipped = [], False
    for step in range(steps):
        tokens = global_batch(step)
        logits = model(tokens)
        loss = GPTLoss()(logits, tokens)
        loss.backward()
        for group in groups:
            clipped |= bool(torch.nn.utils.clip_grad_norm_(group, MAX_NORM) > MAX_NORM)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    with torch.no_grad():
        tokens = global_batch(100)
        evaluation = GPTLoss()(model(tokens), tokens).item()
    state = {k: v.tolist() for k, v in model.state_dict().items()}
    return {"losses": losses, "state": state, "eval": evaluation, "clipped": clipped, "logits": logits.tolist()}


def stage_names(seq: nn.Sequential, world: int, balance: list[int] | None = None, chunks: int = 1) -> list[list[str]]:
    """The parameter names rank ``r`` of ``world`` holds after ``partition``, for every ``r``."""
    from lightning_haiscale.pipeline import partition

    names = []
    for r in range(world):
        parts = partition(seq, r, world, balance=balance, num_model_chunks=chunks)
        parts = parts if isinstance(parts, list) else [parts]
        names.append([n for p in parts for n, _ in p.named_parameters()])
    return names


def assert_matches(state: dict[str, list], expected: dict[str, list], label: str) -> None:
    """Every tensor of ``state`` equals ``expected``'s at the float64 tolerances (``DTYPE``)."""
    assert_parity(state, {name: expected[name] for name in state}, label=label)
