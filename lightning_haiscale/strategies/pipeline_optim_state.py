"""A pipeline's optimizer states as one optimizer over the unpartitioned module would hold them: what the full
checkpoint file carries, so that it resumes under any strategy (``hai_fsdp``, ``hai_ddp``, one device, another
pipeline size).

[Note: the whole model's optimizer state] Each stage's optimizer holds its own parameters, numbered from 0 by
torch. One optimizer built by the same ``configure_optimizers`` over the whole module holds, in each parameter
group, the group's parameters in the module's order, numbered group after group (``optimizer.state_dict()``'s
layout, which Lightning's ``ddp`` and FSDP full checkpoints use). The stages' states are merged into that
layout: the module's order is the stages' order (global stage ``s`` is chunk ``s // pp_size`` of rank
``s % pp_size``), each stage's parameters in its own order; a parameter tied between stages counts once, at its
first stage (``module.parameters()`` lists it once, at its first use); a parameter outside every stage comes
last. The names of the parameters, in the same layout, travel beside the states so that a pipeline of another
size takes them by name.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from torch import nn

from lightning_haiscale.pipeline.pipelines import recorded_ties

__all__ = ["first_names", "merge_stage_states", "stage_order", "tie_aliases"]


def first_names(module: nn.Module) -> dict[int, str]:
    """id(parameter) -> its first name in ``module`` (the name ``module.named_parameters()`` gives it)."""
    names: dict[int, str] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), name)
    return names


def stage_order(stages: Sequence[nn.Module], module: nn.Module, pp_rank: int, pp_size: int) -> dict[str, Any]:
    """This rank's part of the module's parameter order: per chunk, its global stage and its parameters' names;
    the names of the tied copies that count at another stage, and per tie held here ``(tie, stage, name)`` (see
    [Note: the whole model's optimizer state])."""
    names = first_names(module)
    ties, local = recorded_ties(stages)
    chunks, copies, tied = [], [], []
    for i, stage in enumerate(stages):
        index = i * pp_size + pp_rank
        later = {id(local[t]) for t in ties if t in local and index in t.stages and t.stages[0] != index}
        params = [p for p in stage.parameters() if id(p) in names]
        chunks.append((index, [names[id(p)] for p in params if id(p) not in later]))
        copies += [names[id(p)] for p in params if id(p) in later]
        tied += [(k, index, names[id(local[t])]) for k, t in enumerate(ties) if t in local and index in t.stages]
    return {"chunks": chunks, "copies": copies, "tied": tied}


def tie_aliases(orders: Sequence[Mapping[str, Any]]) -> dict[str, str]:
    """Each tied copy's name -> the name of the parameter it copies (held by the tie's first stage), from every
    rank's ``stage_order``: a copy's optimizer state is its first holder's."""
    holders: dict[int, list[tuple[int, str]]] = {}
    for order in orders:
        for tie, stage, name in order.get("tied", []):
            holders.setdefault(tie, []).append((stage, name))
    aliases = {}
    for held in holders.values():
        first = min(held)[1]
        aliases.update((name, first) for _, name in held if name != first)
    return aliases


def merge_stage_states(
    orders: Sequence[Mapping[str, Any]],
    param_names: Sequence[Sequence[Sequence[Sequence[str]]]],
    states: Sequence[Sequence[Mapping[str, Any]]],
) -> tuple[list[dict[str, Any]], list[list[list[str]]]]:
    """The stages' optimizer states (``states[rank][optimizer]``, torch's layout, their parameters named by
    ``param_names[rank][optimizer][group]``) as the whole module's optimizers hold them, and those names per
    optimizer, per group (see [Note: the whole model's optimizer state])."""
    position: dict[str, int] = {}
    for _, chunk in sorted(c for order in orders for c in order["chunks"]):
        for name in chunk:
            position.setdefault(name, len(position))
    copies = {name for order in orders for name in order["copies"]}
    merged, merged_names = [], []
    for o in range(min((len(s) for s in states), default=0)):
        hyper: list[dict[str, Any]] = []
        groups: list[dict[str, Any]] = []
        for rank_states, rank_names in zip(states, param_names, strict=True):
            state = rank_states[o]
            for g, (group, names) in enumerate(zip(state["param_groups"], rank_names[o], strict=True)):
                if g == len(groups):
                    hyper.append({k: v for k, v in group.items() if k != "params"})
                    groups.append({})
                for index, name in zip(group["params"], names, strict=True):
                    if name not in copies:
                        position.setdefault(name, len(position))
                        groups[g][name] = state["state"].get(index)
        names_per_group = [sorted(group, key=position.__getitem__) for group in groups]
        flat = [name for names in names_per_group for name in names]
        values = [groups[g][name] for g, names in enumerate(names_per_group) for name in names]
        ids = iter(range(len(flat)))
        param_groups = [{**hyper[g], "params": [next(ids) for _ in names]} for g, names in enumerate(names_per_group)]
        state = {i: value for i, value in enumerate(values) if value is not None}
        merged.append({"state": state, "param_groups": param_groups})
        merged_names.append(names_per_group)
    return merged, merged_names
