"""hai_fsdp's shards in ``torch.distributed.checkpoint`` format: the box cover of a flat range (pure), and a
world-2 checkpoint read back at world 3 (model and AdamW state equal to the full state, element for element)
and converted by torch's ``dcp_to_torch_save`` into whole tensors under Lightning FSDP's keys (``model``,
``optimizer_0``). A folder in the layout earlier builds of lightning-haiscale wrote (``state_dict``, a list
``optimizer_states`` whose ``param_groups`` is one saved object) still loads, with the same values."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from examples.gpt.model import Block
from lightning_haiscale.fsdp import (
    FullyShardedDataParallel,
    full_optim_state_dict,
    full_state_dict,
    load_sharded_optim_state_dict,
    load_sharded_state_dict,
    sharded_optim_state_dict,
    sharded_state_dict,
)
from lightning_haiscale.fsdp.dcp import _optim_pieces, _pieces_of, _SavePlanner, boxes, load_dcp, save_dcp
from tests.distributed import run_distributed
from tests.fsdp.helpers import batches, local, loss_of, make_model


@pytest.mark.parametrize("shape", [(), (7,), (3, 4), (2, 3, 4), (2, 1, 3, 2)])
def test_boxes_cover_exactly_the_flat_range_in_order(shape: tuple[int, ...]) -> None:
    n = math.prod(shape)
    for start, end in itertools.combinations(range(n + 1), 2):
        painted = torch.zeros(shape, dtype=torch.long)
        flat_order = []
        for offsets, sizes in boxes(start, end, shape):
            region = painted[tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))]
            region += 1
            first = sum(o * math.prod(shape[d + 1 :]) for d, o in enumerate(offsets))
            flat_order.append((first, math.prod(sizes)))
        expected = torch.zeros(n, dtype=torch.long)
        expected[start:end] = 1
        assert torch.equal(painted.reshape(-1), expected), (shape, start, end)
        positions = [first for first, _ in flat_order]
        assert (
            positions[0] == start
            and all(  # contiguous, in flat order
                a + size == b for (a, size), b in zip(flat_order, positions[1:], strict=False)
            )
        ), (shape, start, end)


def _wrapped() -> tuple[FullyShardedDataParallel, torch.optim.Optimizer]:
    model = FullyShardedDataParallel(make_model(), auto_wrap_policy={Block})
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _save_at_two(rank: int, world: int, folder: str) -> None:
    model, optimizer = _wrapped()
    for batch in batches(2, 4):
        loss_of(model, local(batch, rank, world)).backward()
        optimizer.step()
        optimizer.zero_grad()
    save_dcp(Path(folder, "dcp"), sharded_state_dict(model), [sharded_optim_state_dict(model, optimizer)], None)
    _save_as_0_2(Path(folder, "legacy"), model, optimizer)
    full = {"state_dict": full_state_dict(model), "optim": full_optim_state_dict(model, optimizer)}
    if rank == 0:
        torch.save(full, Path(folder, "full.pt"))


def _save_as_0_2(path: Path, model: FullyShardedDataParallel, optimizer: torch.optim.Optimizer) -> None:
    """The folder an earlier lightning-haiscale's ``save_dcp`` wrote (its code, with the pieces as they are today)."""
    shard, optim = sharded_state_dict(model), sharded_optim_state_dict(model, optimizer)
    old_optimizer = {**_optim_pieces(optim), "param_groups": tuple(optim["param_groups"])}
    state = {"state_dict": {**_pieces_of(shard, aliases=True), **shard["buffers"]}, "optimizer_states": [old_optimizer]}
    dcp.save(state, checkpoint_id=path, planner=_SavePlanner(), process_group=None)
    dist.barrier()


def test_dcp_checkpoint_reshards_and_converts(tmp_path: Path) -> None:
    run_distributed(_save_at_two, 2, str(tmp_path), timeout=120)
    for saved in ("dcp", "legacy"):
        run_distributed(_load_at_three, 3, str(tmp_path), saved, timeout=120)
    dcp_to_torch_save(tmp_path / "dcp", tmp_path / "converted.pt")
    converted = torch.load(tmp_path / "converted.pt", weights_only=False)
    expected = torch.load(tmp_path / "full.pt", weights_only=True)
    # every key, the tied LM head ("4.lm_head.weight", GPT's token embedding) too: loads into the bare module
    assert converted["model"].keys() == expected["state_dict"].keys()
    assert all(torch.equal(v, expected["state_dict"][k]) for k, v in converted["model"].items())
    optim = converted["optimizer_0"]
    for name, values in expected["optim"]["state"].items():
        assert torch.equal(optim["state"][name]["exp_avg"], values["exp_avg"]), name
    assert list(optim["param_groups"]) == expected["optim"]["param_groups"]


def _load_at_three(rank: int, world: int, folder: str, saved: str) -> None:
    model, optimizer = _wrapped()
    model_shard, optim_shards = load_dcp(Path(folder, saved), model, 1)
    load_sharded_state_dict(model, [model_shard])
    load_sharded_optim_state_dict(model, optimizer, optim_shards)
    got = {"state_dict": full_state_dict(model), "optim": full_optim_state_dict(model, optimizer)}
    if rank == 0:
        expected = torch.load(Path(folder, "full.pt"), weights_only=True)
        assert got["state_dict"].keys() == expected["state_dict"].keys()
        assert all(torch.equal(got["state_dict"][k], v) for k, v in expected["state_dict"].items())
        for name, values in expected["optim"]["state"].items():
            for key, value in values.items():
                assert torch.equal(torch.as_tensor(got["optim"]["state"][name][key]), torch.as_tensor(value))
