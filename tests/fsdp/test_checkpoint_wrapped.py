"""Activation checkpointing applied by hand (torch's ``apply_activation_checkpointing``), before or after
wrapping: every checkpoint holds every key of the plain model, loads strictly into it, and a state dict whose
keys do not match the shards raises (issue 24: the block keys were silently dropped).

Models: the example GPT, a litgpt-style GPT (lm_head tied and not) and transformers' GPT2LMHeadModel, in float64
with SGD on 2 ranks against one process over the whole batch. Tolerance 1e-10 relative: float64 rounding of
the same sums in another order (the averaging over ranks) is ~1e-16 per operation."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from lightning_haiscale.fsdp import FullyShardedDataParallel
from lightning_haiscale.fsdp.dcp import load_dcp, save_dcp
from tests.distributed import run_distributed
from tests.fsdp.models import CASES, Case, sgd_reference, token_batches

STEPS, LR, WORLD = 3, 0.5, 2
WHEN = ("before", "after")  # checkpointing applied to the plain model, or to the wrapped one


def checkpoint_blocks(model: nn.Module, block: type[nn.Module]) -> None:
    apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, block))


def _wrapped(case: Case, when: str) -> FullyShardedDataParallel:
    model, block = case.model(), case.block()
    if when == "before":
        checkpoint_blocks(model, block)
    wrapped = FullyShardedDataParallel(model, auto_wrap_policy={block})
    if when == "after":
        checkpoint_blocks(wrapped, block)
    return wrapped


def _train(case: Case, model: nn.Module, rank: int) -> list[float]:
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for batch in token_batches(STEPS, 2 * WORLD):
        loss = case.loss(model, batch[rank * 2 : rank * 2 + 2])
        loss.backward()
        opt.step()
        opt.zero_grad()
        value = loss.detach().reshape(1)
        model.comm.all_reduce(value, op="avg")
        losses.append(value.item())
    return losses


def _error(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> float:
    return max(((actual[k] - v).abs().max() / v.abs().max().clamp(min=1e-12)).item() for k, v in expected.items())


def _run_case(name: str, when: str, rank: int, folder: Path) -> dict:
    case = CASES[name]
    model = _wrapped(case, when)
    losses = _train(case, model, rank)
    full = model.full_state_dict(rank0_only=False)
    plain = case.model(seed=1)
    plain.load_state_dict(full, strict=True)  # every key of the plain model, nothing else
    loaded = plain.state_dict()
    # a full and a DCP checkpoint load back, strictly, into a model with and one without checkpointing
    again = _wrapped(case, "before")
    again.load_full_state_dict(full, strict=True)
    bare = FullyShardedDataParallel(case.model(seed=2), auto_wrap_policy={case.block()})
    path = folder / f"{name}_{when}"
    save_dcp(path, model.sharded_state_dict(), [], model.comm.group)
    shard, _ = load_dcp(path, bare, 0)
    bare.load_sharded_state_dict([shard], strict=True)
    middle = list(full)[len(full) // 2]  # a block's key
    with pytest.raises(KeyError, match="missing keys"):
        again.load_full_state_dict({k: v for k, v in full.items() if k != middle}, strict=True)
    with pytest.raises(KeyError, match="unexpected keys"):
        again.load_full_state_dict({**full, "h.0._checkpoint_wrapped_module.x": full[next(iter(full))]})
    return {
        "losses": losses,
        "keys": list(full),
        "error": _error(full, loaded),
        "full_again": _error(again.full_state_dict(rank0_only=False), full),
        "dcp_again": _error(bare.full_state_dict(rank0_only=False), full),
        "sharded_keys": sorted(model.sharded_state_dict()["tensors"]),
        "state": {k: v.tolist() for k, v in full.items()} if rank == 0 else None,
    }


def _hooks_that_drop_keys(rank: int) -> list[str]:
    """A state_dict hook of the user's that drops a parameter's key: saving and loading raise, naming it."""
    case = CASES["litgpt"]
    full = FullyShardedDataParallel(case.model(), auto_wrap_policy={case.block()}).full_state_dict(rank0_only=False)

    def drop(module: nn.Module, state_dict: dict, prefix: str, meta: object) -> None:
        del state_dict[f"{prefix}norm_1.weight"]

    plain = case.model()
    plain.transformer["h"][0].register_state_dict_post_hook(drop)
    model = FullyShardedDataParallel(plain, auto_wrap_policy={case.block()})
    messages = []
    for call in (model.full_state_dict, model.sharded_state_dict, lambda: model.load_full_state_dict(full)):
        with pytest.raises(KeyError, match=r"have no state-dict key") as raised:
            call()
        messages.append(str(raised.value))
    return messages


def _all(rank: int, world: int, folder: str) -> dict:
    results = {(name, when): _run_case(name, when, rank, Path(folder)) for name in CASES for when in WHEN}
    return {"cases": results, "hooks": _hooks_that_drop_keys(rank)}


def test_checkpointed_blocks_keep_every_key_and_train_like_one_process(tmp_path: Path) -> None:
    results = run_distributed(_all, WORLD, str(tmp_path), timeout=600)
    for name, case in CASES.items():
        ref_losses, ref_state = sgd_reference(case, token_batches(STEPS, 2 * WORLD), LR)
        keys = list(case.model().state_dict())
        for when in WHEN:
            got = results[0]["cases"][(name, when)]
            assert got["keys"] == keys, (name, when)
            assert got["error"] == 0 and got["full_again"] == 0 and got["dcp_again"] == 0, (name, when)
            state = {k: torch.tensor(v, dtype=torch.float64) for k, v in got["state"].items()}
            assert _error(state, ref_state) < 1e-10, (name, when)
            torch.testing.assert_close(got["losses"], ref_losses, rtol=1e-10, atol=0)
            assert all("_checkpoint_wrapped_module" not in k for k in got["sharded_keys"]), (name, when)
        merged = tmp_path / f"{name}.pt"
        dcp_to_torch_save(tmp_path / f"{name}_before", merged)
        assert set(torch.load(merged)["model"]) == set(keys)  # torch's own reader sees every key
    for message in results[0]["hooks"]:
        assert "norm_1.weight" in message
