"""Optimizer state dicts of a :class:`FullyShardedDataParallel`, keyed by parameter name (loading also takes
torch's own position-keyed form, see [Note: index-keyed optimizer states]).

A state tensor shaped like its parameter's piece is sharded (AdamW's ``exp_avg``); any other value
(``step``) is the same on every rank. Full: ``{"state": {fqn: {key: whole tensor or value}},
"param_groups": [{..., "params": [fqn, ...]}]}`` on rank 0. Sharded: the same with pieces, plus
``"layout"`` and ``"format"`` as the model's sharded state dict, loadable on any number of ranks.

The entry points are :class:`FullyShardedDataParallel`'s methods (``full_optim_state_dict()``,
``sharded_optim_state_dict()``, ``load_full_optim_state_dict()``, ``load_sharded_optim_state_dict()``); the
functions here work on its public :class:`~lightning_haiscale.fsdp.layout.ShardLayout` and its pieces
(``pieces[u][i]`` is the parameter the optimizer holds for ``layout.units[u].params[i]``). The free functions
named like the methods call them (kept for lightning-haiscale 0.1's callers).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from lightning_haiscale.fsdp.collectives import gather_unit
from lightning_haiscale.fsdp.layout import (
    SHARDED_FORMAT,
    ParamSlice,
    ShardLayout,
    UnitLayout,
    check_format,
    copy_overlap,
    to_cpu,
)
from lightning_haiscale.hfreduce import Communicator, kept_collectives

__all__ = [
    "full_optim_state_dict",
    "gather_full_optim_state",
    "index_keyed",
    "load_full_optim_state",
    "load_full_optim_state_dict",
    "load_local_optim_states",
    "load_sharded_optim_state_dict",
    "local_optim_state",
    "sharded_optim_state_dict",
]

Pieces = Sequence[Sequence[torch.Tensor]]
"""Per unit of a layout, per parameter, the piece the optimizer holds."""

_Entry = tuple[UnitLayout, ParamSlice, torch.Tensor]


def _entries(layout: ShardLayout, pieces: Pieces) -> dict[int, _Entry]:
    """id(piece) -> (unit, param, piece)."""
    return {
        id(piece): (unit, param, piece)
        for unit, unit_pieces in zip(layout.units, pieces, strict=True)
        for param, piece in zip(unit.params, unit_pieces, strict=True)
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
        names = [entries[id(p)][1].name for p in group["params"]]
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": names})
    return groups


def local_optim_state(layout: ShardLayout, pieces: Pieces, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """This rank's optimizer state by parameter name. No collectives."""
    entries = _entries(layout, pieces)
    state: dict[str, dict[str, Any]] = {}
    where: dict[str, dict[str, Any]] = {}
    for piece, values in optimizer.state.items():
        _, param, _ = entries[id(piece)]
        state[param.name] = {k: to_cpu(v) if isinstance(v, torch.Tensor) else v for k, v in values.items()}
        where[param.name] = {"shape": list(param.shape), "start": param.start, "numel": piece.numel()}
    return {
        "format": SHARDED_FORMAT,
        "state": state,
        "layout": where,
        "param_groups": _named_groups(optimizer, entries),
    }


def gather_full_optim_state(
    layout: ShardLayout, pieces: Pieces, optimizer: torch.optim.Optimizer, comm: Communicator, keep: bool
) -> dict[str, Any]:
    """Whole optimizer state by parameter name, on the CPU where ``keep`` (``{}`` elsewhere). Collective over
    ``comm``, without an arrival check (the wrapper's method makes it)."""
    entries = _entries(layout, pieces)
    local = {id(p): v for p, v in optimizer.state.items()}
    keys = _sharded_keys(layout, pieces, local, comm)
    state: dict[str, dict[str, Any]] = {}
    for unit, unit_pieces, unit_keys in zip(layout.units, pieces, keys, strict=True):
        for key, dtype in unit_keys:
            flat = torch.zeros(unit.shard_numel, dtype=dtype, device=unit_pieces[0].device)
            for param, piece in zip(unit.params, unit_pieces, strict=True):
                value = local.get(id(piece), {}).get(key)
                if _is_sharded(value, piece.numel()):
                    unit.piece(param, flat).copy_(value)
            full = gather_unit(comm, unit, flat)
            if keep:
                for param, view in zip(unit.params, unit.full_views(full), strict=True):
                    state.setdefault(param.name, {})[key] = to_cpu(view)
    if not keep:
        return {}
    for pid, values in local.items():
        _, param, piece = entries[pid]
        for key, value in values.items():
            if not _is_sharded(value, piece.numel()):
                state.setdefault(param.name, {})[key] = to_cpu(value) if isinstance(value, torch.Tensor) else value
    return {"state": state, "param_groups": _named_groups(optimizer, entries)}


