"""``FullyShardedDataParallel.layout``, the public face that checkpoint code reads: from every rank's layout
and pieces alone (names, shapes, slices), the whole model can be rebuilt, equal to ``full_state_dict()``."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from examples.gpt.lightning_module import decay_groups
from examples.gpt.model import Block
from lightning_haiscale.fsdp import FullyShardedDataParallel
from lightning_haiscale.fsdp.layout import ShardLayout
from tests.distributed import run_distributed
from tests.fsdp.helpers import CFG, batches, local, loss_of, make_model


def _layout_and_pieces(rank: int, world: int) -> dict:
    model = FullyShardedDataParallel(make_model(), auto_wrap_policy={Block})
    torch.optim.SGD(model.parameters(), lr=0.1)
    loss_of(model, local(batches(1, 2 * world)[0], rank, world)).backward()  # shards as after a step
    return {
        "layout": model.layout,
        "pieces": {name: p.tolist() for name, p in model.named_parameters()},  # plain data across processes
        "full": {key: value.tolist() for key, value in model.full_state_dict(rank0_only=False).items()},
        "decay_groups": [len(g["params"]) for g in decay_groups(model.named_parameters(), 0.1)],
        "matrices": sum(p.dim() >= 2 for p in model.parameters()),
    }


def _rebuild(results: list[dict]) -> dict[str, torch.Tensor]:
    """Every parameter whole, from each rank's layout slices and pieces."""
    whole: dict[str, torch.Tensor] = {}
    for result in results:
        layout: ShardLayout = result["layout"]
        for _, param in layout.params():
            flat = whole.setdefault(param.name, torch.full((param.numel,), float("nan"))).view(-1)
            flat[param.start : param.end] = torch.tensor(result["pieces"][param.name])
    out = {}
    for _, param in results[0]["layout"].params():
        for name in param.names:  # a shared parameter appears under each of its names
            out[name] = whole[param.name].view(param.shape)
    return out


@pytest.mark.parametrize("world", [3])
def test_layout_slices_rebuild_the_full_state_dict(world: int) -> None:
    results = run_distributed(_layout_and_pieces, world)
    full = {key: torch.tensor(value) for key, value in results[0]["full"].items()}
    rebuilt = _rebuild(results)
    parameter_keys = [k for k in results[0]["layout"].keys if k in rebuilt]
    assert parameter_keys and set(rebuilt) <= set(full)
    for key in parameter_keys:
        assert torch.equal(rebuilt[key], full[key]), key
    assert list(results[0]["layout"].keys) == list(make_model().state_dict())  # the bare module's keys
    assert [r["layout"].rank for r in results] == list(range(world))
    assert all(r["layout"].world_size == world for r in results)
    assert len(results[0]["layout"].units) == 1 + CFG.n_layer  # the root and one unit per Block
    with pytest.raises(dataclasses.FrozenInstanceError):
        results[0]["layout"].rank = 5


def test_the_optimizer_sees_1d_pieces_so_weight_decay_goes_by_name() -> None:
    """The cost the wrapper's [Note: what the optimizer sees] names: a shape rule finds no matrices among the
    pieces, the GPT example's name rule finds the same groups as on one device."""
    results = run_distributed(_layout_and_pieces, 2)
    bare = make_model()
    assert all(r["matrices"] == 0 for r in results)  # nanoGPT's p.dim() >= 2 would decay nothing
    expected = [len(g["params"]) for g in decay_groups(bare.named_parameters(), 0.1)]
    assert len(expected) == 2 and all(r["decay_groups"] == expected for r in results)
