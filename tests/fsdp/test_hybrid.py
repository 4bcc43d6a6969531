"""Hybrid sharding (issue 27): HYBRID_SHARD and _HYBRID_SHARD_ZERO2 on 2 simulated hosts x 2 ranks and on a
(2, 2) mesh on one host, against one process (float64, SGD, 1e-10 as in test_sharding); the groups stay where
they should (gathers in one host's shared memory, only the gradient shards' all-reduce across hosts, bytes
counted); checkpoints move bit for bit between HYBRID_SHARD, FULL_SHARD and another mesh shape."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import lightning_haiscale.hfreduce.hierarchical as hierarchical
from lightning_haiscale.fsdp import FullyShardedDataParallel, hybrid_groups
from lightning_haiscale.fsdp.dcp import load_dcp, save_dcp
from tests.distributed import run_distributed
from tests.fsdp.models import CASES, sgd_reference, token_batches
from tests.fsdp.test_sharding import LR, STEPS, train, wrap

HOSTS = ["a", "a", "b", "b"]


def _state(model: FullyShardedDataParallel, rank: int) -> dict | None:
    full = model.full_state_dict()
    return {k: v.tolist() for k, v in full.items()} if rank == 0 else None


def _cross_host_bytes(model: FullyShardedDataParallel) -> dict[str, int]:
    """Bytes one forward and backward hand to torch.distributed, the engine's only path between hosts: payload
    (all-reduce, reduce-scatter, all-gather of data) and the engine's agreement on each call (int64 rows)."""
    counts = {"payload": 0, "agreement": 0}
    saved = {name: getattr(hierarchical, name) for name in ("all_gather_tensor", "reduce_scatter_tensor")}
    saved_all_reduce = dist.all_reduce

    def counting(call: Callable[..., object]) -> Callable[..., object]:
        def counted(*args: torch.Tensor, **kwargs: object) -> object:
            tensor = args[1] if len(args) > 1 else args[0]  # the input: what this rank sends
            kind = "agreement" if tensor.dtype == torch.int64 else "payload"
            counts[kind] += tensor.numel() * tensor.element_size()
            return call(*args, **kwargs)

        return counted

    for name, call in saved.items():
        setattr(hierarchical, name, counting(call))
    dist.all_reduce = counting(saved_all_reduce)
    try:
        CASES["example"].loss(model, token_batches(1, 2)[0]).backward()
    finally:
        for name, call in saved.items():
            setattr(hierarchical, name, call)
        dist.all_reduce = saved_all_reduce
    return counts


def _on_two_hosts(rank: int, world: int) -> dict:
    out = {}
    for strategy in ("HYBRID_SHARD", "_HYBRID_SHARD_ZERO2"):
        model = wrap("litgpt_tied", checkpointed=True, sharding_strategy=strategy)
        out[strategy] = {"losses": train("litgpt_tied", model, rank, world), "state": _state(model, rank)}
    shard, replicate = hybrid_groups()  # torch FSDP1's (shard, replicate) pair
    model = wrap("example", process_group=(shard, replicate), sharding_strategy="HYBRID_SHARD")
    out["pair"] = {"losses": train("example", model, rank, world), "state": _state(model, rank)}
    out["groups"] = {
        "shard": (model.comm.world_size, model.comm.backend, model.comm.num_hosts),
        "replicate": (model.replicate_comm.world_size, model.replicate_comm.backend, model.replicate_comm.num_hosts),
        "shard_numel": sum(unit.shard_numel for unit in model.layout.units),
    }
    out["bytes"] = {"hybrid": _cross_host_bytes(model), "full": _cross_host_bytes(wrap("example"))}
    return out


def test_hybrid_on_two_hosts_matches_one_process() -> None:
    results = run_distributed(_on_two_hosts, 4, node_ids=HOSTS, timeout=600)
    got = results[0]
    for strategy, name in (
        ("HYBRID_SHARD", "litgpt_tied"),
        ("_HYBRID_SHARD_ZERO2", "litgpt_tied"),
        ("pair", "example"),
    ):
        _assert_parity(got[strategy], name, 4)
    for r in results:  # gathers within a host's shared memory; the replicas on the other host, hierarchically
        assert r["groups"]["shard"] == (2, "shm", 1) and r["groups"]["replicate"] == (2, "hierarchical", 2)
        # one all-reduce of this rank's gradient shards (float64) crosses hosts, nothing else but the agreement
        assert r["bytes"]["hybrid"]["payload"] == 8 * r["groups"]["shard_numel"]
        # FULL_SHARD over both hosts (hierarchical already) sends each rank's quarter of every unit twice (the
        # forward's and the backward's all-gathers) and half of it once (reduce-scatter): ~2x hybrid's half once
        assert r["bytes"]["full"]["payload"] > 1.8 * r["bytes"]["hybrid"]["payload"]


