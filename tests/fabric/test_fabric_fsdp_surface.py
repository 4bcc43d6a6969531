"""Fabric's ``hai_fsdp`` checkpoints, as Lightning's Fabric documents them (``fabric.save`` with ``filter=``,
``fabric.load`` with ``strict=``, ``fabric.load_raw``) and in the layouts of Lightning Fabric's ``FSDPStrategy``.

Was: ``fabric.load_raw(path, model)`` raised ``ValueError: hai_fsdp loads into a dict of objects``, and
``fabric.save(..., filter=...)`` raised. Lightning's ``tests_fabric/strategies/test_fsdp_integration.py`` expects a
full file with the state's keys and index-keyed optimizer states, a filtered save to keep only what the filter
accepts, a sharded save with a filter to raise, a strict load of a missing key to raise ``KeyError``, and
``load_raw`` to take a raw state dict. A folder Fabric's hai_fsdp wrote before issue 31 still loads, with its momentum.
Values are compared exactly with the model that saved them (the same float32 tensors gathered and scattered: no
arithmetic).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from lightning.fabric import Fabric
from torch.distributed.checkpoint import FileSystemReader

import lightning_haiscale  # noqa: F401  (registers the Fabric names)
from lightning_haiscale.fabric import HaiFSDPStrategy
from lightning_haiscale.fsdp.dcp import _optim_pieces, _pieces_of, _SavePlanner
from lightning_haiscale.testing.parity import BATCH, Classifier, data
from tests.distributed import run_distributed


def _setup(kind: str) -> tuple[Fabric, torch.nn.Module, torch.optim.Optimizer]:
    fabric = Fabric(accelerator="cpu", devices=2, strategy=HaiFSDPStrategy(state_dict_type=kind))
    fabric.launch()
    module = Classifier()
    model, optimizer = fabric.setup(module, torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9))
    x, y = data(2 * BATCH).tensors
    rank = fabric.global_rank
    fabric.backward(torch.nn.functional.cross_entropy(model(x[rank::2]), y[rank::2]))
    optimizer.step()
    return fabric, model, optimizer


def _full(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The whole state of the module ``fabric.setup`` returned (its wrapper's collective ``full_state_dict``: on
    rank 0, ``{}`` elsewhere)."""
    return model._forward_module.full_state_dict()


def _equal(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert got.keys() == expected.keys()
    assert all(torch.equal(got[k], v) for k, v in expected.items())


def _surface(rank: int, world: int, tmp: str) -> None:
    tmp_path = Path(tmp)
    fabric, model, optimizer = _setup("full")
    whole = _full(model)
    path = tmp_path / "full.ckpt"
    fabric.save(path, {"model": model, "optimizer": optimizer, "step": 3})
    fabric.save(tmp_path / "weights.ckpt", {"model": model, "step": 3}, filter={"model": lambda k, v: "weight" in k})
    if rank == 0:
        saved = torch.load(path, weights_only=True)
        _equal(saved["model"], whole)
        assert sorted(saved["optimizer"]["state"]) == list(range(16))  # torch's layout, as Lightning's FSDP
        filtered = torch.load(tmp_path / "weights.ckpt", weights_only=True)
        assert sorted(filtered["model"]) == sorted(k for k in whole if "weight" in k) and filtered["step"] == 3
        torch.save({k: v * 2 for k, v in whole.items()}, tmp_path / "raw.pt")  # a raw state dict
    dist.barrier()
    with pytest.raises(KeyError, match="'missing' that does not exist in the loaded checkpoint"):
        fabric.load(path, {"model": model, "optimizer": optimizer, "missing": 0})
    rest = fabric.load(path, {"model": model, "optimizer": optimizer, "missing": 0}, strict=False)
    assert rest == {"step": 3}
    fabric.load_raw(tmp_path / "raw.pt", model)
    doubled = _full(model)
    if rank == 0:
        _equal(doubled, {k: v * 2 for k, v in whole.items()})

    fabric, model, optimizer = _setup("sharded")
    whole = _full(model)
    folder = tmp_path / "sharded"
    fabric.save(folder, {"model": model, "optimizer": optimizer, "step": 3})
    with pytest.raises(NotImplementedError, match="filter"):
        fabric.save(tmp_path / "other", {"model": model}, filter={"model": lambda k, v: True})
    keys = {path[0] for path in FileSystemReader(folder).read_metadata().planner_data.values()}
    assert keys == {"model", "optimizer"}  # Lightning Fabric's layout: the state's own keys
    bare = Classifier()
    fabric.load_raw(folder, bare)  # a sharded folder's module, whole, into a module Fabric never set up
    if rank == 0:
        _equal(bare.state_dict(), whole)
        assert torch.load(folder / "meta.pt", weights_only=True) == {"step": 3}
    _save_as_0_2(fabric, tmp_path / "old", model, optimizer)
    momentum = [v["momentum_buffer"].clone() for v in optimizer.state.values()]
    fabric, model, optimizer = _setup("sharded")
    optimizer.step()  # a second step: other weights and momentum than the saved ones

    def same_momentum() -> bool:
        pairs = zip(momentum, optimizer.state.values(), strict=True)
        return all(torch.equal(a, v["momentum_buffer"]) for a, v in pairs)

    assert not same_momentum()
    assert fabric.load(tmp_path / "old", {"model": model, "optimizer": optimizer}) == {"step": 3}
    assert same_momentum()
    again = _full(model)
    if rank == 0:
        _equal(again, whole)


def _save_as_0_2(fabric: Fabric, path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """The folder Fabric's hai_fsdp of an earlier lightning-haiscale wrote (its layout: ``state_dict``, a list
    ``optimizer_states`` with ``param_groups`` as one object, and which names they were in ``meta.pt``)."""
    wrapper = model._forward_module
    shard, optim = wrapper.sharded_state_dict(), wrapper.sharded_optim_state_dict(optimizer)
    pieces = {**_pieces_of(shard, aliases=True), **shard["buffers"]}
    old_optimizer = {**_optim_pieces(optim), "param_groups": tuple(optim["param_groups"])}
    dcp.save({"state_dict": pieces, "optimizer_states": [old_optimizer]}, checkpoint_id=path, planner=_SavePlanner())
    if fabric.global_rank == 0:
        names = {"module": "model", "optimizers": ["optimizer"]}
        torch.save({"step": 3, "hai_fsdp_names": names}, path / "meta.pt")
    dist.barrier()


@pytest.mark.slow  # 20-100 s on 2 loaded cores
def test_fabric_save_load_and_load_raw(tmp_path: Path) -> None:
    run_distributed(_surface, 2, str(tmp_path), timeout=300)
