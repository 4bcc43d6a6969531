"""Optimizer state dicts of a :class:`FullyShardedDataParallel`, keyed by parameter name (loading also takes
torch's own position-keyed form, see [Note: index-keyed optimizer states]).

A state tensor shaped like its parameter's piece is sharded (AdamW's ``exp_avg``); any other value
(``step``) is the same on every rank. Full: ``{"state": {fqn: {key: whole tensor or value}},
"param_groups": [{..., "params": [fqn, ...]}]}`` on rank 0. Sharded: the same with pieces, plus
``"layout"`` and ``"format"`` as the model's sharded state dict, loadable on any number of ranks.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from lightning_haiscale.fsdp.param_group import FSDPParamGroup, ParamInfo
from lightning_haiscale.fsdp.state_dict import SHARDED_FORMAT, _check_format, _to_cpu, copy_overlap

if TYPE_CHECKING:
    from lightning_haiscale.fsdp.fully_sharded import FullyShardedDataParallel

__all__ = [
    "full_optim_state_dict",
    "load_full_optim_state_dict",
    "load_sharded_optim_state_dict",
    "sharded_optim_state_dict",
]

_Entry = tuple[str, FSDPParamGroup, ParamInfo, torch.nn.Parameter]


def _entries(model: FullyShardedDataParallel) -> dict[int, _Entry]:
    """id(piece) -> (name, group, info, piece)."""
    return {
        id(piece): (info.fqns[0], group, info, piece)
        for group in model._groups.values()
        for info, piece in zip(group.infos, group.pieces, strict=True)
    }


def _is_sharded(value: Any, piece_numel: int) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() == 1 and value.numel() == piece_numel


def _named_groups(optimizer: torch.optim.Optimizer, entries: dict[int, _Entry]) -> list[dict[str, Any]]:
    groups = []
    for group in optimizer.param_groups:
        unknown = [p for p in group["params"] if id(p) not in entries]
        if unknown:
            raise ValueError(
                "the optimizer holds parameters that are not this model's pieces; build it from model.parameters()"
            )
        names = [entries[id(p)][0] for p in group["params"]]
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": names})
    return groups


def sharded_optim_state_dict(model: FullyShardedDataParallel, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """This rank's optimizer state by parameter name. No collectives."""
    entries = _entries(model)
    state: dict[str, dict[str, Any]] = {}
    layout: dict[str, dict[str, Any]] = {}
    for param, values in optimizer.state.items():
        name, _, info, piece = entries[id(param)]
        state[name] = {k: _to_cpu(v) if isinstance(v, torch.Tensor) else v for k, v in values.items()}
        layout[name] = {"shape": list(info.shape), "start": info.piece_start, "numel": piece.numel()}
    return {
        "format": SHARDED_FORMAT,
        "state": state,
        "layout": layout,
        "param_groups": _named_groups(optimizer, entries),
    }


def full_optim_state_dict(
    model: FullyShardedDataParallel, optimizer: torch.optim.Optimizer, rank0_only: bool = True
) -> dict[str, Any]:
    """Whole optimizer state by parameter name, on the CPU of rank 0 (``{}`` elsewhere). Collective: a call
    on a subset of ranks raises ``CollectiveMisuseError``."""
    model.expect_every_rank("full_optim_state_dict()")
    entries = _entries(model)
    local = {id(p): v for p, v in optimizer.state.items()}
    keys = _sharded_keys(model, local)
    keep = not rank0_only or model.comm.rank == 0
    state: dict[str, dict[str, Any]] = {}
    for index, group in enumerate(model._groups.values()):
        for key, dtype in keys[index]:
            flat = torch.zeros(group.shard_numel, dtype=dtype, device=group.device)
            for info, piece in zip(group.infos, group.pieces, strict=True):
                value = local.get(id(piece), {}).get(key)
                if _is_sharded(value, piece.numel()):
                    group.piece(info, flat).copy_(value)
            full = group.gather_full(flat)
            if keep:
                for info, view in zip(group.infos, group.full_views(full), strict=True):
                    state.setdefault(info.fqns[0], {})[key] = _to_cpu(view)
    if not keep:
        return {}
    for pid, values in local.items():
        name, _, _, piece = entries[pid]
        for key, value in values.items():
            if not _is_sharded(value, piece.numel()):
                state.setdefault(name, {})[key] = _to_cpu(value) if isinstance(value, torch.Tensor) else value
    return {"state": state, "param_groups": _named_groups(optimizer, entries)}


