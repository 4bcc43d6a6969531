"""Model state dicts of a :class:`FullyShardedDataParallel`: full (one file, rank 0) and sharded (one
per rank, loadable on any number of ranks).

[Note: sharded format]
``{"format": SHARDED_FORMAT, "world_size": W, "rank": r, "tensors": {fqn: piece}, "layout": {fqn:
{"shape": [...], "start": s}}, "buffers": {name: tensor}}``: ``piece`` holds elements ``[s, s +
piece.numel())`` of the flattened parameter ``fqn``; ``"aliases": {fqn: [key, ...]}`` lists the other keys of
a shared parameter (a tied head), which the DCP form saves too, so that its whole-tensor conversion loads into
the bare module. Loading intersects each saved piece with the
pieces of the new layout, so any world size and any wrapping policy can read it; shards may be
memory-mapped (``torch.load(..., mmap=True)``) so each rank reads only the bytes it needs.

The entry points are :class:`FullyShardedDataParallel`'s methods (``full_state_dict()``,
``sharded_state_dict()``, ``load_full_state_dict()``, ``load_sharded_state_dict()``, and ``state_dict()`` /
``load_state_dict()``); the functions here work on its public :class:`~lightning_haiscale.fsdp.layout.ShardLayout`
and the flat shards it describes. The free functions named like the methods call them (kept for
lightning-haiscale 0.1's callers).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from lightning_haiscale.fsdp.collectives import gather_unit
from lightning_haiscale.fsdp.layout import (
    SHARDED_FORMAT,
    ShardLayout,
    check_format,
    check_matched,
    copy_overlap,
    to_cpu,
)
from lightning_haiscale.hfreduce import Communicator

__all__ = [
    "SHARDED_FORMAT",
    "copy_overlap",
    "full_state_dict",
    "gather_full_state",
    "load_full_state",
    "load_full_state_dict",
    "load_local_states",
    "load_sharded_state_dict",
    "local_state",
    "sharded_state_dict",
    "summoned_state_dict",
]


def gather_full_state(
    layout: ShardLayout,
    flat_shards: Sequence[torch.Tensor],
    buffers: Mapping[str, torch.Tensor],
    comm: Communicator,
    keep: bool,
) -> dict[str, torch.Tensor]:
    """Every parameter whole, on the CPU, keyed as the bare module's ``state_dict()``, where ``keep`` (``{}``
    elsewhere). Collective over ``comm``, without an arrival check (the wrapper's methods make it); gathers one
    unit at a time. ``flat_shards``: each unit's flat shard; ``buffers``: the module's buffers by state-dict key.
    Raises before any collective if a shard has no key or a key no tensor (``layout.check_matched``)."""
    check_matched(layout, buffers, "full_state_dict()")
    values: dict[str, torch.Tensor] = {}
    for unit, flat in zip(layout.units, flat_shards, strict=True):
        full = gather_unit(comm, unit, flat)
        if keep:
            for param, view in zip(unit.params, unit.full_views(full), strict=True):
                tensor = to_cpu(view)
                values.update(dict.fromkeys(param.names, tensor))
        del full
    if not keep:
        return {}
    values.update((k, to_cpu(buffers[k])) for k in layout.keys if k in buffers)
    return {k: values[k] for k in layout.keys if k in values}


def summoned_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """``module.state_dict()`` copied to the CPU, for a module holding its whole parameters (inside
    ``summon_full_params``). No collectives; a tensor shared by several keys stays shared."""
    copies: dict[int, torch.Tensor] = {}
    result = {}
    for key, value in module.state_dict(keep_vars=True).items():
        if id(value) not in copies:
            copies[id(value)] = to_cpu(value)
        result[key] = copies[id(value)]
    return result


def load_full_state(
    layout: ShardLayout,
    flat_shards: Sequence[torch.Tensor],
    buffers: Mapping[str, torch.Tensor],
    state_dict: Mapping[str, torch.Tensor],
    strict: bool = True,
) -> tuple[list[str], list[str]]:
    """Copies this rank's pieces (into ``flat_shards``) and the buffers out of a full state dict. No
    collectives. Returns (missing, unexpected) keys; with ``strict``, raises unless every key fills a tensor and
    every parameter's piece is written."""
    check_matched(layout, buffers, "load_full_state_dict()")
    known = set(layout.keys)
    missing = [k for k in layout.keys if k not in state_dict]
    unexpected = [k for k in state_dict if k not in known]
    if strict and (missing or unexpected):
        raise KeyError(f"load_full_state_dict: missing keys {missing}, unexpected keys {unexpected}")
    with torch.no_grad():
        for unit, flat in zip(layout.units, flat_shards, strict=True):
            for param in unit.params:
                key = next((k for k in param.names if k in state_dict), None)
                if key is None:  # its key is missing (raised above with strict): check_matched gave it one
                    continue
                value = state_dict[key]
                if value.shape != param.shape:
                    found, want = tuple(value.shape), tuple(param.shape)
                    raise ValueError(f"{key}: checkpoint shape {found} != model shape {want}")
                unit.piece(param, flat).copy_(value.reshape(-1)[param.start : param.end])
        _load_buffers(buffers, state_dict)
    return missing, unexpected


def local_state(
    layout: ShardLayout, flat_shards: Sequence[torch.Tensor], buffers: Mapping[str, torch.Tensor]
) -> dict[str, Any]:
    """This rank's pieces and their layout (see [Note: sharded format]). No collectives."""
    check_matched(layout, buffers, "sharded_state_dict()")
    tensors, where = {}, {}
    for unit, flat in zip(layout.units, flat_shards, strict=True):
        for param in unit.params:
            tensors[param.name] = to_cpu(unit.piece(param, flat))
            where[param.name] = {"shape": list(param.shape), "start": param.start}
    return {
        "format": SHARDED_FORMAT,
        "world_size": layout.world_size,
        "rank": layout.rank,
        "tensors": tensors,
        "layout": where,
        "buffers": {k: to_cpu(buffers[k]) for k in layout.keys if k in buffers},
        "aliases": {param.name: list(param.names[1:]) for _, param in layout.params() if len(param.names) > 1},
    }


def load_local_states(
    layout: ShardLayout,
    flat_shards: Sequence[torch.Tensor],
    buffers: Mapping[str, torch.Tensor],
    saved: Iterable[Mapping[str, Any]],
    strict: bool = True,
) -> tuple[list[str], list[str]]:
    """Fills this rank's pieces from saved sharded state dicts of any world size (each read once, in any
    order; a replica's, with the same world size and rank as one already read, is skipped: hybrid sharding
    saves one per replica). No collectives. Returns (missing, unexpected) parameter names."""
    wanted = {
        param.name: unit.piece(param, flat)
        for unit, flat in zip(layout.units, flat_shards, strict=True)
        for param in unit.params
    }
    starts = {param.name: param.start for _, param in layout.params()}
    covered = dict.fromkeys(wanted, 0)
    unexpected: set[str] = set()
    seen: set[tuple[int, int]] = set()
    with torch.no_grad():
        for shard in saved:
            check_format(shard)
            if (shard["world_size"], shard["rank"]) in seen:
                continue
            seen.add((shard["world_size"], shard["rank"]))
            for fqn, value in shard["tensors"].items():
                if fqn not in wanted:
                    unexpected.add(fqn)
                    continue
                covered[fqn] += copy_overlap(wanted[fqn], starts[fqn], value, shard["layout"][fqn]["start"])
            if len(seen) == 1:
                _load_buffers(buffers, shard["buffers"])
    incomplete = [f for f, piece in wanted.items() if covered[f] != piece.numel()]
    if strict and (incomplete or unexpected):
        raise KeyError(f"load_sharded_state_dict: incomplete or missing {incomplete}, unexpected {sorted(unexpected)}")
    return incomplete, sorted(unexpected)


def _load_buffers(buffers: Mapping[str, torch.Tensor], state_dict: Mapping[str, torch.Tensor]) -> None:
    for name, buffer in buffers.items():
        if name in state_dict:
            buffer.copy_(state_dict[name])


# --------------------------------------------------------------- lightning-haiscale 0.1's free functions
# ``model`` is a FullyShardedDataParallel (typed as its base class: that module imports this one).


def full_state_dict(model: nn.Module, rank0_only: bool = True) -> dict[str, torch.Tensor]:
    """``model.full_state_dict(rank0_only)``."""
    return model.full_state_dict(rank0_only)


def sharded_state_dict(model: nn.Module) -> dict[str, Any]:
    """``model.sharded_state_dict()``."""
    return model.sharded_state_dict()


def load_full_state_dict(
    model: nn.Module, state_dict: Mapping[str, torch.Tensor], strict: bool = True
) -> tuple[list[str], list[str]]:
    """``model.load_full_state_dict(state_dict, strict)``."""
    return model.load_full_state_dict(state_dict, strict)


def load_sharded_state_dict(
    model: nn.Module, shards: Iterable[Mapping[str, Any]], strict: bool = True
) -> tuple[list[str], list[str]]:
    """``model.load_sharded_state_dict(shards, strict)``."""
    return model.load_sharded_state_dict(shards, strict)
