"""Model state dicts of a :class:`FullyShardedDataParallel`: full (one file, rank 0) and sharded (one
per rank, loadable on any number of ranks).

[Note: sharded format]
``{"format": SHARDED_FORMAT, "world_size": W, "rank": r, "tensors": {fqn: piece}, "layout": {fqn:
{"shape": [...], "start": s}}, "buffers": {name: tensor}}``: ``piece`` holds elements ``[s, s +
piece.numel())`` of the flattened parameter ``fqn``. Loading intersects each saved piece with the
pieces of the new layout, so any world size and any wrapping policy can read it; shards may be
memory-mapped (``torch.load(..., mmap=True)``) so each rank reads only the bytes it needs.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from lightning_haiscale.fsdp.fully_sharded import FullyShardedDataParallel

__all__ = [
    "SHARDED_FORMAT",
    "full_state_dict",
    "load_full_state_dict",
    "load_sharded_state_dict",
    "sharded_state_dict",
    "summoned_state_dict",
]

SHARDED_FORMAT = "lightning_haiscale.fsdp.sharded/1"


def _to_cpu(tensor: torch.Tensor) -> torch.Tensor:
    """A CPU copy that owns its memory: one copy, never a second "offload" copy of a CPU tensor."""
    tensor = tensor.detach()
    return tensor.clone() if tensor.device.type == "cpu" else tensor.cpu()


def full_state_dict(
    model: FullyShardedDataParallel, rank0_only: bool = True, *, check_arrival: bool = True
) -> dict[str, torch.Tensor]:
    """Every parameter whole, on the CPU, keyed as the bare module's ``state_dict()``. Collective (a call on a
    subset of ranks raises, unless ``check_arrival=False``); gathers one unit at a time. With ``rank0_only``
    the other ranks get ``{}``."""
    if check_arrival:
        model.expect_every_rank("full_state_dict()")
    keep = not rank0_only or model.comm.rank == 0
    values: dict[str, torch.Tensor] = {}
    for group in model._groups.values():
        full = group.gather_full()
        if keep:
            for info, view in zip(group.infos, group.full_views(full), strict=True):
                tensor = _to_cpu(view)
                values.update(dict.fromkeys(info.fqns, tensor))
        del full
    if not keep:
        return {}
    buffers = dict(model.module.named_buffers(remove_duplicate=False))
    values.update((k, _to_cpu(buffers[k])) for k in model._state_dict_keys if k in buffers)
    return {k: values[k] for k in model._state_dict_keys if k in values}


def summoned_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """``module.state_dict()`` copied to the CPU, for a module holding its whole parameters (inside
    ``summon_full_params``). No collectives; a tensor shared by several keys stays shared."""
    copies: dict[int, torch.Tensor] = {}
    result = {}
    for key, value in module.state_dict(keep_vars=True).items():
        if id(value) not in copies:
            copies[id(value)] = _to_cpu(value)
        result[key] = copies[id(value)]
    return result


def load_full_state_dict(
    model: FullyShardedDataParallel, state_dict: Mapping[str, torch.Tensor], strict: bool = True
) -> tuple[list[str], list[str]]:
    """Copies each rank's pieces out of a full state dict given on every rank (memory-map it when
    loading from a file, so the ranks share one copy). No collectives. Returns (missing, unexpected) keys."""
    known = set(model._state_dict_keys)
    missing = [k for k in model._state_dict_keys if k not in state_dict]
    unexpected = [k for k in state_dict if k not in known]
    if strict and (missing or unexpected):
        raise KeyError(f"load_full_state_dict: missing keys {missing}, unexpected keys {unexpected}")
    with torch.no_grad():
        for group in model._groups.values():
            for info in group.infos:
                key = next((k for k in info.fqns if k in state_dict), None)
                if key is None:
                    continue
                value = state_dict[key]
                if value.shape != info.shape:
                    raise ValueError(f"{key}: checkpoint shape {tuple(value.shape)} != model shape {tuple(info.shape)}")
                group.piece(info).copy_(value.reshape(-1)[info.piece_start : info.piece_end])
        _load_buffers(model, state_dict)
    return missing, unexpected


def sharded_state_dict(model: FullyShardedDataParallel) -> dict[str, Any]:
    """This rank's pieces and their layout (see [Note: sharded format]). No collectives."""
    tensors, layout = {}, {}
    for group in model._groups.values():
        for info in group.infos:
            tensors[info.fqns[0]] = _to_cpu(group.piece(info))
            layout[info.fqns[0]] = {"shape": list(info.shape), "start": info.piece_start}
    buffers = dict(model.module.named_buffers(remove_duplicate=False))
    return {
        "format": SHARDED_FORMAT,
        "world_size": model.comm.world_size,
        "rank": model.comm.rank,
        "tensors": tensors,
        "layout": layout,
        "buffers": {k: _to_cpu(buffers[k]) for k in model._state_dict_keys if k in buffers},
    }


def load_sharded_state_dict(
    model: FullyShardedDataParallel, shards: Iterable[Mapping[str, Any]], strict: bool = True
) -> tuple[list[str], list[str]]:
    """Fills this rank's pieces from saved shards of any world size (each read once, in any order).
    No collectives. Returns (missing, unexpected) parameter names."""
    wanted = {info.fqns[0]: (group, info) for group in model._groups.values() for info in group.infos}
    covered = dict.fromkeys(wanted, 0)
    unexpected: set[str] = set()
    with torch.no_grad():
        for index, shard in enumerate(shards):
            _check_format(shard)
            for fqn, saved in shard["tensors"].items():
                if fqn not in wanted:
                    unexpected.add(fqn)
                    continue
                group, info = wanted[fqn]
                start = shard["layout"][fqn]["start"]
                covered[fqn] += copy_overlap(group.piece(info), info.piece_start, saved, start)
            if index == 0:
                _load_buffers(model, shard["buffers"])
    incomplete = [f for f, (_, info) in wanted.items() if covered[f] != info.piece_end - info.piece_start]
    if strict and (incomplete or unexpected):
        raise KeyError(f"load_sharded_state_dict: incomplete or missing {incomplete}, unexpected {sorted(unexpected)}")
    return incomplete, sorted(unexpected)


def copy_overlap(dst: torch.Tensor, dst_start: int, src: torch.Tensor, src_start: int) -> int:
    """Copies the common elements of two pieces of one flattened tensor; returns how many."""
    lo = max(dst_start, src_start)
    hi = min(dst_start + dst.numel(), src_start + src.numel())
    if hi <= lo:
        return 0
    dst[lo - dst_start : hi - dst_start].copy_(src.reshape(-1)[lo - src_start : hi - src_start])
    return hi - lo


def _check_format(shard: Mapping[str, Any]) -> None:
    if shard.get("format") != SHARDED_FORMAT:
        found = shard.get("format")
        raise ValueError(f"not a hai_fsdp sharded state dict (format {found!r}, expected {SHARDED_FORMAT!r})")


def _load_buffers(model: FullyShardedDataParallel, state_dict: Mapping[str, torch.Tensor]) -> None:
    for name, buffer in model.module.named_buffers(remove_duplicate=False):
        if name in state_dict:
            buffer.copy_(state_dict[name])
