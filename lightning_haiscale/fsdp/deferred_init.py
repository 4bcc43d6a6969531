"""Materializing a unit's meta-device parameters just before it is sharded, so the full model never
exists on one rank: at most one unit at a time is whole."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager

import torch
from torch import nn

from lightning_haiscale.fsdp.wrap import ParamRef

__all__ = ["materialize_unit"]


def materialize_unit(
    refs: list[ParamRef],
    scope: list[nn.Module],
    device: torch.device,
    param_init_fn: Callable[[nn.Module], None] | None,
    shapes: Mapping[int, torch.Size],
) -> None:
    """Creates the unit's meta parameters and its modules' meta buffers on ``device`` and initializes them.

    Args:
        refs: the unit's parameters; meta ones are replaced (``ref.param`` is updated).
        scope: modules whose innermost unit is this one (their meta buffers are materialized here).
        device: where to create them.
        param_init_fn: ``fn(module)`` initializing a module's direct parameters and buffers in place;
            default ``module.reset_parameters()``.
        shapes: original shape of every already sharded parameter, by ``id`` of its shard parameter.
    """
    owned: set[int] = set()
    to_init: dict[int, nn.Module] = {}
    for ref in refs:
        if not ref.param.is_meta:
            continue
        new = nn.Parameter(torch.empty_like(ref.param, device=device), requires_grad=ref.param.requires_grad)
        for module, attr in ref.holders:
            module._parameters[attr] = new
            to_init[id(module)] = module
        ref.param = new
        owned.add(id(new))
    for module in scope:
        for name, buffer in module._buffers.items():
            if buffer is not None and buffer.is_meta:
                module._buffers[name] = torch.empty_like(buffer, device=device)
                to_init[id(module)] = module
    with torch.no_grad():
        for module in to_init.values():
            with _hide_foreign_params(module, owned, shapes):
                _init(module, param_init_fn)


def _init(module: nn.Module, param_init_fn: Callable[[nn.Module], None] | None) -> None:
    if param_init_fn is not None:
        param_init_fn(module)
    elif hasattr(module, "reset_parameters"):
        module.reset_parameters()
    else:
        raise ValueError(
            f"{type(module).__name__} has parameters or buffers on the meta device but no reset_parameters(); "
            "pass param_init_fn=fn(module) to initialize them"
        )


@contextmanager
def _hide_foreign_params(module: nn.Module, owned: set[int], shapes: Mapping[int, torch.Size]) -> Iterator[None]:
    """Shows initializers meta stand-ins for parameters of other units, so re-initializing a module here
    cannot touch a shard that another unit already holds."""
    saved = {}
    for attr, param in module._parameters.items():
        if param is not None and id(param) not in owned:
            saved[attr] = param
            shape = shapes.get(id(param), param.shape)
            module._parameters[attr] = nn.Parameter(torch.empty(shape, dtype=param.dtype, device="meta"))
    try:
        yield
    finally:
        module._parameters.update(saved)
