"""A stage of a split module: the user's module, run by its own ``forward``, holding only this stage's part.

[Note: a stage runs the whole forward] ``ModuleStage.forward(*activations, call=(args, kwargs))`` calls the
user's module's own ``forward`` with the microbatch's ``args`` and ``kwargs`` (the call the step made), so
masks, position ids and the loss from ``labels=`` are computed as written. During that call the block list
holds only this stage's blocks, then a stand-in of the next stage's first block: a forward pre-hook on it
ends the call there (``StageOutput``) with every tensor of that block's call, which is what the stage sends
(see [Note: the boundary is the next block's call] in ``pipeline.boundary``); a pre-hook on this stage's first
block puts the received tensors into its call. The last stage returns what the module returns (e.g. a
``CausalLMOutput`` with its ``loss``). What another stage holds is a stand-in (``pipeline.stand_in``).

[Note: carried values] The modules that run before the blocks (``plan.first``) run for real on the first
stage only. What they compute without gradients (ViTMAE's random mask and the indices restoring the patch
order, which its loss on the last stage reads) is carried along every boundary message: the first stage
records those outputs, every later stage puts them, in order, in the output of the same module (a stand-in's
zeros, or a module of an interleaved chunk's rank that would draw another random mask) and sends them on.
Outputs that need gradients are not carried: they feed the blocks, whose inputs are received anyway.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from lightning_haiscale.pipeline.boundary import Received, call_tensors, describe, place, swapped
from lightning_haiscale.pipeline.split import SplitPlan
from lightning_haiscale.pipeline.stand_in import stand_in
from lightning_haiscale.pipeline.ties import Tie

__all__ = ["ModuleStage", "StageOutput", "split_module"]


class StageOutput(Exception):
    """Ends a stage's forward at the next stage's first block, carrying that block's call's tensors."""

    def __init__(self, paths: list[list[Any]], tensors: list[torch.Tensor]) -> None:
        super().__init__("pipeline stage output")
        self.paths, self.tensors = paths, tensors


@dataclass
class _Run:
    """One forward of a stage: what it received, what it carries on, whether its blocks began."""

    received: Received | None
    carried: list[torch.Tensor] = field(default_factory=list)
    in_blocks: bool = False
    swap: dict[int, tuple[torch.Tensor, Any]] = field(default_factory=dict)


class ModuleStage(nn.Module):
    """Stage ``stage`` of ``plan`` over ``module``; its parameters are those of the modules it holds.

    ``ties`` are every tied parameter of the whole pipeline (see ``pipeline.ties``), the same on every rank.
    """

    def __init__(self, module: nn.Module, plan: SplitPlan, stage: int, ties: Sequence[Tie] = ()) -> None:
        super().__init__()
        self.__dict__["network"] = module  # not a child: the stage's parameters are its own modules'
        self.held = nn.ModuleDict({n.replace(".", "/"): module.get_submodule(n) for n in plan.held_modules(stage)})
        self.held_params = nn.ParameterDict(
            {n.replace(".", "/"): module.get_parameter(n) for n in plan.held_params(stage)}
        )
        self.stage, self.num_stages, self.lists = stage, plan.num_stages, plan.block_lists
        self.first = plan.first
        own: dict[str, OrderedDict[str, nn.Module]] = {name: OrderedDict() for name in self.lists}
        for block in plan.stage_blocks[stage]:
            name, _, key = block.rpartition(".")
            own[name][key] = module.get_submodule(name)._modules[key]
        self.__dict__["own_blocks"] = own
        self.__dict__["boundary"] = None  # a stand-in of the next stage's first block, where the call ends
        if stage < plan.num_stages - 1:
            block = plan.stage_blocks[stage + 1][0]
            self.boundary_at = block.rpartition(".")[::2]  # (list, key)
            self.__dict__["boundary"] = stand_in(module.get_submodule(block), block)
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
        run = _Run(Received(activations, self.stage) if self.stage > 0 else None)
        block_lists = {name: self.network.get_submodule(name) for name in self.lists}
        at_rest = {name: block_list._modules for name, block_list in block_lists.items()}
        running = {name: OrderedDict(blocks) for name, blocks in self.own_blocks.items()}
        enter = partial(_enter, run)
        handles = [b.register_forward_pre_hook(enter, with_kwargs=True) for r in running.values() for b in r.values()]
        for name in self.first:
            handles.append(self.network.get_submodule(name).register_forward_hook(partial(_carry, run, name)))
        if self.boundary is not None:
            name, key = self.boundary_at
            running[name][key] = self.boundary
            leave = partial(_leave, run)
            handles.append(self.boundary.register_forward_pre_hook(leave, with_kwargs=True, prepend=True))
        for name, block_list in block_lists.items():
            block_list.__dict__["_modules"] = running[name]
        try:
            return type(self.network).forward(self.network, *args, **kwargs)  # the class's: see the step's stand-in
        except StageOutput as out:
            device = out.tensors[0].device if out.tensors else _device(self)
            return (describe(len(run.carried), out.paths, device), *run.carried, *out.tensors)
        finally:
            for name, block_list in block_lists.items():
                block_list.__dict__["_modules"] = at_rest[name]
            for handle in handles:
                handle.remove()


def split_module(module: nn.Module, plan: SplitPlan, stages: Sequence[int]) -> list[ModuleStage]:
    """This rank's ``stages`` of ``module``; afterwards ``module`` holds only what they hold.

    The ties are found before the cut (every rank holds the whole module then). Blocks of other stages leave
    the block list; modules of other stages outside it become stand-ins (see ``pipeline.stand_in``).
    """
    ties = plan.ties(module)
    parts = [ModuleStage(module, plan, s, ties) for s in stages]
    held = {name for s in stages for name in plan.held_modules(s)}
    for list_name in plan.block_lists:
        block_list = module.get_submodule(list_name)
        kept = OrderedDict((k, b) for k, b in block_list._modules.items() if f"{list_name}.{k}" in held)
        block_list.__dict__["_modules"] = kept
    for name in (*plan.first, *plan.last, *(u for u, _ in plan.placed)):
        if name not in held:
            parent, _, child = name.rpartition(".")
            owner = module.get_submodule(parent) if parent else module
            setattr(owner, child, stand_in(owner.get_submodule(child), name))
    held_params = {name for s in stages for name in plan.held_params(s)}
    for name in (*plan.first_params, *plan.last_params):
        if name not in held_params:  # see [Note: parameters beside the blocks] in ``pipeline.split``
            parent, _, child = name.rpartition(".")
            owner = module.get_submodule(parent) if parent else module
            zeros = torch.zeros_like(owner.get_parameter(child), requires_grad=False)
            delattr(owner, child)
            owner.register_buffer(child, zeros, persistent=False)
    return parts


def _enter(
    run: _Run, block: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """The stage's first block: its call takes the received tensors; the modules before it are done. Later
    blocks: the values computed before the blocks are the received ones (see ``boundary.place``)."""
    if run.in_blocks:
        return swapped(run.swap, args, kwargs) if run.swap else None
    run.in_blocks = True
    if run.received is None:
        return None
    left = len(run.received.carried) - run.received.taken
    if left:
        raise RuntimeError(
            f"stage {run.received.stage} received {left} carried values that no module before its first block took; "
            "every stage must run the modules before the blocks alike"
        )
    run.carried = list(run.received.carried)
    return place(run.received, args, kwargs, run.swap)


def _carry(run: _Run, name: str, module: nn.Module, args: Any, output: Any) -> Any:
    """A module before the blocks: the first stage records what it computed without gradients, later stages
    put the carried values there (see [Note: carried values])."""
    if run.in_blocks:
        return None
    leaves, spec = tree_flatten(output)
    slots = [i for i, leaf in enumerate(leaves) if torch.is_tensor(leaf) and not leaf.requires_grad]
    if run.received is None:
        run.carried.extend(leaves[i].detach() for i in slots)
        return None
    for i, value in zip(slots, run.received.take_carried(len(slots), name), strict=True):
        leaves[i] = value
    return tree_unflatten(leaves, spec)


def _leave(run: _Run, block: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """The next stage's first block: the stage's forward ends with every tensor of its call (with the values
    computed before the blocks as received, see ``boundary.place``)."""
    if run.swap:
        args, kwargs = swapped(run.swap, args, kwargs)
    raise StageOutput(*call_tensors(args, kwargs))


def _device(stage: nn.Module) -> torch.device:
    return next((p.device for p in stage.parameters()), torch.device("cpu"))
