"""torch FSDP's keywords (options [Note: torch's keywords, honoured]): ``ignored_modules`` left alone,
``sync_module_states`` starting every rank from rank 0's values, the flags checked, ``cpu_offload`` accepted
on CPU and refused on CUDA before anything runs."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import CPUOffload

from lightning_haiscale.fsdp import FullyShardedDataParallel
from lightning_haiscale.fsdp.options import check_cpu_offload
from tests.distributed import run_distributed
from tests.fsdp.models import CASES
from tests.fsdp.test_sharding import train


def test_cpu_offload_is_accepted_on_cpu_once_and_refused_on_cuda(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="lightning_haiscale.fsdp.options"):
        for offload in (CPUOffload(offload_params=True), True, CPUOffload(offload_params=True)):
            check_cpu_offload(offload, torch.device("cpu"))
    assert [r.getMessage() for r in caplog.records] == [
        "cpu_offload has no effect on CPU tensors: the shards already live in host memory"
    ]
    check_cpu_offload(CPUOffload(offload_params=False), torch.device("cuda", 0))
    with pytest.raises(NotImplementedError, match=r"cpu_offload=CPUOffload\(offload_params=True\) on cuda:0"):
        check_cpu_offload(CPUOffload(offload_params=True), torch.device("cuda", 0))
    with pytest.raises(TypeError, match="cpu_offload='yes' must be None, a bool or torch's CPUOffload"):
        check_cpu_offload("yes", torch.device("cpu"))


def test_flags_are_checked_before_any_collective() -> None:
    # no process group exists here: the check comes first
    with pytest.raises(TypeError, match="limit_all_gathers='yes' must be True or False"):
        FullyShardedDataParallel(torch.nn.Linear(2, 2), limit_all_gathers="yes")
    with pytest.raises(ValueError, match="sharding_strategy='FULL'"):
        FullyShardedDataParallel(torch.nn.Linear(2, 2), sharding_strategy="FULL")


def _options(rank: int, world: int) -> dict:
    case = CASES["litgpt"]
    # sync_module_states: ranks initialized differently start from rank 0's values
    rank0 = case.model(seed=0).state_dict()
    synced = FullyShardedDataParallel(case.model(seed=rank), auto_wrap_policy={case.block()}, sync_module_states=True)
    unsynced = FullyShardedDataParallel(case.model(seed=rank), auto_wrap_policy={case.block()})
    # ignored_modules: the head stays a whole parameter, trained on each rank's own batch, saved from rank 0
    plain = case.model()
    model = FullyShardedDataParallel(plain, auto_wrap_policy={case.block()}, ignored_modules=[plain.lm_head])
    head = plain.lm_head.weight
    before = head.detach().clone()
    train("litgpt", model, rank, world, steps=1)
    others = [torch.empty_like(head) for _ in range(world)]
    dist.all_gather(others, head.detach())
    shared = [model.full_state_dict()]  # rank 0's file, read by every rank
    dist.broadcast_object_list(shared)
    full = shared[0]
    fresh_plain = case.model(seed=5)
    fresh = FullyShardedDataParallel(
        fresh_plain, auto_wrap_policy={case.block()}, ignored_modules=[fresh_plain.lm_head]
    )
    fresh.load_full_state_dict(full)
    return {
        "synced": all(torch.equal(v, rank0[k]) for k, v in synced.full_state_dict(rank0_only=False).items()),
        "unsynced": all(torch.equal(v, rank0[k]) for k, v in unsynced.full_state_dict(rank0_only=False).items()),
        "head_whole": head.shape == (case.model().lm_head.weight.shape) and any(p is head for p in model.parameters()),
        "head_trained_locally": not torch.equal(head, before) and not torch.equal(others[0], others[1]),
        "keys": list(full) == list(case.model().state_dict()),
        "saved_head_is_rank0s": torch.equal(full["lm_head.weight"], others[0]),
        "loaded": torch.equal(fresh_plain.lm_head.weight, others[0]),
    }


def test_sync_module_states_and_ignored_modules() -> None:
    results = run_distributed(_options, 2)
    assert not any(r["unsynced"] for r in results)  # the check can fail: without, rank 1's shards are its own
    for r in results:
        assert r == dict.fromkeys(r, True) | {"unsynced": False}
