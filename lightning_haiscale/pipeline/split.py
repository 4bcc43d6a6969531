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
before the blocks (embeddings) to the first stage, the ones after them (final norm, head) to the last, the
ones between two block lists cut as one sequence (an encoder's final norm) to the stage that runs them (see
[Note: one sequence of blocks] in ``pipeline.trace``). Which
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

from torch import nn

from lightning_haiscale.pipeline.balance import balanced_counts
from lightning_haiscale.pipeline.ties import Tie, find_ties
from lightning_haiscale.pipeline.trace import Trace, trace_call

__all__ = ["SplitPlan", "call_order", "find_blocks", "plan_split", "trace_module"]


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
    lists: tuple[str, ...] = ()  # every block list cut, in call order (see ``pipeline.trace``); () = (blocks,)
    placed: tuple[tuple[str, int], ...] = ()  # modules run between two lists, with the stage running them

    @property
    def num_stages(self) -> int:
        return len(self.stage_blocks)

    @property
    def block_lists(self) -> tuple[str, ...]:
        return self.lists or (self.blocks,)

    def held_modules(self, stage: int) -> list[str]:
        """The names of the modules stage ``stage`` holds (blocks as ``<list>.<key>``)."""
        held = [*self.stage_blocks[stage], *(u for u, s in self.placed if s == stage)]
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
    """The modules outside the blocks (and the parameters beside them) that one call runs before the first block
    of ``blocks`` (see ``trace_module``)."""
    trace = trace_module(module, blocks, args, kwargs)
    units, params = _outside_units(module, trace.lists)
    return {u for u in [*units, *params] if u not in trace.lists and _position(u, trace.position) == 0}


