"""Sharded stages under the pipeline strategies (``data_parallel="fsdp"``): PP x FSDP in the Trainer.

Each model chunk of a rank becomes a :class:`~lightning_haiscale.fsdp.FullyShardedDataParallel` over its
stage's data-parallel ranks, instead of a :class:`~lightning_haiscale.ddp.DistributedDataParallel`: parameters,
gradients and optimizer state are sharded across the pipelines, where data parallel replicates them. The rank
layout is :class:`~lightning_haiscale.rank_layout.RankLayout`'s; ``HYBRID_SHARD`` shards a stage within a host
and replicates it across hosts (or per ``device_mesh=(replicate, shard)`` over the data-parallel ranks).

[Note: full forms of sharded stages]
The pipeline checkpoint format (``pipeline_checkpoint`` [Note: stage files]) holds every parameter and optimizer
state whole, so that any layout, ``hai_fsdp`` or one device resumes it. With sharded stages the whole forms are
made at save time and cut again at load time, here: the weights inside every chunk's ``summon_full_params``
(collective over its data-parallel ranks), an optimizer's states by gathering each chunk's pieces with the
wrapper's ``full_optim_state_dict`` into the optimizer's own index-keyed layout (``optimizer.state_dict()``'s,
with whole tensors), and loading by slicing each whole state back to the piece this rank holds.

[Note: tied parameters of sharded stages]
A parameter two stages hold (GPT-2's token embedding and its head) is kept equal by summing its copies'
gradients over the holders (``pipeline.ties``), which is right for pieces only if every copy is cut alike. So
the module holding a copy becomes a unit of its own in every stage (``fsdp.wrap.with_units``): the copy is the
unit's one parameter, its flat shape is the same in each stage and each data-parallel rank holds the same
slice of it in every stage. A holder that holds other parameters too is refused on every rank, naming it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_haiscale.adapter.arguments import check_choice
from lightning_haiscale.adapter.fsdp_options import HaiFSDPOptions, hai_fsdp_options, wrap_hai_fsdp
from lightning_haiscale.fsdp import FullyShardedDataParallel
from lightning_haiscale.fsdp.layout import ParamSlice
from lightning_haiscale.fsdp.wrap import with_units
from lightning_haiscale.hfreduce import kept_collectives
from lightning_haiscale.hfreduce.topology import Topology
from lightning_haiscale.pipeline.ties import Tie
from lightning_haiscale.rank_layout import RankGroups, RankLayout

__all__ = ["DATA_PARALLEL", "ShardedStages", "check_data_parallel", "sharded_layout"]

DATA_PARALLEL = ("ddp", "fsdp")
"""How the pipelines train data parallel: each stage replicated (``"ddp"``) or sharded (``"fsdp"``)."""


def check_data_parallel(name: str, data_parallel: Any, sharding: Mapping[str, Any]) -> HaiFSDPOptions | None:
    """The checked sharding options for ``data_parallel="fsdp"``; ``None`` for ``"ddp"``, where any sharding
    option raises, naming it. ``name``: the strategy's class."""
    check_choice("data_parallel", data_parallel, DATA_PARALLEL)
    given = {k: v for k, v in sharding.items() if v is not None}
    if data_parallel == "ddp":
        if given:
            raise ValueError(
                f"{name}({', '.join(f'{k}=...' for k in given)}) configures sharded stages, but data_parallel='ddp' "
                "replicates them; pass data_parallel='fsdp' as well"
            )
        return None
    options = hai_fsdp_options(**given)
    mesh = options.wrapper.get("device_mesh")
    if isinstance(mesh, DeviceMesh):
        raise TypeError(
            f"{name}(device_mesh=<DeviceMesh>): under a pipeline, device_mesh is the data-parallel dimension's "
            "(replicate, shard) shape, e.g. device_mesh=(2, 4); the strategy builds the groups itself"
        )
    return options


