"""Fabric's ``hai_fsdp`` checkpoints: ``fabric.save``, ``fabric.load`` and ``fabric.load_raw`` in the layouts of
Lightning Fabric's ``FSDPStrategy``.

[Note: Fabric checkpoints] ``state_dict_type="full"``: one file on rank 0 holding, under the keys of the saved
state, the module's full state dict (bare-module keys), each optimizer's state in torch's index-keyed layout (as
``optimizer.state_dict()`` and Lightning's FSDP write it) and everything else. ``"sharded"``: a
``torch.distributed.checkpoint`` folder with the module and the optimizers under the state's own keys, each
tensor in its parameter's shape (see ``fsdp.dcp`` [Note: Lightning's keys]), and ``meta.pt`` (everything else,
rank 0); it loads on any number of ranks. Both are published atomically (see ``adapter.checkpoint_files``). Loading
takes either, full optimizer states of ddp or one device, and the folders of earlier builds of lightning-haiscale (whose
``meta.pt`` names the module and the optimizers). ``filter`` keeps the entries a function accepts, as Lightning's
``_apply_filter``; ``strict`` as Lightning's Fabric FSDP (missing keys raise).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from lightning_haiscale.adapter.checkpoint_io import check_file_targets, save_file
from lightning_haiscale.adapter.sharded_folder import check_checkpoint_path, load_meta, save_sharded
from lightning_haiscale.fabric.shared import apply_filter, check_strict_keys
from lightning_haiscale.fsdp import FullyShardedDataParallel
from lightning_haiscale.fsdp.dcp import is_dcp_folder, load_dcp, load_into_module, saved_keys
from lightning_haiscale.fsdp.optim_state import index_keyed

__all__ = ["load", "save", "the_module"]

_NAMES = "hai_fsdp_names"  # in earlier builds' meta.pt: which entries were the module and the optimizers

Filter = Mapping[str, Callable[[str, Any], bool]]


def save(strategy: Any, path: Any, state: dict[str, Any], storage_options: Any, filter: Filter | None) -> None:
    """``fabric.save(path, state, filter=)`` (see [Note: Fabric checkpoints]). Collective."""
    key, model = the_module(state)
    if strategy.state_dict_type == "sharded":
        if filter:
            raise NotImplementedError(
                "hai_fsdp does not save sharded checkpoints with a filter (neither does Lightning's FSDPStrategy: "
                "they could not be loaded); use state_dict_type='full' or save without filter="
            )
        _save_sharded(strategy, Path(strategy.broadcast(str(path))), key, model, state, storage_options)
        return
    check_file_targets(strategy.broadcast, strategy.is_global_zero, [path])
    full: dict[str, Any] = {}
    for name, value in state.items():
        if value is model:
            converted = model.full_state_dict()
        elif isinstance(value, Optimizer):
            converted = index_keyed(model.full_optim_state_dict(value))
        else:
            converted = value.state_dict() if hasattr(value, "state_dict") else value
        apply_filter(name, dict(filter or {}), converted, full)
    if strategy.is_global_zero:
        save_file(strategy.checkpoint_io, full, path, storage_options)
    strategy.barrier()


def _save_sharded(
    strategy: Any, folder: Path, key: str, model: FullyShardedDataParallel, state: dict[str, Any], options: Any
) -> None:
    optimizers = {name: model.sharded_optim_state_dict(v) for name, v in state.items() if isinstance(v, Optimizer)}
    rest = {
        name: value.state_dict() if hasattr(value, "state_dict") else value
        for name, value in state.items()
        if name != key and name not in optimizers
    }
    save_sharded(strategy, folder, model.sharded_state_dict(), optimizers, rest, model.process_group, options, key)


def load(strategy: Any, path: Any, state: Any, strict: bool, weights_only: bool | None) -> dict[str, Any]:
    """``fabric.load(path, state)``: into the module and optimizers of ``state`` in place; returns what they did
    not take. ``fabric.load_raw(path, module)``: a full file's state dict or a folder's module into ``module``
    (set up or bare). Collective."""
    path = Path(strategy.broadcast(str(path)))
    if isinstance(state, Optimizer):
        raise NotImplementedError(
            "Loading a single optimizer object from a checkpoint is not supported by hai_fsdp (nor by Lightning's "
            "FSDPStrategy): load it with its module, fabric.load(path, {'model': model, 'optimizer': optimizer})"
        )
    if isinstance(state, nn.Module):
        _load_raw(path, state, strict, weights_only)
        return {}
    if not isinstance(state, dict) or not state:
        raise ValueError(
            f"Got {type(strategy).__name__}.load_checkpoint(..., state={state!r}), but hai_fsdp loads into a dict "
            "holding at least the module to reload: fabric.load(path, {'model': model, ...})"
        )
    key, model = the_module(state)
    check_checkpoint_path(path)
    optimizers = [name for name, value in state.items() if isinstance(value, Optimizer)]
    if is_dcp_folder(path):
        checkpoint = load_meta(strategy, path, weights_only)
        _load_sharded(path, checkpoint, key, model, {name: state[name] for name in optimizers}, strict)
    else:
        checkpoint = dict(strategy.checkpoint_io.load_checkpoint(path, weights_only=weights_only))
        check_strict_keys([key, *optimizers], checkpoint.keys(), strict)
        if key in checkpoint:
            model.load_full_state_dict(checkpoint.pop(key), strict=strict)
        for name in (name for name in optimizers if name in checkpoint):
            model.load_full_optim_state_dict(state[name], checkpoint.pop(name))
    wanted = [name for name in state if name != key and name not in optimizers]
    check_strict_keys(wanted, checkpoint.keys(), strict)
    for name in (name for name in wanted if name in checkpoint):
        value = state[name]
        if hasattr(value, "load_state_dict"):
            value.load_state_dict(checkpoint.pop(name))
        else:
            state[name] = checkpoint.pop(name)
    return checkpoint


def _load_sharded(
    path: Path,
    checkpoint: dict[str, Any],
    key: str,
    model: FullyShardedDataParallel,
    optimizers: dict[str, Optimizer],
    strict: bool,
) -> None:
    names = checkpoint.pop(_NAMES, None)
    if names is not None:  # an earlier build's folder: the optimizers by position, under the names its meta.pt gives
        saved = {name: f"optimizer_{i}" for i, name in enumerate(names["optimizers"])}
    else:
        saved = {name: name for name in saved_keys(path) if name != key}
    check_strict_keys(optimizers, saved, strict)
    wanted = [name for name in optimizers if name in saved]
    model_key = key if names is None else "model"  # an earlier build's model key is found by load_dcp itself
    model_shard, shards = load_dcp(path, model, [saved[n] for n in wanted], strict=strict, model_key=model_key)
    model.load_sharded_state_dict([model_shard], strict=strict)
    for name, shard in zip(wanted, shards, strict=True):
        model.load_sharded_optim_state_dict(optimizers[name], [shard])


def _load_raw(path: Path, module: nn.Module, strict: bool, weights_only: bool | None) -> None:
    if path.is_dir() and not is_dcp_folder(path):
        raise ValueError(
            "The given path must be a single file containing the full state dict, or a sharded checkpoint folder "
            f"(with DCP's .metadata): {path}"
        )
    if is_dcp_folder(path):
        if isinstance(module, FullyShardedDataParallel):
            model_shard, _ = load_dcp(path, module, [], strict=strict, model_key=_module_key(path))
            module.load_sharded_state_dict([model_shard], strict=strict)
        else:
            load_into_module(path, module, _module_key(path), strict=strict)
        return
    safe = True if weights_only is None else weights_only
    state_dict = torch.load(path, map_location="cpu", mmap=True, weights_only=safe)
    if isinstance(module, FullyShardedDataParallel):
        module.load_full_state_dict(state_dict, strict=strict)
    else:
        module.load_state_dict(state_dict, strict=strict)


def _module_key(path: Path) -> str:
    """The key of a folder's module: ``model`` (Lightning's Trainer and Fabric by default), else the one entry
    that is not an optimizer's."""
    keys = saved_keys(path)
    if "model" in keys or len(keys) == 0:
        return "model"
    modules = [k for k, kind in keys.items() if kind == "module"]
    if len(modules) != 1:
        raise ValueError(f"{path} holds {len(modules)} modules ({sorted(modules)}); load_raw takes a folder with one")
    return modules[0]


def the_module(state: Mapping[str, Any]) -> tuple[str, FullyShardedDataParallel]:
    """The one sharded module of a checkpoint's state, and its key: its optimizers' states follow its names."""
    modules = [(k, v) for k, v in state.items() if isinstance(v, FullyShardedDataParallel)]
    if not modules:
        raise ValueError(
            "Could not find a FSDP model in the provided checkpoint state. hai_fsdp checkpoints hold the one module "
            "returned by fabric.setup: put it in the state, {'model': model, ...}"
        )
    if len(modules) > 1:
        raise ValueError(
            f"Found multiple FSDP models in the given state ({', '.join(k for k, _ in modules)}). hai_fsdp "
            "checkpoints hold one module set up by fabric.setup: save the others in checkpoints of their own"
        )
    return modules[0]
