"""The state-dict keys of a module's parameters and buffers, which are not always their attribute paths.

[Note: state-dict keys are not parameter names]
A module's ``state_dict()`` may rename what ``named_parameters()`` calls a tensor: torch's
``checkpoint_wrapper`` (``apply_activation_checkpointing``) registers a hook that strips
``_checkpoint_wrapped_module.`` from its keys, so ``h.0._checkpoint_wrapped_module.attn.weight`` is saved as
``h.0.attn.weight``, as torch FSDP and Lightning save it and as the plain model loads it. Keying the shards by
attribute path while the layout's keys came from ``state_dict()`` silently dropped every wrapped block from
the checkpoints. So the keys are found by identity: ``state_dict(keep_vars=True)`` returns the tensors
themselves, and each one's keys are the keys under which it appears, whatever the hooks did to the names.
"""

from __future__ import annotations

import itertools
from collections.abc import Collection, Iterable, Mapping

import torch
from torch import nn

__all__ = ["buffers_by_key", "keys_of", "state_dict_names"]


def state_dict_names(module: nn.Module) -> dict[str, tuple[str, ...]]:
    """Attribute path of every parameter and buffer (shared ones under each path) -> the ``state_dict()``
    keys that hold it (``()`` for a non-persistent buffer). See [Note: state-dict keys are not parameter names]."""
    by_id: dict[int, list[str]] = {}
    for key, value in module.state_dict(keep_vars=True).items():
        by_id.setdefault(id(value), []).append(key)
    tensors = itertools.chain(
        module.named_parameters(remove_duplicate=False), module.named_buffers(remove_duplicate=False)
    )
    return {name: tuple(by_id.get(id(tensor), ())) for name, tensor in tensors}


def keys_of(paths: Iterable[str], names: Mapping[str, tuple[str, ...]]) -> list[str]:
    """The state-dict keys of a tensor known under ``paths`` (in order, once each); the paths themselves when
    the state dict holds it under no key (saving it then raises, see ``layout.unmatched``)."""
    paths = list(paths)
    keys = list(dict.fromkeys(k for path in paths for k in names.get(path, ())))
    return keys or paths


def buffers_by_key(module: nn.Module, params: Collection[int] = ()) -> dict[str, torch.Tensor]:
    """``module``'s persistent buffers, and the parameters whose ``id`` is in ``params`` (not sharded: those of
    ``ignored_modules``), keyed as its ``state_dict()`` keys them."""
    local = {id(b) for b in module.buffers()} | set(params)
    return {k: v for k, v in module.state_dict(keep_vars=True).items() if id(v) in local}
