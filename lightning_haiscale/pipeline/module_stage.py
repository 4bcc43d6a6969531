"""A stage of a split module: the user's module, run by its own ``forward``, holding only this stage's part.

[Note: a stage runs the whole forward] ``ModuleStage.forward(*activations, call=(args, kwargs))`` calls the
user's module's own ``forward`` with the microbatch's ``args`` and ``kwargs`` (the call the step made), so
masks, position ids and the loss from ``labels=`` are computed as written. During that call the block list
holds only this stage's blocks; a forward pre-hook on the first one replaces its first input by the
activation received from the previous stage, and a forward hook on the last one ends the call there
(``StageOutput``) and returns its output, the activation sent on. The last stage returns what the module
returns (e.g. a ``CausalLMOutput`` with its ``loss``). What another stage holds and runs before the blocks
(an embedding) is an ``Elsewhere`` stand-in: it runs the module on the meta device for its output's shape
and dtype, and returns zeros, which the received activation replaces.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from collections.abc import Sequence
from functools import partial
from typing import Any

import torch
from torch import nn

from lightning_haiscale.pipeline.split import SplitPlan
from lightning_haiscale.pipeline.ties import Tie

__all__ = ["Elsewhere", "ModuleStage", "StageOutput", "split_module"]


class StageOutput(Exception):
    """Ends a stage's forward after its last block, carrying that block's output."""

    def __init__(self, value: torch.Tensor) -> None:
        super().__init__("pipeline stage output")
        self.value = value


class Elsewhere(nn.Module):
    """Stands in for a module that another stage holds: zeros of its output's shape and dtype."""

    def __init__(self, module: nn.Module, name: str) -> None:
        super().__init__()
        memo: dict[int, Any] = {id(p): nn.Parameter(torch.empty_like(p, device="meta")) for p in module.parameters()}
        memo.update({id(b): torch.empty_like(b, device="meta") for b in module.buffers()})
        self.__dict__["meta_module"] = copy.deepcopy(module, memo)  # not a child: it holds no state
        self.name = name
        self.register_buffer("dtype_probe", torch.empty(0), persistent=False)  # follows .to(dtype) and .to(device)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        out = self.meta_module(*_to_meta(args), **_to_meta(kwargs))
        if not torch.is_tensor(out):
            raise TypeError(
                f"{self.name} is held by another pipeline stage, and its stand-in can only give a tensor's shape; "
                f"it returned {type(out).__name__}: keep it on this stage with split_points="
            )
        dtype = self.dtype_probe.dtype if out.is_floating_point() else out.dtype
        return torch.zeros(out.shape, dtype=dtype, device=self.dtype_probe.device)


class ModuleStage(nn.Module):
    """Stage ``stage`` of ``plan`` over ``module``; its parameters are those of the modules it holds.

    ``ties`` are every tied parameter of the whole pipeline (see ``pipeline.ties``), the same on every rank.
    """

    def __init__(self, module: nn.Module, plan: SplitPlan, stage: int, ties: Sequence[Tie] = ()) -> None:
        super().__init__()
        self.__dict__["network"] = module  # not a child: the stage's parameters are its own modules'
        self.held = nn.ModuleDict({n.replace(".", "/"): module.get_submodule(n) for n in plan.held_modules(stage)})
        self.stage, self.num_stages, self.blocks_name = stage, plan.num_stages, plan.blocks
        block_list = module.get_submodule(plan.blocks)
        self.__dict__["own_blocks"] = OrderedDict((k, block_list._modules[k]) for k in plan.stage_blocks[stage])
        self.ties = list(ties)

    def local_ties(self) -> dict[Tie, nn.Parameter]:
        """This stage's copy of each tied parameter it holds."""
        return {
            t: self.network.get_parameter(n)
            for t in self.ties
            for s, n in zip(t.stages, t.names, strict=True)
            if s == self.stage
        }

    def forward(self, *activations: torch.Tensor, call: tuple[tuple[Any, ...], dict[str, Any]]) -> Any:
        args, kwargs = call
        block_list = self.network.get_submodule(self.blocks_name)
        at_rest = block_list._modules
        blocks = list(self.own_blocks.values())
        handles = []
        if self.stage > 0:
            handles.append(blocks[0].register_forward_pre_hook(partial(_enter, activations), with_kwargs=True))
        if self.stage < self.num_stages - 1:
            handles.append(blocks[-1].register_forward_hook(_leave))
        block_list.__dict__["_modules"] = OrderedDict(self.own_blocks)
        try:
            return type(self.network).forward(self.network, *args, **kwargs)  # the class's: see the step's stand-in
        except StageOutput as out:
            return out.value
        finally:
            block_list.__dict__["_modules"] = at_rest
            for handle in handles:
                handle.remove()


def split_module(module: nn.Module, plan: SplitPlan, stages: Sequence[int]) -> list[ModuleStage]:
    """This rank's ``stages`` of ``module``; afterwards ``module`` holds only what they hold.

    The ties are found before the cut (every rank holds the whole module then). Blocks of other stages leave
    the block list; modules of other stages outside it become ``Elsewhere`` stand-ins.
    """
    ties = plan.ties(module)
    parts = [ModuleStage(module, plan, s, ties) for s in stages]
    held = {name for s in stages for name in plan.held_modules(s)}
    block_list = module.get_submodule(plan.blocks)
    kept = OrderedDict((k, b) for k, b in block_list._modules.items() if f"{plan.blocks}.{k}" in held)
    block_list.__dict__["_modules"] = kept
    for name in (*plan.first, *plan.last):
        if name not in held:
            parent, _, child = name.rpartition(".")
            owner = module.get_submodule(parent) if parent else module
            setattr(owner, child, Elsewhere(owner.get_submodule(child), name))
    return parts


def _enter(
    activations: tuple[torch.Tensor, ...], block: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The first block of a stage takes the received activation as its first input."""
    (x,) = activations
    if args:
        return (x, *args[1:]), kwargs
    first = next((k for k, v in kwargs.items() if torch.is_tensor(v)), None)
    if first is None:
        raise TypeError(f"{type(block).__name__} was called without a tensor input to replace by the activation")
    return args, {**kwargs, first: x}


def _leave(block: nn.Module, args: Any, output: Any) -> None:
    """The last block of a stage ends the stage's forward with its output (the residual stream)."""
    value = output[0] if isinstance(output, (tuple, list)) else output
    if not torch.is_tensor(value):
        raise TypeError(f"{type(block).__name__} returned {type(output).__name__}; a stage boundary needs a tensor")
    raise StageOutput(value)


def _to_meta(value: Any) -> Any:
    if torch.is_tensor(value):
        return value.to("meta")
    if isinstance(value, (tuple, list)):
        return type(value)(_to_meta(v) for v in value)
    if isinstance(value, dict):
        return {k: _to_meta(v) for k, v in value.items()}
    return value
