"""haiscale's FSDP save snippet, and collective calls made on a subset of ranks.

Inside ``summon_full_params`` the module holds its whole parameters, so ``state_dict()`` is local: the
seed's ``with model.summon_full_params(): if rank == 0: torch.save(model.state_dict(), path)`` must write a
checkpoint that loads into the bare model. Outside, ``state_dict()`` is collective: a call on one rank must
raise at once naming the mistake, not wait for the engine's 5-minute deadline.
"""

from __future__ import annotations

import os
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from examples.gpt.model import GPT, Block
from lightning_haiscale.fsdp import (
    CollectiveMisuseError,
    FullyShardedDataParallel,
    full_optim_state_dict,
    full_state_dict,
)
from tests.distributed import run_distributed
from tests.fsdp.helpers import CFG, batches, local, loss_of, make_model, max_rel_error

MISUSE = r"state_dict\(\) is collective outside summon_full_params: call it on every rank"


def _snippet(rank: int, world: int, tmp: str) -> dict:
    model = FullyShardedDataParallel(make_model(), auto_wrap_policy={Block})
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)  # built after wrapping, as haiscale says
    loss_of(model, local(batches(1, 4)[0], rank, world)).backward()
    optimizer.step()
    path = Path(tmp) / "model.pt"
    with model.summon_full_params():  # the seed's snippet, verbatim but for the path
        if rank == 0:
            state = model.state_dict()
            torch.save(state, path)
    with model.summon_full_params(writeback=False, rank0_only=True):
        rank0_only = model.state_dict()
    dist.barrier()
    collective = full_state_dict(model, rank0_only=False)
    bare = GPT(CFG)
    bare.load_state_dict(torch.load(path, weights_only=True))  # plain torch, bare keys, strict
    return {
        "loaded_error": max_rel_error(bare.state_dict(), collective),
        "rank0_only_keys": len(rank0_only),
        "rank0_only_error": max_rel_error(rank0_only, collective) if rank0_only else None,
        "keys": list(collective) == list(GPT(CFG).state_dict()),
    }


def test_seed_save_snippet_writes_a_checkpoint_the_bare_model_loads(tmp_path: Path) -> None:
    results = run_distributed(_snippet, 2, str(tmp_path), timeout=120)
    for r in results:
        assert r["loaded_error"] == 0 and r["keys"]
    assert results[0]["rank0_only_error"] == 0
    assert results[1]["rank0_only_keys"] == 0  # rank0_only: the other ranks hold pieces, get {}


def _subset(rank: int, world: int, how: str) -> list[float] | None:
    model = FullyShardedDataParallel(make_model(), arrival_timeout=timedelta(seconds=2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    dist.barrier()
    if rank != 0:
        if how == "exits":
            os._exit(0)
        time.sleep(9)  # alive, busy elsewhere
        return None
    calls = [
        (model.state_dict, MISUSE),
        (lambda: full_state_dict(model), r"full_state_dict\(\) is collective: call it on every rank"),
        (lambda: full_optim_state_dict(model, optimizer), r"full_optim_state_dict\(\) is collective"),
    ]
    elapsed = []
    for call, message in calls:
        start = time.monotonic()
        with pytest.raises(CollectiveMisuseError, match=message):
            call()
        elapsed.append(time.monotonic() - start)
    return elapsed


@pytest.mark.parametrize(("how", "within"), [("exits", 1.5), ("waits", 4.0)])
def test_collectives_on_one_rank_raise_naming_the_fix(how: str, within: float) -> None:
    """A peer that exited is seen at once; a live one busy elsewhere after ``arrival_timeout`` (2 s)."""
    elapsed = run_distributed(_subset, 2, how, may_die={1}, timeout=60)[0]
    assert max(elapsed) < within


def _two_models(rank: int, world: int) -> dict:
    gloo_groups = []
    new_group = dist.new_group

    def counting(*args: object, **kwargs: object) -> object:
        if kwargs.get("backend") == "gloo":
            gloo_groups.append(args)
        return new_group(*args, **kwargs)

    dist.new_group = counting  # this spawned process only
    try:
        first = FullyShardedDataParallel(make_model(), arrival_timeout=timedelta(seconds=5))
        second = FullyShardedDataParallel(make_model(), arrival_timeout=timedelta(seconds=5))
    finally:
        dist.new_group = new_group
    same = first.state_dict()  # every rank, the same model: passes
    mine = first if rank == 0 else second  # every rank, different models
    with pytest.raises(CollectiveMisuseError, match=r"state_dict\(\) is collective.*different models"):
        mine.state_dict()
    return {"gloo_groups": len(gloo_groups), "same": len(same)}


def test_wrappers_share_one_arrival_group_and_still_tell_models_apart() -> None:
    """One gloo group per process group, not per wrapper; a call on different models on different ranks
    still raises before any engine collective (see arrival [Note: one gloo group per process group])."""
    results = run_distributed(_two_models, 2, timeout=90)
    assert [r["gloo_groups"] for r in results] == [1, 1]
    assert results[0]["same"] > 0
