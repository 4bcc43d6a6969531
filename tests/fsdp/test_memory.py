"""hai_fsdp's memory during backward: at most two units' unsharded gradients are alive at once (see
fully_sharded [Note: one reduce-scatter in flight]; issue #15, GPT-2 Medium's peak)."""

from __future__ import annotations

import weakref

import torch

import lightning_haiscale.fsdp.param_group as param_group
from examples.gpt.model import Block
from lightning_haiscale.fsdp import FullyShardedDataParallel
from tests.distributed import run_distributed
from tests.fsdp.helpers import batches, local, loss_of, make_model


def _most_alive(rank: int, world: int) -> dict:
    """The most unsharded gradients alive when a unit starts its reduce-scatter (its own included)."""
    alive: list[weakref.ref] = []
    most = 0
    reduce_scatter = param_group.reduce_scatter_grads

    def recording(comm: object, shard_grad: torch.Tensor, full_grad: torch.Tensor) -> object:
        nonlocal most
        alive.append(weakref.ref(full_grad))
        most = max(most, sum(ref() is not None for ref in alive))
        return reduce_scatter(comm, shard_grad, full_grad)

    param_group.reduce_scatter_grads = recording  # this spawned process only
    model = FullyShardedDataParallel(make_model(), auto_wrap_policy={Block})
    for batch in batches(2, 2 * world):
        loss_of(model, local(batch, rank, world)).backward()
    return {"most": most, "units": len(model.layout.units), "reduced": len(alive)}


def test_at_most_two_unsharded_gradients_alive() -> None:
    results = run_distributed(_most_alive, 2)
    for r in results:
        assert r["units"] >= 4 and r["reduced"] == 2 * r["units"]  # a sound count: every unit, both steps
        assert r["most"] <= 2, f"{r['most']} unsharded gradients alive at once"
