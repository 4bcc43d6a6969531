"""Parameters shared by two pipeline stages (a tied input embedding and output head): found by identity.

[Note: finding ties] Every rank builds the whole model before it is cut, so every rank can compute the
whole assignment of parameters to stages, and find the parameters that two stages hold: the same
``nn.Parameter`` object reached from two stages' modules. Found this way, every rank sees the same ties
before any step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

__all__ = ["Tie", "find_ties", "refuse_ties"]


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
    return [
        Tie(tuple(s for s, _ in held), tuple(n for _, n in held)) for held in owners.values() if len(held) > 1
    ]


def refuse_ties(ties: Sequence[Tie], ranks: int) -> None:
    """Raises when a parameter is held by stages on different ranks: each would train its own copy."""
    split = [t for t in ties if len({s % ranks for s in t.stages}) > 1]
    if split:
        raise ValueError(
            f"{len(split)} parameter(s) are shared by pipeline stages on different ranks: "
            + "; ".join(t.describe() for t in split)
            + ". Each stage would update its own copy and the copies would drift apart silently. Untie them "
            "(e.g. tie_weights=False), or keep every user of the parameter in one stage (balance= or split_points=)"
        )