def _sharded_keys(model: FullyShardedDataParallel, local: Mapping[int, Mapping[str, Any]]) -> list[list[tuple]]:
    """Per unit, the (key, dtype) of sharded state tensors on any rank: every rank gathers the same ones."""
    mine: list[set[tuple]] = []
    for group in model._groups.values():
        keys = set()
        for piece in group.pieces:
            for key, value in local.get(id(piece), {}).items():
                if _is_sharded(value, piece.numel()):
                    keys.add((key, value.dtype))
        mine.append(keys)
    everyone: list[Any] = [None] * model.comm.world_size
    dist.all_gather_object(everyone, mine, group=model.comm.group)
    return [sorted(set().union(*(rank[i] for rank in everyone)), key=str) for i in range(len(mine))]


def _load(optimizer: torch.optim.Optimizer, model: FullyShardedDataParallel, state: dict, groups: list) -> None:
    """Loads name-keyed pieces into ``optimizer`` through its own ``load_state_dict``."""
    entries = _entries(model)
    index = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            index[entries[id(p)][0]] = len(index)
    if [len(g["params"]) for g in groups] != [len(g["params"]) for g in optimizer.param_groups]:
        raise ValueError("the saved optimizer has a different set of parameter groups than this optimizer")
    torch_state = {
        "state": {index[name]: values for name, values in state.items() if name in index},
        "param_groups": [{**g, "params": [index[name] for name in g["params"]]} for g in groups],
    }
    optimizer.load_state_dict(torch_state)


def _by_name(
    optimizer: torch.optim.Optimizer, entries: dict[int, _Entry], full: Mapping[str, Any]
) -> Mapping[str, Any]:
    """A full optimizer state keyed as torch keys it (by position: ``optimizer.state_dict()`` under ddp or one
    device) turned into one keyed by parameter name.

    [Note: index-keyed optimizer states]
    torch numbers the parameters of ``param_groups`` in order, group after group; the same
    ``configure_optimizers`` over the same module lists them in the same order under hai_fsdp (the pieces
    take their parameters' places), so position ``i`` here names the saved ``i``. Group sizes must agree.
    """
    if not any(isinstance(p, int) for g in full["param_groups"] for p in g["params"]):
        return full
    saved = [len(g["params"]) for g in full["param_groups"]]
    mine = [len(g["params"]) for g in optimizer.param_groups]
    if saved != mine:
        raise ValueError(
            f"the checkpoint's optimizer has parameter groups of sizes {saved}, this one {mine}: build it with the "
            "same configure_optimizers as the run that saved it"
        )
    names: dict[int, str] = {}
    for saved_group, group in zip(full["param_groups"], optimizer.param_groups, strict=True):
        names.update(zip(saved_group["params"], (entries[id(p)][0] for p in group["params"]), strict=True))
    return {
        "state": {names[index]: values for index, values in full["state"].items()},
        "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in full["param_groups"]],
    }


def load_full_optim_state_dict(
    model: FullyShardedDataParallel, optimizer: torch.optim.Optimizer, full: Mapping[str, Any]
) -> None:
    """Loads each rank's pieces from a full optimizer state dict given on every rank: keyed by parameter name
    (hai_fsdp's) or by position (``optimizer.state_dict()`` of ddp or one device). No collectives."""
    full = _by_name(optimizer, _entries(model), full)
    state = {}
    for name, _, info, _ in _entries(model).values():
        values = full["state"].get(name)
        if values is None:
            continue
        state[name] = {
            k: v.reshape(-1)[info.piece_start : info.piece_end].clone()
            if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape == info.shape
            else v
            for k, v in values.items()
        }
    _load(optimizer, model, state, full["param_groups"])


def load_sharded_optim_state_dict(
    model: FullyShardedDataParallel, optimizer: torch.optim.Optimizer, shards: Iterable[Mapping[str, Any]]
) -> None:
    """Loads this rank's pieces from saved sharded optimizer states of any world size. No collectives."""
    mine = {name: (info, piece) for name, _, info, piece in _entries(model).values()}
    state: dict[str, dict[str, Any]] = {}
    groups = None
    for shard in shards:
        _check_format(shard)
        groups = groups if groups is not None else shard["param_groups"]
        for name, values in shard["state"].items():
            if name not in mine:
                continue
            info, piece = mine[name]
            saved = shard["layout"][name]
            target = state.setdefault(name, {})
            for key, value in values.items():
                if _is_sharded(value, saved["numel"]):
                    dst = target.setdefault(key, torch.zeros(piece.numel(), dtype=value.dtype))
                    copy_overlap(dst, info.piece_start, value, saved["start"])
                elif key not in target:
                    target[key] = value
    if groups is None:
        raise ValueError("load_sharded_optim_state_dict: no shards given")
    _load(optimizer, model, state, groups)