def sharded_layout(options: HaiFSDPOptions, world_size: int, pp_size: int) -> RankLayout:
    """The rank layout of sharded pipelines: with hybrid sharding, ``replicate_size`` from ``device_mesh`` or, by
    default, one replica per host, each host holding whole pipelines (checked: collective over the world)."""
    if not options.sharding_strategy.hybrid:
        return RankLayout(world_size, pp_size=pp_size)
    mesh = options.wrapper.get("device_mesh")
    dp_size = RankLayout(world_size, pp_size=pp_size).dp_size
    if mesh is not None:
        replicate, shard = mesh
        if replicate * shard != dp_size:
            raise ValueError(
                f"device_mesh=({replicate}, {shard}) covers {replicate * shard} data-parallel ranks but "
                f"{world_size} ranks / pp_size {pp_size} train {dp_size} pipelines; pass (replicate, shard) with "
                f"replicate * shard == {dp_size}"
            )
        return RankLayout(world_size, pp_size=pp_size, replicate_size=replicate)
    hosts = Topology.discover(dist.group.WORLD, 0).hosts
    layout = RankLayout(world_size, pp_size=pp_size, replicate_size=len(hosts)) if dp_size % len(hosts) == 0 else None
    block = world_size // len(hosts)
    if layout is None or sorted(sorted(h) for h in hosts) != [
        list(range(i * block, (i + 1) * block)) for i in range(len(hosts))
    ]:
        raise ValueError(
            f"HYBRID_SHARD under a pipeline shards each stage within a host, so each host must hold whole "
            f"pipelines of consecutive ranks, but the hosts hold ranks {[sorted(h) for h in hosts]} with "
            f"pp_size={pp_size}; launch pp_size x n ranks per host, or pass device_mesh=(replicate, shard) for the "
            "data-parallel dimension"
        )
    return layout


def _stage_mesh(layout: RankLayout, groups: RankGroups, rank: int, device_type: str) -> DeviceMesh:
    """This rank's stage's ``(replicate, shard)`` mesh, over the groups ``groups`` already holds."""
    stage, shard, pp = layout.stage(rank), layout.shard_size, layout.pp_size
    ranks = [[(r * shard + k) * pp + stage for k in range(shard)] for r in range(layout.replicate_size)]
    return DeviceMesh.from_group(
        [groups.replicate, groups.shard], device_type, mesh=torch.tensor(ranks), mesh_dim_names=("replicate", "shard")
    )


@dataclass
class ShardedStages:
    """A rank's model chunks, each sharded over its data-parallel ranks, with their checkpoints' full forms
    (see [Note: full forms of sharded stages])."""

    wrappers: list[FullyShardedDataParallel]
    shard_group: dist.ProcessGroup  # the ranks a chunk's state is sharded over

    @classmethod
    def wrap(
        cls,
        stages: Sequence[nn.Module],
        ties: Sequence[Tie],
        options: HaiFSDPOptions,
        layout: RankLayout,
        groups: RankGroups,
        device: torch.device,
        timeout: timedelta,
        precision: str,
    ) -> ShardedStages:
        """Shards every chunk of ``stages`` (collective over the data-parallel ranks, one chunk after another);
        each module holding a parameter of ``ties`` becomes a unit of its own (see [Note: tied parameters of
        sharded stages]). A step's microbatches gather each unit once (the pipelines' ``microbatch_step``)."""
        placement: dict[str, Any] = {"process_group": groups.data_parallel, "reshard_after_forward": None}
        if groups.replicate is not None:
            mesh = _stage_mesh(layout, groups, dist.get_rank(), device.type)
            placement["device_mesh"] = mesh
        wrappers = []
        for stage, owners in zip(stages, _tie_owners(stages, ties), strict=True):
            policy = with_units(options.wrapper.get("auto_wrap_policy"), owners) if owners else None
            wrapper_options = HaiFSDPOptions(
                wrapper={**options.wrapper, **placement, **({"auto_wrap_policy": policy} if policy else {})},
                sharding_strategy=options.sharding_strategy,
                mixed_precision=options.mixed_precision,
                torch_mixed_precision_given=options.torch_mixed_precision_given,
                activation_checkpointing=options.activation_checkpointing,
                cpu_offload=options.cpu_offload,
            )
            wrappers.append(wrap_hai_fsdp(stage, device, timeout, precision, wrapper_options))
        return cls(wrappers, groups.shard if groups.shard is not None else groups.data_parallel)

    @contextlib.contextmanager
    def full_parameters(self, writeback: bool = False) -> Iterator[None]:
        """Inside, every chunk holds its whole parameters (collective over the data-parallel ranks)."""
        with contextlib.ExitStack() as stack:
            for wrapper in self.wrappers:
                stack.enter_context(wrapper.summon_full_params(writeback=writeback))
            yield

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """``optimizer.state_dict()`` with every piece's state whole (collective over the data-parallel ranks)."""
        state = optimizer.state_dict()
        params = [p for group in optimizer.param_groups for p in group["params"]]
        whole: dict[int, dict[str, Any]] = {}
        for wrapper in self.wrappers:
            view = _view(optimizer, wrapper)
            if view is None:
                continue
            full = wrapper.full_optim_state_dict(view, rank0_only=False)["state"]
            names = {pid: where.name for pid, where in _slices(wrapper).items()}
            pieces = [p for group in view.param_groups for p in group["params"]]
            whole.update({id(p): full[names[id(p)]] for p in pieces if names[id(p)] in full})
        own = state["state"]
        state["state"] = {
            i: whole[id(p)] if id(p) in whole else own[i] for i, p in enumerate(params) if id(p) in whole or i in own
        }
        return state

    def load_optimizer_state(self, optimizer: torch.optim.Optimizer, state: Mapping[str, Any]) -> None:
        """Loads an index-keyed state of whole tensors (:meth:`optimizer_state`'s, or one device's) into this rank's
        pieces. No collectives."""
        params = [p for group in optimizer.param_groups for p in group["params"]]
        slices = {pid: s for wrapper in self.wrappers for pid, s in _slices(wrapper).items()}
        cut = {}
        for index, values in state["state"].items():
            where = slices.get(id(params[index])) if index < len(params) else None
            cut[index] = values if where is None else {k: _piece(v, where) for k, v in values.items()}
        optimizer.load_state_dict({**state, "state": cut})

    def close(self) -> None:
        for wrapper in self.wrappers:
            wrapper.close()