def _assert_parity(got: dict, name: str, world: int) -> None:
    ref_losses, ref_state = sgd_reference(CASES[name], token_batches(STEPS, 2 * world), LR)
    torch.testing.assert_close(got["losses"], ref_losses, rtol=1e-10, atol=0)
    for key, value in ref_state.items():
        actual = torch.tensor(got["state"][key], dtype=torch.float64)
        assert ((actual - value).abs().max() / value.abs().max()).item() < 1e-10, (name, key)


def _mesh_on_one_host(rank: int, world: int) -> dict:
    tuple_mesh = wrap("example", sharding_strategy="HYBRID_SHARD", device_mesh=(2, 2))
    torch_mesh = wrap("litgpt", sharding_strategy="_HYBRID_SHARD_ZERO2", device_mesh=init_device_mesh("cpu", (2, 2)))
    return {
        "tuple": {"losses": train("example", tuple_mesh, rank, world), "state": _state(tuple_mesh, rank)},
        "torch": {"losses": train("litgpt", torch_mesh, rank, world), "state": _state(torch_mesh, rank)},
        "shard_ranks": dist.get_process_group_ranks(tuple_mesh.comm.group),
        "replicate_ranks": dist.get_process_group_ranks(tuple_mesh.replicate_comm.group),
    }


def test_mesh_on_one_host_matches_one_process() -> None:
    results = run_distributed(_mesh_on_one_host, 4, timeout=600)
    _assert_parity(results[0]["tuple"], "example", 4)
    _assert_parity(results[0]["torch"], "litgpt", 4)
    assert [r["shard_ranks"] for r in results] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [r["replicate_ranks"] for r in results] == [[0, 2], [1, 3], [0, 2], [1, 3]]


def _trained(strategy: str, mesh: object, rank: int, world: int) -> tuple[FullyShardedDataParallel, object]:
    model = wrap("example", sharding_strategy=strategy, device_mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)  # a per-element state to carry over
    for batch in token_batches(2, 2 * world):
        CASES["example"].loss(model, batch[2 * rank : 2 * rank + 2]).backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def _equal(a: dict, b: dict) -> bool:
    if a.keys() != b.keys():
        return False
    return all(_equal(v, b[k]) if isinstance(v, dict) else torch.equal(torch.as_tensor(v), b[k]) for k, v in a.items())


def _resume(rank: int, world: int, folder: str) -> dict:
    path = Path(folder)
    shapes = {"HYBRID_SHARD": None, "FULL_SHARD": None, "NO_SHARD": None, "mesh (4, 1)": (4, 1)}
    out = {}
    for saved in ("HYBRID_SHARD", "FULL_SHARD"):
        model, opt = _trained(saved, None, rank, world)
        full, full_optim = model.full_state_dict(rank0_only=False), model.full_optim_state_dict(opt, rank0_only=False)
        save_dcp(path / saved, model.sharded_state_dict(), [model.sharded_optim_state_dict(opt)], model.process_group)
        torch.save(model.sharded_state_dict(), path / f"{saved}_{rank}.pt")
        dist.barrier()
        if rank == 0:
            CASES["example"].model(seed=3).load_state_dict(full, strict=True)  # full loads into the bare model
        for loader, mesh in shapes.items():
            strategy = "HYBRID_SHARD" if loader.startswith("mesh") else loader
            fresh = wrap("example", sharding_strategy=strategy, device_mesh=mesh)
            fresh_opt = torch.optim.SGD(fresh.parameters(), lr=LR, momentum=0.9)
            fresh.load_full_state_dict(full)
            fresh.load_full_optim_state_dict(fresh_opt, full_optim)
            from_full = _equal(fresh.full_state_dict(rank0_only=False), full)
            from_full = from_full and _equal(
                fresh.full_optim_state_dict(fresh_opt, rank0_only=False)["state"], full_optim["state"]
            )
            dcp_fresh = wrap("example", sharding_strategy=strategy, device_mesh=mesh)
            dcp_opt = torch.optim.SGD(dcp_fresh.parameters(), lr=LR, momentum=0.9)
            dcp_fresh(token_batches(1, 2)[0][:, :-1]).sum().backward()  # the momentum buffers exist to load into
            dcp_opt.step()
            shard, optim_shards = load_dcp(path / saved, dcp_fresh, 1)
            dcp_fresh.load_sharded_state_dict([shard])
            dcp_fresh.load_sharded_optim_state_dict(dcp_opt, optim_shards)
            from_dcp = _equal(dcp_fresh.full_state_dict(rank0_only=False), full)
            from_dcp = from_dcp and _equal(
                dcp_fresh.full_optim_state_dict(dcp_opt, rank0_only=False)["state"], full_optim["state"]
            )
            files = (torch.load(path / f"{saved}_{r}.pt", mmap=True) for r in range(world))  # replicas' included
            dcp_fresh.load_sharded_state_dict(files)
            out[(saved, loader)] = (from_full, from_dcp, _equal(dcp_fresh.full_state_dict(rank0_only=False), full))
    return out


