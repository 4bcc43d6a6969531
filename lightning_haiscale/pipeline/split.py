"""Cutting any module into pipeline stages at block boundaries: by module names, or along its blocks.

[Note: splitting a module that is not a Sequential] A transformer keeps its blocks in one ``ModuleList`` (HF
``transformer.h`` / ``model.layers``, litgpt ``transformer.h``) and its ``forward`` does more than call them
in turn: keyword arguments, masks, position ids and the loss from ``labels=``. Tracing that forward into a
graph (``torch.export``, as ``torch.distributed.pipelining`` does) fails on much of it (data-dependent mask
checks, caches, Python control flow). So the module is not traced: every stage keeps the user's module and
runs its own ``forward`` as written, with the blocks list holding only that stage's blocks (see
``pipeline.module_stage``). A stage boundary is a boundary between two blocks of the list: what crosses it
is every tensor the next block takes (see ``pipeline.boundary``).

A plan says which blocks each stage runs and where the other modules with parameters go: the ones that run
before the blocks (embeddings) to the first stage, the ones after them (final norm, head) to the last. Which
runs before is taken from one traced call when there is an example (``call_order``), else from the order of
registration; modules without parameters (dropout, rotary embeddings) run on every stage.

[Note: parameters beside the blocks] timm's ``VisionTransformer`` holds ``cls_token`` and ``pos_embed``
itself, beside its ``blocks``, and its own code uses them before the blocks. Such a parameter goes to the
stage that runs the code using it: the first when the traced call uses it before the first block, else the
last (without a traced call: the first). Other stages keep a zero, non-persistent buffer of its name, shape
and dtype (it follows ``.to``, is in no optimizer or state dict), so the module's code runs unchanged there.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from lightning_haiscale.pipeline.balance import balanced_counts
from lightning_haiscale.pipeline.ties import Tie, find_ties

__all__ = ["SplitPlan", "call_order", "find_blocks", "plan_split"]


@dataclass(frozen=True)
class SplitPlan:
    """How a module is cut: ``stage_blocks[s]`` are the keys of stage ``s``'s blocks in the list ``blocks``;
    ``first`` and ``last`` the modules with parameters outside the blocks held by the first and last stage."""

    blocks: str
    stage_blocks: tuple[tuple[str, ...], ...]
    first: tuple[str, ...]
    last: tuple[str, ...]
    first_params: tuple[str, ...] = ()  # parameters of a module containing the blocks: see the note
    last_params: tuple[str, ...] = ()

    @property
    def num_stages(self) -> int:
        return len(self.stage_blocks)

    def held_modules(self, stage: int) -> list[str]:
        """The names of the modules stage ``stage`` holds (blocks as ``<blocks>.<key>``)."""
        held = [f"{self.blocks}.{k}" for k in self.stage_blocks[stage]]
        if stage == 0:
            held = [*self.first, *held]
        if stage == self.num_stages - 1:
            held = [*held, *self.last]
        return held

    def held_params(self, stage: int) -> list[str]:
        """The names of the parameters beside the blocks that stage ``stage`` holds."""
        return [*(self.first_params if stage == 0 else ()), *(self.last_params if stage == self.num_stages - 1 else ())]

    def ties(self, module: nn.Module) -> list[Tie]:
        """The parameters several stages hold (a tied embedding and head), by identity."""
        stages = [nn.ModuleDict({n.replace(".", "/"): module.get_submodule(n) for n in self.held_modules(s)})
                  for s in range(self.num_stages)]  # fmt: skip
        for s, stage in enumerate(stages):
            params = {n.replace(".", "/"): module.get_parameter(n) for n in self.held_params(s)}
            stage.add_module("/", nn.ParameterDict(params))
        return [
            Tie(tie.stages, tuple(name.removeprefix("/.").replace("/", ".") for name in tie.names))
            for tie in find_ties(stages)
        ]


def find_blocks(module: nn.Module) -> str:
    """The name of ``module``'s largest ``ModuleList`` or ``Sequential`` of two or more same-class blocks."""
    best, best_size = None, 0
    for name, child in module.named_modules():
        if not isinstance(child, (nn.ModuleList, nn.Sequential)) or len(child) < 2:
            continue
        if len({type(block) for block in child}) != 1:
            continue
        size = sum(p.numel() for p in child.parameters())
        if size > best_size:
            best, best_size = name, size
    if best is None:
        raise ValueError(
            f"{type(module).__name__} has no ModuleList or Sequential of two or more blocks of one class with "
            "parameters to cut into pipeline stages; name the cuts with split_points=['<blocks>.<index>', ...]"
        )
    return best