def _slices(wrapper: FullyShardedDataParallel) -> dict[int, ParamSlice]:
    """id(piece) -> which elements of its parameter the piece holds."""
    by_key = {key: param for _, param in wrapper.layout.params() for key in param.names}
    return {id(v): by_key[k] for k, v in wrapper.module.state_dict(keep_vars=True).items() if k in by_key}


def _tie_owners(stages: Sequence[nn.Module], ties: Sequence[Tie]) -> list[list[nn.Module]]:
    """Per chunk, the modules holding its copies of tied parameters; raises on every rank (collective over the
    world) unless each holds nothing else, so that every copy is alone in its unit."""
    owners: list[list[nn.Module]] = []
    refused: list[str] = []
    for stage in stages:
        copies = stage.local_ties() if ties else {}  # partition's stages: this chunk's copy of each tie it holds
        holders = {tie: [m for m in stage.modules() if any(p is param for p in m.parameters(recurse=False))]
                   for tie, param in copies.items()}  # fmt: skip
        refused += [tie.describe() for tie, found in holders.items() if len(list(found[0].parameters())) != 1]
        owners.append([found[0] for found in holders.values()])
    every = kept_collectives.all_gather_object(refused)
    refused = [r for rank in every for r in rank]
    if refused:
        raise ValueError(
            f"data_parallel='fsdp' shards a parameter tied across stages only when the module holding it holds "
            f"nothing else (as GPT-2's wte and its head without bias), so that every stage shards it alike; "
            f"{refused[0]} shares its module with other parameters. Untie it, or use data_parallel='ddp'"
        )
    return owners


def _piece(value: Any, where: ParamSlice) -> Any:
    """A whole per-element state cut to the piece; anything else (a step count) as it is."""
    if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == where.shape:
        return value.reshape(-1)[where.start : where.end].clone()
    return value


def _view(optimizer: torch.optim.Optimizer, wrapper: FullyShardedDataParallel) -> torch.optim.Optimizer | None:
    """An optimizer over only ``wrapper``'s pieces (the same hyperparameters and state objects), as the
    wrapper's optimizer-state methods take one; ``None`` when ``optimizer`` holds none of them."""
    mine = {id(p) for p in wrapper.parameters()}
    groups = [
        {**{k: v for k, v in g.items() if k != "params"}, "params": [p for p in g["params"] if id(p) in mine]}
        for g in optimizer.param_groups
    ]
    groups = [g for g in groups if g["params"]]
    if not groups:
        return None
    view = torch.optim.Optimizer(groups, {})
    for group in groups:
        for p in group["params"]:
            if p in optimizer.state:
                view.state[p] = optimizer.state[p]
    return view