def trace_module(module: nn.Module, blocks: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Trace:
    """The block lists one call ``module(*args, **kwargs)`` runs in turn (``blocks`` among them) and where the
    other modules run among them (see [Note: one sequence of blocks] in ``pipeline.trace``).

    Runs the module once without gradients (on a microbatch: every rank, the same call), so every rank
    refuses alike a module with parameters that runs between the blocks of a list (no stage could run it).
    """
    _, params = _outside_units(module, [blocks])
    trace, calls = trace_call(module, blocks, params, args, kwargs)
    units, _ = _outside_units(module, trace.lists)
    weighted = {u for u in units if u not in trace.lists and any(True for _ in module.get_submodule(u).parameters())}
    between = set()
    for name, inside, _ in calls:
        if inside is None or inside[1] == len(module.get_submodule(inside[0])) - 1:
            continue
        between.update(u for u in weighted if name == u or name.startswith(u + "."))
    if between:
        raise ValueError(
            f"{type(module).__name__}: {sorted(between)} run between the blocks of {blocks!r} (after the first, "
            "before the last), and a pipeline stage runs a module outside the blocks only before all of them "
            "(first stage) or after all of them (last stage); make them part of the blocks, name another block "
            "list with split_points=, or train this model with hai_ddp or hai_fsdp"
        )
    return trace


def plan_split(
    module: nn.Module,
    num_stages: int,
    *,
    blocks: str | None = None,
    split_points: Sequence[str] | None = None,
    balance: Sequence[int] | None = None,
    before: set[str] | None = None,
    trace: Trace | None = None,
) -> SplitPlan:
    """The plan for ``num_stages`` stages of ``module`` (every rank computes the same one).

    Args:
        blocks: the name of the block list (default: named by ``split_points``, else ``find_blocks``).
        split_points: names of the blocks that begin stages 1, 2, ... (``"transformer.h.6"``), as
            ``torch.distributed.pipelining``'s ``SplitPoint.BEGINNING``.
        balance: blocks per stage; default: balanced by parameter count.
        before: the modules outside the blocks that run before them (``call_order``); default: those
            registered before the blocks.
        trace: one traced call (``trace_module``): the block lists cut as one sequence and where the other
            modules run; it replaces ``before``.
    """
    if split_points is not None:
        blocks = _split_points_list(split_points, blocks)
    blocks = blocks if blocks is not None else find_blocks(module)
    lists = trace.lists if trace is not None else [blocks]
    sequence = [f"{name}.{k}" for name in lists for k in _block_keys(module, name, split_points)]
    if split_points is not None:
        counts = _counts_from_split_points(sequence, num_stages, split_points)
    else:
        counts = _counts([module.get_submodule(n) for n in sequence], num_stages, balance)
    bounds = [sum(counts[:i]) for i in range(num_stages + 1)]
    stage_blocks = tuple(tuple(sequence[bounds[s] : bounds[s + 1]]) for s in range(num_stages))
    units, params = _outside_units(module, lists)
    if trace is not None:
        position = trace.position
    else:
        if before is None:
            before = set(units[: units.index(blocks)]) | set(params)
        position = {u: 0 if u in before else len(sequence) for u in [*units, *params]}
    held = [u for u in units if u not in lists and any(True for _ in module.get_submodule(u).parameters())]
    at = {u: _position(u, position) for u in [*held, *params]}
    inner = {u for u in held if at[u] not in (0, len(sequence), None)}  # between two lists
    return SplitPlan(
        blocks=blocks,
        stage_blocks=stage_blocks,
        first=tuple(u for u in held if at[u] == 0),
        last=tuple(u for u in held if u not in inner and at[u] != 0),
        first_params=tuple(p for p in params if at[p] in (0, None)),
        last_params=tuple(p for p in params if at[p] not in (0, None)),
        lists=tuple(lists) if len(lists) > 1 else (),
        placed=tuple((u, _stage_at(at[u], bounds)) for u in held if u in inner),
    )


def _position(name: str, position: dict[str, int]) -> int | None:
    """Blocks run before the first call of ``name`` or of a module inside it; ``None``: never called."""
    found = [p for n, p in position.items() if n == name or n.startswith(name + ".")]
    return min(found) if found else None


def _stage_at(position: int, bounds: list[int]) -> int:
    """The stage that runs what comes after ``position`` blocks: the one holding the block before it."""
    return next(s for s in range(len(bounds) - 1) if bounds[s] < position <= bounds[s + 1])


def _block_keys(module: nn.Module, name: str, split_points: Sequence[str] | None) -> list[str]:
    try:
        return list(module.get_submodule(name)._modules)
    except AttributeError as error:
        raise ValueError(f"split_points={list(split_points or ())}: {type(module).__name__} has no {name!r}") from error


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


def _split_points_list(split_points: Sequence[str], blocks: str | None) -> str:
    """The block list of the first split point (the main list)."""
    if isinstance(split_points, str) or not split_points:
        raise ValueError(f"split_points={split_points!r} must name blocks (one per stage after the first), "
                         "such as ['transformer.h.6']")  # fmt: skip
    parent = split_points[0].rpartition(".")[0]
    if blocks is not None and parent != blocks:
        raise ValueError(f"split_points={list(split_points)} must all be blocks of one ModuleList, e.g. 'h.2', 'h.4'")
    return parent


def _counts_from_split_points(sequence: list[str], num_stages: int, split_points: Sequence[str]) -> list[int]:
    if len(split_points) != num_stages - 1:
        raise ValueError(
            f"split_points={split_points!r} must name {num_stages - 1} blocks (one per stage after the first), "
            "such as ['transformer.h.6']"
        )
    lists = list(dict.fromkeys(n.rpartition(".")[0] for n in sequence))
    starts = []
    for point in split_points:
        parent = point.rpartition(".")[0]
        if parent not in lists:
            raise ValueError(f"split_points={list(split_points)} must all be blocks of one ModuleList, e.g. 'h.2', "
                             f"'h.4' (or of the block lists the model runs in turn: {lists})")  # fmt: skip
        if point not in sequence:
            keys = [n.rpartition(".")[2] for n in sequence if n.rpartition(".")[0] == parent]
            raise ValueError(f"split point {point!r} is not a block of {parent!r} (its blocks: {keys[0]}..{keys[-1]})")
        starts.append(sequence.index(point))
    if starts != sorted(set(starts)) or starts[0] == 0:
        raise ValueError(
            f"split_points={list(split_points)} must be increasing blocks after the first, each beginning a stage"
        )
    bounds = [0, *starts, len(sequence)]
    return [bounds[i + 1] - bounds[i] for i in range(num_stages)]


def _outside_units(module: nn.Module, lists: Sequence[str]) -> tuple[list[str], list[str]]:
    """The largest submodules that neither contain nor lie inside the block lists, in registration order, with
    the lists themselves in their place; and the parameters of the modules containing them (see the note)."""
    params: list[str] = []

    def expand(node: nn.Module, prefix: str) -> list[str]:
        params.extend(f"{prefix}{n}" for n, _ in node.named_parameters(recurse=False))
        units = []
        for name, child in node.named_children():
            full = prefix + name
            inside = any(b.startswith(full + ".") for b in lists)
            units.extend(expand(child, full + ".") if inside else [full])
        return units

    return expand(module, ""), params