def _sharded_keys(
    layout: ShardLayout, pieces: Pieces, local: Mapping[int, Mapping[str, Any]], comm: Communicator
) -> list[list[tuple]]:
    """Per unit, the (key, dtype) of sharded state tensors on any rank: every rank gathers the same ones."""
    mine: list[set[tuple]] = []
    for unit_pieces in pieces:
        keys = set()
        for piece in unit_pieces:
            for key, value in local.get(id(piece), {}).items():
                if _is_sharded(value, piece.numel()):
                    keys.add((key, value.dtype))
        mine.append(keys)
    everyone = kept_collectives.all_gather_object(mine, comm.group)
    return [sorted(set().union(*(rank[i] for rank in everyone)), key=str) for i in range(len(mine))]


def _load(optimizer: torch.optim.Optimizer, entries: dict[int, _Entry], state: dict, groups: list) -> None:
    """Loads name-keyed pieces into ``optimizer`` through its own ``load_state_dict``."""
    index = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            index[entries[id(p)][1].name] = len(index)
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
        names.update(zip(saved_group["params"], (entries[id(p)][1].name for p in group["params"]), strict=True))
    return {
        "state": {names[index]: values for index, values in full["state"].items()},
        "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in full["param_groups"]],
    }


def index_keyed(full: Mapping[str, Any]) -> dict[str, Any]:
    """A full optimizer state keyed by parameter name in torch's own layout: the parameters numbered in the
    order of ``param_groups``, group after group, as ``optimizer.state_dict()`` keys them under ddp or one device
    (Lightning's FSDP re-keys its full checkpoints to positions too), so any plain optimizer loads it. ``{}`` (what
    other ranks than 0 gather) stays ``{}``; a state already keyed by position is returned as it is."""
    if not full or not any(isinstance(p, str) for g in full["param_groups"] for p in g["params"]):
        return dict(full)
    index: dict[str, int] = {}
    for group in full["param_groups"]:
        for name in group["params"]:
            index.setdefault(name, len(index))
    return {
        "state": {index[name]: values for name, values in full["state"].items()},
        "param_groups": [{**g, "params": [index[name] for name in g["params"]]} for g in full["param_groups"]],
    }


def load_full_optim_state(
    layout: ShardLayout, pieces: Pieces, optimizer: torch.optim.Optimizer, full: Mapping[str, Any]
) -> None:
    """Loads this rank's pieces from a full optimizer state dict: keyed by parameter name (hai_fsdp's) or by
    position (``optimizer.state_dict()`` of ddp or one device). No collectives."""
    entries = _entries(layout, pieces)
    full = _by_name(optimizer, entries, full)
    state = {}
    for _, param, _ in entries.values():
        values = full["state"].get(param.name)
        if values is None:
            continue
        state[param.name] = {
            k: v.reshape(-1)[param.start : param.end].clone()
            if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape == param.shape
            else v
            for k, v in values.items()
        }
    _load(optimizer, entries, state, full["param_groups"])


def load_local_optim_states(
    layout: ShardLayout, pieces: Pieces, optimizer: torch.optim.Optimizer, saved: Iterable[Mapping[str, Any]]
) -> None:
    """Loads this rank's pieces from saved sharded optimizer states of any world size. No collectives."""
    entries = _entries(layout, pieces)
    mine = {param.name: (param, piece) for _, param, piece in entries.values()}
    state: dict[str, dict[str, Any]] = {}
    groups = None
    for shard in saved:
        check_format(shard)
        groups = groups if groups is not None else shard["param_groups"]
        for name, values in shard["state"].items():
            if name not in mine:
                continue
            param, piece = mine[name]
            where = shard["layout"][name]
            target = state.setdefault(name, {})
            for key, value in values.items():
                if _is_sharded(value, where["numel"]):
                    dst = target.setdefault(key, torch.zeros(piece.numel(), dtype=value.dtype))
                    copy_overlap(dst, param.start, value, where["start"])
                elif key not in target:
                    target[key] = value
    if groups is None:
        raise ValueError("load_sharded_optim_state_dict: no shards given")
    _load(optimizer, entries, state, groups)


# --------------------------------------------------------------- lightning-haiscale 0.1's free functions
# ``model`` is a FullyShardedDataParallel (typed as its base class: that module imports this one).


def sharded_optim_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``model.sharded_optim_state_dict(optimizer)``."""
    return model.sharded_optim_state_dict(optimizer)


def full_optim_state_dict(
    model: nn.Module, optimizer: torch.optim.Optimizer, rank0_only: bool = True
) -> dict[str, Any]:
    """``model.full_optim_state_dict(optimizer, rank0_only)``."""
    return model.full_optim_state_dict(optimizer, rank0_only)


def load_full_optim_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer, full: Mapping[str, Any]) -> None:
    """``model.load_full_optim_state_dict(optimizer, full)``."""
    model.load_full_optim_state_dict(optimizer, full)


def load_sharded_optim_state_dict(
    model: nn.Module, optimizer: torch.optim.Optimizer, shards: Iterable[Mapping[str, Any]]
) -> None:
    """``model.load_sharded_optim_state_dict(optimizer, shards)``."""
    model.load_sharded_optim_state_dict(optimizer, shards)
