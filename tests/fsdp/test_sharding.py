"""``sharding_strategy``: the names torch FSDP takes, and FULL_SHARD, SHARD_GRAD_OP and NO_SHARD against one
process (float64, SGD), with activation checkpointing applied by hand, on 2 and 4 ranks.

Tolerance 1e-10 relative: float64 rounding of the same sums in another order (the averaging over ranks) is
~1e-16 per operation; a wrong gradient scale or a missed reduction is off by far more than that."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import ShardingStrategy as TorchShardingStrategy

from lightning_haiscale.fsdp import FullyShardedDataParallel, ShardingStrategy, ShardState
from lightning_haiscale.fsdp.sharding import resolve_strategy
from tests.distributed import run_distributed
from tests.fsdp.models import CASES, sgd_reference, token_batches
from tests.fsdp.test_checkpoint_wrapped import checkpoint_blocks

STEPS, LR = 3, 0.5
CHECKPOINTED = {"example": False, "litgpt_tied": True}  # model -> activation checkpointing applied by hand


def test_strategy_names_are_torchs() -> None:
    for member in TorchShardingStrategy:
        ours = resolve_strategy(member)
        assert ours.name == member.name and resolve_strategy(member.name.lower()) is ours
        assert ShardingStrategy[member.name].__doc__  # every member says what it does
    assert resolve_strategy("FULL_SHARD", reshard_after_forward=False) is ShardingStrategy.SHARD_GRAD_OP
    assert resolve_strategy("HYBRID_SHARD", reshard_after_forward=False) is ShardingStrategy._HYBRID_SHARD_ZERO2
    with pytest.raises(ValueError, match=r"sharding_strategy='ZERO3'.*'FULL_SHARD', 'SHARD_GRAD_OP', 'NO_SHARD'"):
        resolve_strategy("ZERO3")
    with pytest.raises(TypeError, match="reshard_after_forward=None must be True or False"):
        resolve_strategy("FULL_SHARD", None)


def train(case_name: str, model: torch.nn.Module, rank: int, world: int, steps: int = STEPS) -> list[float]:
    """SGD on this rank's part of the global batches; the losses averaged over every rank."""
    case = CASES[case_name]
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for batch in token_batches(steps, 2 * world):
        loss = case.loss(model, batch[2 * rank : 2 * rank + 2])
        loss.backward()
        opt.step()
        opt.zero_grad()
        value = loss.detach().reshape(1)
        dist.all_reduce(value)
        losses.append(value.item() / world)
    return losses


def wrap(case_name: str, checkpointed: bool = False, **kwargs: object) -> FullyShardedDataParallel:
    case = CASES[case_name]
    model = case.model()
    if checkpointed:
        checkpoint_blocks(model, case.block())
    return FullyShardedDataParallel(model, auto_wrap_policy={case.block()}, **kwargs)


def _unsharded_after_forward(model: FullyShardedDataParallel, case_name: str) -> int:
    """How many units hold their gathered parameters between forward and backward."""
    CASES[case_name].loss(model, token_batches(1, 2)[0]).backward()  # records the orders
    loss = CASES[case_name].loss(model, token_batches(1, 2)[0])
    held = sum(g.state is ShardState.UNSHARDED for g in model._groups.values())
    loss.backward()
    return held


def _strategies(rank: int, world: int, strategies: list[str]) -> dict:
    out = {}
    for strategy in strategies:
        for name, checkpointed in CHECKPOINTED.items():
            model = wrap(name, checkpointed, sharding_strategy=strategy)
            losses = train(name, model, rank, world)
            full = model.full_state_dict()
            out[(strategy, name)] = {
                "losses": losses,
                "state": {k: v.tolist() for k, v in full.items()} if rank == 0 else None,
                "whole_pieces": all(i.end - i.start == i.numel for _, i in model.layout.params()),
                "held": _unsharded_after_forward(model, name),
                "units": len(model.layout.units),
            }
    return out


def _check(results: list[dict], strategies: list[str], world: int) -> None:
    for name in CHECKPOINTED:
        ref_losses, ref_state = sgd_reference(CASES[name], token_batches(STEPS, 2 * world), LR)
        for strategy in strategies:
            got = results[0][(strategy, name)]
            torch.testing.assert_close(got["losses"], ref_losses, rtol=1e-10, atol=0)
            for key, value in ref_state.items():
                actual = torch.tensor(got["state"][key], dtype=torch.float64)
                assert ((actual - value).abs().max() / value.abs().max()).item() < 1e-10, (strategy, name, key)
            # FULL_SHARD frees every unit but the root after its forward; the others keep them all
            assert got["held"] == (1 if strategy == "FULL_SHARD" else got["units"]), (strategy, name)
            assert all(r[(strategy, name)]["whole_pieces"] == (strategy == "NO_SHARD") for r in results)


@pytest.mark.parametrize("world", [2, 4])
def test_full_shard_grad_op_and_no_shard_match_one_process(world: int) -> None:
    strategies = ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"]
    _check(run_distributed(_strategies, world, strategies, timeout=600), strategies, world)


def _no_shard_alone(rank: int, world: int) -> str:
    model = FullyShardedDataParallel(torch.nn.Linear(4, 4), sharding_strategy="NO_SHARD")
    model(torch.ones(2, 4)).sum().backward()  # and it trains on its own engine
    assert model.replicate_comm is None  # nothing to replicate over on one rank: no second engine
    model.close()
    try:
        model.comm.barrier()
    except RuntimeError as error:
        return str(error)
    return "still open"


def test_no_shard_on_one_rank_builds_one_engine_and_closes_it() -> None:
    """Was: NO_SHARD on one rank (nothing to replicate over) neither used nor closed a given engine, whose thread
    and shared memory then lived on with the model's. The wrapper now builds its engines itself (the strategies
    pass a ``timeout``): on one rank only the one it uses, which ``close()`` stops."""
    assert run_distributed(_no_shard_alone, 1) != ["still open"]