@pytest.mark.slow
def test_checkpoints_move_between_hybrid_full_shard_and_mesh_shapes(tmp_path: Path) -> None:
    results = run_distributed(_resume, 4, str(tmp_path), node_ids=HOSTS, timeout=600)
    for r in results:
        assert all(all(flags) for flags in r.values()), r


BAD = [
    ({"sharding_strategy": "FULL_SHARD", "device_mesh": (1, 2)}, ValueError, "describes hybrid sharding.*HYBRID_SHARD"),
    ({"sharding_strategy": "HYBRID_SHARD", "device_mesh": (3, 2)}, ValueError, r"covers 6 ranks but the group has 2"),
    ({"sharding_strategy": "HYBRID_SHARD", "device_mesh": (2,)}, TypeError, r"\(replicate, shard\) tuple"),
]


def _bad(rank: int, world: int) -> dict:
    for kwargs, error, match in BAD:
        with pytest.raises(error, match=match):
            wrap("example", **kwargs)
    # the timeout passed in (as the strategies pass theirs) reaches the engines of every strategy
    sizes = {}
    for strategy in ("FULL_SHARD", "NO_SHARD", "HYBRID_SHARD"):
        model = wrap("example", sharding_strategy=strategy, device_mesh=(2, 1) if "HYBRID" in strategy else None,
                     timeout=timedelta(seconds=7))  # fmt: skip
        replicate = model.replicate_comm
        sizes[strategy] = (model.comm.world_size, replicate.world_size if replicate else None, model.comm.timeout)
        model.close()
    return sizes


def test_bad_meshes_name_the_fix_and_the_timeout_reaches_every_strategys_engines() -> None:
    seven = timedelta(seconds=7)
    for sizes in run_distributed(_bad, 2):
        assert sizes == {"FULL_SHARD": (2, None, seven), "NO_SHARD": (1, 2, seven), "HYBRID_SHARD": (1, 2, seven)}


def _hybrid_per_stage(rank: int, world: int) -> dict:
    from lightning_haiscale.pipeline import make_subgroups

    dp_group, _ = make_subgroups(2)  # stage 0: ranks 0, 2 (hosts a, b); stage 1: ranks 1, 3
    shard, replicate = hybrid_groups(group=dp_group)  # each stage alone, each enumerating its own hosts
    total = torch.tensor([float(rank)])
    dist.all_reduce(total, group=replicate)
    return {
        "shard": dist.get_process_group_ranks(shard),
        "replicate": dist.get_process_group_ranks(replicate),
        "sum": total.item(),
    }


def test_hybrid_groups_over_each_stages_group_are_that_stages_own() -> None:
    """Each pipeline stage builds hybrid groups over its own data-parallel group at once (the others do not take
    part): every rank gets its stage's groups, and a collective over them sums that stage's ranks only."""
    results = run_distributed(_hybrid_per_stage, 4, node_ids=HOSTS, timeout=120)
    for rank, got in enumerate(results):
        stage = [r for r in range(4) if r % 2 == rank % 2]
        assert got == {"shard": [rank], "replicate": stage, "sum": float(sum(stage))}
