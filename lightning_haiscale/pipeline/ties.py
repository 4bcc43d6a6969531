"""Parameters shared by two pipeline stages (a tied input embedding and output head): found by identity.

[Note: finding ties] Every rank builds the whole model before it is cut, so every rank can compute the
whole assignment of parameters to stages, and find the parameters that two stages hold: the same
``nn.Parameter`` object reached from two stages' modules. Found this way, every rank sees the same ties
before any step.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from lightning_haiscale.hfreduce import kept_collectives

__all__ = ["Tie", "TiedParameters", "find_ties", "ties_within_a_rank"]


@dataclass(frozen=True)
class Tie:
    """One parameter held by several stages: ``names[i]`` is its name in stage ``stages[i]``'s module."""

    stages: tuple[int, ...]
    names: tuple[str, ...]

    def describe(self) -> str:
        return " = ".join(f"{name!r} (stage {stage})" for stage, name in zip(self.stages, self.names, strict=True))


def find_ties(stages: Sequence[nn.Module], prefix: str = "") -> list[Tie]:
    """The parameters that more than one of ``stages`` (every stage of the pipeline, in order) holds."""
    owners: dict[int, list[tuple[int, str]]] = {}
    for index, stage in enumerate(stages):
        for name, param in stage.named_parameters(remove_duplicate=False):
            held = owners.setdefault(id(param), [])
            if all(s != index for s, _ in held):
                held.append((index, prefix + name))
    return [Tie(tuple(s for s, _ in held), tuple(n for _, n in held)) for held in owners.values() if len(held) > 1]


def ties_within_a_rank(ties: Sequence[Tie], ranks: int) -> list[Tie]:
    """The ties two of whose stages run on one rank of a pipeline of ``ranks`` ranks (interleaved chunks)."""
    return [t for t in ties if len({s % ranks for s in t.stages}) < len(t.stages)]


class TiedParameters:
    """Keeps each tied parameter's copies equal on the stages that hold them (DeepSpeed's ``TiedLayerSpec``,
    Megatron's embedding group): the first holder broadcasts it at the start, and every step sums its
    gradients over a process group of the holders' ranks (one group per data-parallel pipeline).

    Args:
        ties: every tie of the pipeline (the same list on every rank).
        local: this rank's copy of each tie it holds.
        group: the pipeline's process group (stage ``s`` on its rank ``s % size``); ``None``: the world.

    Collective over the world when a tie spans two ranks: every rank of every pipeline builds its pipeline.
    """

    def __init__(
        self, ties: Sequence[Tie], local: Mapping[Tie, nn.Parameter], group: dist.ProcessGroup | None = None
    ) -> None:
        self.ties = list(ties)
        self.local = dict(local)
        self.groups: dict[Tie, tuple[dist.ProcessGroup, int]] = {}
        self._duplicates: set[int] = set()
        initialized = dist.is_available() and dist.is_initialized()
        ranks = dist.get_world_size(group) if initialized else 1
        spanning = [t for t in self.ties if len({s % ranks for s in t.stages}) > 1]
        if not spanning:
            return
        group = group if group is not None else dist.group.WORLD
        me = dist.get_rank(group)
        signature = [(t.stages, t.names) for t in self.ties]
        pipelines = kept_collectives.all_gather_object((dist.get_process_group_ranks(group), signature))
        if any(sig != signature for _, sig in pipelines):
            raise ValueError(
                "the ranks disagree on the tied parameters of the pipeline (each rank must build the same model): "
                + "; ".join(f"rank {r}: {sig}" for r, (_, sig) in enumerate(pipelines))
            )
        mine = dist.get_process_group_ranks(group)
        for pipeline in sorted({tuple(p) for p, _ in pipelines}):
            for tie in spanning:
                holders = sorted({s % ranks for s in tie.stages})
                new = dist.new_group([pipeline[h] for h in holders])
                if list(pipeline) == mine and me in holders:
                    self.groups[tie] = (new, pipeline[tie.stages[0] % ranks])
                    if me != tie.stages[0] % ranks:
                        self._duplicates.add(id(self.local[tie]))

    def is_duplicate(self, param: nn.Parameter) -> bool:
        """True for this rank's copy of a tied parameter that a stage on another rank counts."""
        return id(param) in self._duplicates

    @torch.no_grad()
    def broadcast_(self) -> None:
        """Every copy takes the first holder's value."""
        for tie, (group, src) in self.groups.items():
            kept_collectives.broadcast(self.local[tie].data, src, group)

    @torch.no_grad()
    def reduce_gradients_(self) -> None:
        """Every copy's gradient becomes the sum of the copies' gradients (each stage's use of it)."""
        for tie, (group, _) in self.groups.items():
            param = self.local[tie]
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            kept_collectives.all_reduce(param.grad, group=group)