def call_order(module: nn.Module, blocks: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> set[str]:
    """The modules outside the blocks that one call ``module(*args, **kwargs)`` runs before the first block,
    and the parameters beside the blocks it uses before then.

    Runs the module once without gradients (on a microbatch: every rank, the same call), so every rank
    refuses alike a module with parameters that runs between the blocks (no stage could run it there).
    """
    units, params = _outside_units(module, blocks)
    before: set[str] = set()
    between: set[str] = set()
    state = {"in_blocks": False, "done": False}
    handles = [module.get_submodule(blocks).register_forward_pre_hook(lambda m, a: state.update(in_blocks=True))]
    for name in (u for u in units if u != blocks):
        def seen(m: nn.Module, a: Any, name: str = name) -> None:
            if not state["in_blocks"]:
                before.add(name)
            elif not state["done"]:
                between.add(name)
        for sub in module.get_submodule(name).modules():  # a model may call a unit's submodule directly
            handles.append(sub.register_forward_pre_hook(seen))
    block_list = list(module.get_submodule(blocks))  # a ModuleList is never called itself: hook its blocks
    handles.append(block_list[0].register_forward_pre_hook(lambda m, a: state.update(in_blocks=True)))
    handles.append(block_list[-1].register_forward_hook(lambda m, a, o: state.update(done=True)))
    used = {id(module.get_parameter(n)): n for n in params}
    try:
        with torch.no_grad(), _UsedBefore(used, state, before):
            module(*args, **kwargs)
    finally:
        for handle in handles:
            handle.remove()
    between = {u for u in between if any(True for _ in module.get_submodule(u).parameters())}
    if between:
        raise ValueError(
            f"{type(module).__name__}: {sorted(between)} run between the blocks of {blocks!r} (after the first, "
            "before the last), and a pipeline stage runs a module outside the blocks only before all of them "
            "(first stage) or after all of them (last stage); make them part of the blocks, name another block "
            "list with split_points=, or train this model with hai_ddp or hai_fsdp"
        )
    return before


def plan_split(
    module: nn.Module,
    num_stages: int,
    *,
    blocks: str | None = None,
    split_points: Sequence[str] | None = None,
    balance: Sequence[int] | None = None,
    before: set[str] | None = None,
) -> SplitPlan:
    """The plan for ``num_stages`` stages of ``module`` (every rank computes the same one).

    Args:
        blocks: the name of the block list (default: named by ``split_points``, else ``find_blocks``).
        split_points: names of the blocks that begin stages 1, 2, ... (``"transformer.h.6"``), as
            ``torch.distributed.pipelining``'s ``SplitPoint.BEGINNING``.
        balance: blocks per stage; default: balanced by parameter count.
        before: the modules outside the blocks that run before them (``call_order``); default: those
            registered before the blocks.
    """
    if split_points is not None:
        blocks, counts = _counts_from_split_points(module, num_stages, split_points, blocks)
    else:
        blocks = blocks if blocks is not None else find_blocks(module)
        counts = _counts(module.get_submodule(blocks), num_stages, balance)
    keys = list(module.get_submodule(blocks)._modules)
    bounds = [sum(counts[:i]) for i in range(num_stages + 1)]
    stage_blocks = tuple(tuple(keys[bounds[s] : bounds[s + 1]]) for s in range(num_stages))
    units, params = _outside_units(module, blocks)
    if before is None:
        before = set(units[: units.index(blocks)]) | set(params)
    held = [u for u in units if u != blocks and any(True for _ in module.get_submodule(u).parameters())]
    return SplitPlan(
        blocks=blocks,
        stage_blocks=stage_blocks,
        first=tuple(u for u in held if u in before),
        last=tuple(u for u in held if u not in before),
        first_params=tuple(p for p in params if p in before),
        last_params=tuple(p for p in params if p not in before),
    )


class _UsedBefore(TorchFunctionMode):
    """Records the parameters in ``used`` (by id) that an operation takes before the blocks begin."""

    def __init__(self, used: dict[int, str], state: dict[str, bool], before: set[str]) -> None:
        super().__init__()
        self.used, self.state, self.before = used, state, before

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if self.used and not self.state["in_blocks"]:
            self.before.update(self.used[id(t)] for t in tree_leaves((args, kwargs)) if id(t) in self.used)
        return func(*args, **kwargs)


def _counts(block_list: nn.Module, num_stages: int, balance: Sequence[int] | None) -> list[int]:
    n = len(block_list)
    if n < num_stages:
        raise ValueError(f"the module has {n} blocks, fewer than the {num_stages} stages asked for; use fewer stages")
    if balance is None:
        return balanced_counts([sum(p.numel() for p in b.parameters()) + 1 for b in block_list], num_stages)
    counts = [int(c) for c in balance]
    if len(counts) != num_stages or sum(counts) != n or min(counts) < 1:
        raise ValueError(f"balance={list(balance)} must be {num_stages} positive block counts summing to {n}")
    return counts


def _counts_from_split_points(
    module: nn.Module, num_stages: int, split_points: Sequence[str], blocks: str | None
) -> tuple[str, list[int]]:
    if isinstance(split_points, str) or len(split_points) != num_stages - 1:
        raise ValueError(
            f"split_points={split_points!r} must name {num_stages - 1} blocks (one per stage after the first), "
            "such as ['transformer.h.6']"
        )
    parents = {point.rpartition(".")[0] for point in split_points}
    if len(parents) != 1 or (blocks is not None and parents != {blocks}):
        raise ValueError(f"split_points={list(split_points)} must all be blocks of one ModuleList, e.g. 'h.2', 'h.4'")
    blocks = parents.pop()
    try:
        keys = list(module.get_submodule(blocks)._modules)
    except AttributeError as error:
        raise ValueError(f"split_points={list(split_points)}: {type(module).__name__} has no {blocks!r}") from error
    starts = []
    for point in split_points:
        key = point.rpartition(".")[2]
        if key not in keys:
            raise ValueError(f"split point {point!r} is not a block of {blocks!r} (its blocks: {keys[0]}..{keys[-1]})")
        starts.append(keys.index(key))
    if starts != sorted(set(starts)) or starts[0] == 0:
        raise ValueError(
            f"split_points={list(split_points)} must be increasing blocks after the first, each beginning a stage"
        )
    bounds = [0, *starts, len(keys)]
    return blocks, [bounds[i + 1] - bounds[i] for i in range(num_stages)]


def _outside_units(module: nn.Module, blocks: str) -> tuple[list[str], list[str]]:
    """The largest submodules that neither contain nor lie inside the blocks, in registration order, with the
    blocks themselves in their place; and the parameters of the modules containing the blocks (see the note)."""
    params: list[str] = []

    def expand(node: nn.Module, prefix: str) -> list[str]:
        params.extend(f"{prefix}{n}" for n, _ in node.named_parameters(recurse=False))
        units = []
        for name, child in node.named_children():
            full = prefix + name
            units.extend(expand(child, full + ".") if blocks.startswith(full + ".") else [full])
        return units

    return expand(module, ""), params
