"""Fabric's ``hai_fsdp`` with activation checkpointing, as issue 24 found it: a litgpt-style GPT (blocks in a
``ModuleList``, head tied to the embedding) under ``fabric.init_module(empty_init=True)``, on 2 simulated hosts x 2
ranks: ``HYBRID_SHARD`` checkpointed by keyword (``activation_checkpointing_policy``), and ``FULL_SHARD``
checkpointed by hand (torch's ``apply_activation_checkpointing`` before ``fabric.setup``).

Each: 2 SGD steps in float64 (the default dtype) against one process on every rank's rows; ``fabric.save`` (full)
holds exactly the plain model's keys and values and loads with plain ``torch.load`` into the bare model strictly.
A fresh setup of the same mode resumes the full save and takes the same next step bit-for-bit; one of the other
mode resumes the sharded (DCP) save: ``HYBRID_SHARD`` into ``FULL_SHARD`` and the reverse. Tolerance: relative 1e-9
against one process (float64; see ``tests/strategies/test_hai_fsdp_sharding.py``), 1e-12 across modes (the same
float64 step, reduced in another order).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.fabric import Fabric
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointWrapper,
    apply_activation_checkpointing,
)

import lightning_haiscale  # noqa: F401  (registers the Fabric names)
from lightning_haiscale.fabric import HaiFSDPStrategy
from tests.distributed import run_distributed
from tests.fsdp.helpers import deterministic_init
from tests.strategies.test_hai_fsdp_sharding import VOCAB, LitBlock, LitGPT

STEPS, ROWS, SEQ, LR = 2, 2, 8, 0.5
HOSTS = 2  # simulated, 2 ranks each


def _tokens(world: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (STEPS + 1, world * ROWS, SEQ + 1), generator=torch.Generator().manual_seed(5))


def _loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())


def _reference(tokens: torch.Tensor) -> dict[str, torch.Tensor]:
    model = LitGPT()
    for module in model.modules():
        deterministic_init(module)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(STEPS):
        _loss(model, tokens[step]).backward()
        optimizer.step()
        optimizer.zero_grad()
    return model.state_dict()


def _setup(mode: str, world: int) -> tuple[Fabric, Any, Any]:
    options: dict[str, Any] = {"auto_wrap_policy": {LitBlock}, "param_init_fn": deterministic_init}
    if mode == "keyword":
        options.update(activation_checkpointing_policy={LitBlock}, sharding_strategy="HYBRID_SHARD")
    strategy = HaiFSDPStrategy(**options)
    fabric = Fabric(accelerator="cpu", devices=world // HOSTS, num_nodes=HOSTS, strategy=strategy)
    fabric.launch()
    assert fabric.global_rank == dist.get_rank()
    with fabric.init_module(empty_init=True):
        model = LitGPT()
    if mode == "by_hand":
        apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, LitBlock))
    model = fabric.setup_module(model)
    optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=LR))
    assert sum(isinstance(m, CheckpointWrapper) for m in model.modules()) == 2
    return fabric, model, optimizer


def _step(fabric: Fabric, model: Any, optimizer: Any, tokens: torch.Tensor) -> None:
    rank = fabric.global_rank
    fabric.backward(_loss(model, tokens[rank * ROWS : (rank + 1) * ROWS]))
    optimizer.step()
    optimizer.zero_grad()


def _full(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, weights_only=True)["model"]


def _checkpointed(rank: int, world: int, tmp: str) -> None:
    # float64 throughout (Fabric's "64-true" casts the model's output back to float32)
    torch.set_default_dtype(torch.float64)
    tokens = _tokens(world)
    for mode in ("keyword", "by_hand"):
        fabric, model, optimizer = _setup(mode, world)
        for step in range(STEPS):
            _step(fabric, model, optimizer, tokens[step])
        full, sharded = Path(tmp, f"{mode}.ckpt"), Path(tmp, f"{mode}-sharded")
        fabric.save(full, {"model": model, "optimizer": optimizer})
        fabric.strategy.state_dict_type = "sharded"
        fabric.save(sharded, {"model": model, "optimizer": optimizer})
        fabric.strategy.state_dict_type = "full"
        _step(fabric, model, optimizer, tokens[STEPS])
        fabric.save(Path(tmp, f"{mode}-next.ckpt"), {"model": model})
        if rank == 0:
            saved, expected = _full(full), _reference(tokens)
            assert sorted(saved) == sorted(expected), mode  # the plain model's keys, every one
            for key, value in expected.items():
                torch.testing.assert_close(saved[key], value, rtol=1e-9, atol=1e-12, msg=f"{mode}: {key}")
            LitGPT().load_state_dict(saved, strict=True)
        other = {"keyword": "by_hand", "by_hand": "keyword"}[mode]
        for path, resume_mode in ((full, mode), (sharded, other)):  # a fresh setup takes the same next step
            fabric, model, optimizer = _setup(resume_mode, world)
            fabric.load(path, {"model": model, "optimizer": optimizer})
            _step(fabric, model, optimizer, tokens[STEPS])
            fabric.save(Path(tmp, f"{mode}-resumed.ckpt"), {"model": model})
            if rank == 0:
                resumed, uninterrupted = _full(Path(tmp, f"{mode}-resumed.ckpt")), _full(Path(tmp, f"{mode}-next.ckpt"))
                exact = resume_mode == mode
                for key, value in uninterrupted.items():
                    rtol, atol = (0.0, 0.0) if exact else (1e-12, 1e-15)
                    torch.testing.assert_close(resumed[key], value, rtol=rtol, atol=atol, msg=f"{mode}: {path.name}")
            dist.barrier()


def test_checkpointed_litgpt_saves_every_key_and_resumes_across_modes(tmp_path: Path) -> None:
    run_distributed(_checkpointed, 2 * HOSTS, str(tmp_path), node_ids=["a", "a", "b", "b"], timeout=400)
