"""A small GPT with uneven sizes, its data, and a single-process reference run for FSDP parity tests."""

from __future__ import annotations

import torch

from examples.gpt.model import GPT, config, lm_loss

# Odd sizes so that no unit divides evenly by 2, 3 or 4 ranks; no biases, whose key part has a zero
# gradient that Adam would turn rounding noise into updates of size lr.
CFG = config("tiny", vocab_size=67, n_embd=36, n_head=3, n_layer=3, block_size=16, bias=False)
LR = 1e-3  # AdamW's, in the checkpoint tests (whose point is its state)
SGD_LR = 0.5  # the parity tests' SGD (momentum 0.9): Adam's normalised step would hide a wrong gradient scale
# Gradient norms of the parity runs are 1.0-1.27 at world 2, 0.83-1.03 at 3, 0.78-0.89 at 4: clipping acts at
# every step at world 2 (the norm taken across shards), at the first at world 3, never at world 4 (where a
# wrong gradient scale cannot be normalised away).
MAX_NORM = 1.0


def deterministic_init(module: torch.nn.Module) -> None:
    """Deterministic per parameter name and size, whatever the order in which units materialize."""
    with torch.no_grad():
        for name, p in module.named_parameters(recurse=False):
            if not p.is_meta:
                g = torch.Generator().manual_seed(p.numel() + len(name))
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)


def make_model(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(CFG)


def batches(steps: int, global_batch: int, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, CFG.vocab_size, (global_batch, CFG.block_size + 1), generator=g) for _ in range(steps)]


def local(batch: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    per_rank = batch.size(0) // world
    return batch[rank * per_rank : (rank + 1) * per_rank]


def loss_of(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return lm_loss(model(batch[:, :-1]), batch[:, 1:])


def reference_run(data: list[torch.Tensor], world: int, clip: bool) -> tuple[list[float], dict[str, torch.Tensor]]:
    """SGD with momentum on one process over the whole batches: the mean losses and the final state dict.

    Each batch is processed as ``world`` micro-batches whose gradients are summed, then divided by
    ``world``: the same arithmetic as averaging over ranks.
    """
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=SGD_LR, momentum=0.9)
    losses = []
    for batch in data:
        total = 0.0
        for rank in range(world):
            loss = loss_of(model, local(batch, rank, world))
            loss.backward()
            total += loss.item()
        for p in model.parameters():
            p.grad.div_(world)
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        opt.step()
        opt.zero_grad()
        losses.append(total / world)
    return losses, model.state_dict()


def max_rel_error(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> float:
    """max over tensors of max|a - e| / max|e|."""
    assert actual.keys() == expected.keys()
    return max(((actual[k] - v).abs().max() / v.abs().max().clamp(min=1e-12)).item() for k, v in expected.items())
