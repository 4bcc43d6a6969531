"""Materializing a unit's meta-device parameters just before it is sharded, so the full model never
exists on one rank: at most one unit at a time is whole.

[Note: initializing as the model would]
A module built on the meta device skipped its initialization; each unit is initialized here the way an eager
construction of the model would have initialized it, so that a model built in ``configure_model`` (or under
``init_module(empty_init=True)``) starts with the statistics it has when built eagerly:

- every module that got new tensors runs ``reset_parameters()`` if it has one (what ``nn.Linear.__init__``
  does), as torch FSDP materializes;
- inside a Hugging Face ``PreTrainedModel``, the model's own ``_init_weights`` then runs over those modules
  *and their ancestors*, children before parents (``PreTrainedModel.initialize_weights``'s order, each module
  by its nearest ``PreTrainedModel``). The ancestors matter: GPT-2's rule for ``c_proj.weight`` (std
  ``0.02 / sqrt(2 * n_layer)``) is keyed on the parent ``GPT2Attention``/``GPT2MLP``, not on ``Conv1D``;
- ``param_init_fn=fn(module)`` replaces both, called on each module that got new tensors.

Initializers see every parameter that is not this unit's as a meta-device stand-in of its shape (see
:func:`_foreign_hidden`): re-initializing a parent cannot touch a shard another unit already holds, and an
initializer's writes to those stand-ins are no-ops. New floating-point tensors start as NaN; on the default
path one that no initializer wrote raises, naming it, instead of training from uninitialized memory.
"""

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
    root: nn.Module | None = None,
) -> None:
    """Creates the unit's meta parameters and its modules' meta buffers on ``device`` and initializes them
    (see [Note: initializing as the model would]).

    Args:
        refs: the unit's parameters; meta ones are replaced (``ref.param`` is updated).
        scope: modules whose innermost unit is this one (their meta buffers are materialized here).
        device: where to create them.
        param_init_fn: ``fn(module)`` initializing a module's parameters and buffers in place; default: the
            model's own initialization.
        shapes: original shape of every already sharded parameter, by ``id`` of its shard parameter.
        root: the whole model (its ``PreTrainedModel`` ancestors and their order); default ``scope[0]``.
    """
    fresh: list[tuple[str, torch.Tensor]] = []  # (name for errors, tensor)
    to_init: dict[int, nn.Module] = {}
    for ref in refs:
        if not ref.param.is_meta:
            continue
        new = nn.Parameter(_empty_like(ref.param, device), requires_grad=ref.param.requires_grad)
        for module, attr in ref.holders:
            module._parameters[attr] = new
            to_init[id(module)] = module
        ref.param = new
        fresh.append((ref.fqns[0], new))
    for module in scope:
        for name, buffer in module._buffers.items():
            if buffer is not None and buffer.is_meta:
                module._buffers[name] = _empty_like(buffer, device)
                fresh.append((f"buffer {name} of a {type(module).__name__}", module._buffers[name]))
                to_init[id(module)] = module
    if not to_init:
        return
    root = root if root is not None else scope[0]
    owned = {id(t) for _, t in fresh}
    with torch.no_grad(), _foreign_hidden(root, owned, shapes):
        if param_init_fn is not None:
            for module in to_init.values():
                param_init_fn(module)
            return
        _init_as_built(root, list(to_init.values()))
    _check_written(fresh)


def _empty_like(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A new tensor like ``tensor`` on ``device``: NaN if floating point, so an unwritten one shows."""
    if tensor.is_floating_point() or tensor.is_complex():
        return torch.full_like(tensor, float("nan"), device=device)
    return torch.empty_like(tensor, device=device)


def _init_as_built(root: nn.Module, modules: list[nn.Module]) -> None:
    """``reset_parameters()``, then the enclosing ``PreTrainedModel``'s rules (see the Note)."""
    tree = _Tree(root)
    for module in modules:
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()
        elif tree.hf_model(module) is None:
            raise ValueError(
                f"{type(module).__name__} has parameters or buffers on the meta device but no reset_parameters(); "
                "pass param_init_fn=fn(module) to initialize them"
            )
    chain = {id(a): a for m in modules for a in tree.ancestors_or_self(m) if tree.hf_model(a) is not None}
    for module in sorted(chain.values(), key=tree.post_order):
        tree.hf_model(module)._init_weights(module)  # type: ignore[union-attr]


def _check_written(fresh: list[tuple[str, torch.Tensor]]) -> None:
    for name, tensor in fresh:
        if (tensor.is_floating_point() or tensor.is_complex()) and torch.isnan(tensor).any():
            raise ValueError(
                f"{name} was built on the meta device and no initializer wrote it (neither its module's "
                "reset_parameters() nor its model's _init_weights); pass param_init_fn=fn(module) to initialize it"
            )


def _is_pretrained_model(module: nn.Module) -> bool:
    """A Hugging Face ``transformers.PreTrainedModel`` (recognized without importing transformers)."""
    mro = type(module).__mro__
    return any(c.__name__ == "PreTrainedModel" and c.__module__.startswith("transformers") for c in mro)


class _Tree:
    """Parents, post-order positions and the nearest enclosing ``PreTrainedModel`` of every module of ``root``."""

    def __init__(self, root: nn.Module) -> None:
        self._parent: dict[int, nn.Module | None] = {id(root): None}
        self._order: dict[int, int] = {}
        self._hf: dict[int, nn.Module | None] = {}
        self._walk(root, None)

    def _walk(self, module: nn.Module, hf: nn.Module | None) -> None:
        hf = module if _is_pretrained_model(module) else hf
        self._hf[id(module)] = hf
        for child in module.children():
            if id(child) not in self._hf:
                self._parent[id(child)] = module
                self._walk(child, hf)
        self._order[id(module)] = len(self._order)

    def hf_model(self, module: nn.Module) -> nn.Module | None:
        return self._hf.get(id(module))

    def post_order(self, module: nn.Module) -> int:
        return self._order[id(module)]

    def ancestors_or_self(self, module: nn.Module) -> Iterator[nn.Module]:
        current: nn.Module | None = module
        while current is not None:
            yield current
            current = self._parent.get(id(current))


@contextmanager
def _foreign_hidden(root: nn.Module, owned: set[int], shapes: Mapping[int, torch.Size]) -> Iterator[None]:
    """Shows initializers a meta stand-in, of the original shape, for every parameter of ``root`` that is not in
    ``owned``, so initializing this unit cannot touch another unit's shard (or a parameter already real)."""
    saved: list[tuple[nn.Module, str, nn.Parameter]] = []
    stand_ins: dict[int, nn.Parameter] = {}
    for module in root.modules():
        for attr, param in module._parameters.items():
            if param is None or id(param) in owned or param.is_meta:
                continue
            if id(param) not in stand_ins:
                shape = shapes.get(id(param), param.shape)
                stand_ins[id(param)] = nn.Parameter(torch.empty(shape, dtype=param.dtype, device="meta"))
            saved.append((module, attr, param))
            module._parameters[attr] = stand_ins[id(param)]
    try:
        yield
    finally:
        for module, attr, param in saved:
            module._parameters[attr] = param
