"""What crosses a stage boundary of a split module: every tensor the next block takes, and carried values.

[Note: the boundary is the next block's call] A block may take more than the residual stream: an attention
mask, rotary tables, a position bias that the first block computed once and the others reuse (T5), a
residual kept beside the hidden state (Mamba's ``(hidden, residual)``), an encoder's output that every
decoder block attends to. So a stage does not end after its last block: it runs on to the call of the next
stage's first block (a stand-in of it, see ``pipeline.stand_in``), and sends every tensor of that call's
arguments, found by their paths in ``(args, kwargs)``. The receiving stage runs its forward up to its first
block and puts each received tensor at its path in that call, whatever its own forward computed there (zeros
from stand-ins, or ``None`` where the tensor came from earlier blocks); so nobody names what travels.

The message is ``(description, *carried, *call tensors)``: the description is a ``uint8`` tensor of JSON (the
number of carried values and the paths), so every message says how it is laid out. Carried values are what
the modules before the blocks computed without gradients (see ``module_stage``).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import torch
from torch.utils._pytree import MappingKey, SequenceKey, tree_flatten_with_path, tree_map_only, tree_unflatten

__all__ = ["Received", "call_tensors", "describe", "place", "swapped"]

Path = tuple[Any, ...]


def _encode(path: Sequence[Any]) -> list[Any]:
    keys: list[Any] = []
    for entry in path:
        if isinstance(entry, SequenceKey):
            keys.append(entry.idx)
        elif isinstance(entry, MappingKey):
            keys.append(str(entry.key))
        else:
            raise TypeError(f"a block's input at {path} is inside a {type(entry).__name__}; pipelines carry "
                            "tensors inside tuples, lists and dicts")  # fmt: skip
    return keys


def call_tensors(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[list[list[Any]], list[torch.Tensor]]:
    """The paths and the tensors of a block call's arguments."""
    leaves, _ = tree_flatten_with_path((tuple(args), dict(kwargs)))
    found = [(_encode(path), leaf) for path, leaf in leaves if torch.is_tensor(leaf)]
    return [p for p, _ in found], [t for _, t in found]


def describe(carried: int, paths: list[list[Any]], device: torch.device) -> torch.Tensor:
    """The description tensor of a boundary message."""
    data = json.dumps({"carried": carried, "paths": paths}).encode()
    return torch.tensor(list(data), dtype=torch.uint8, device=device)


class Received:
    """A boundary message as received: the carried values (taken in order) and the next block's tensors."""

    def __init__(self, activations: Sequence[torch.Tensor], stage: int) -> None:
        if not activations or activations[0].dtype != torch.uint8:
            raise TypeError(f"stage {stage} of a split module received {len(activations)} tensors without the "
                            "boundary description; every stage of a split module must be a ModuleStage")  # fmt: skip
        info = json.loads(bytes(activations[0].cpu().tolist()).decode())
        n = info["carried"]
        self.stage = stage
        self.carried = list(activations[1 : 1 + n])
        self.paths: list[list[Any]] = info["paths"]
        self.tensors = list(activations[1 + n :])
        self.taken = 0

    def take_carried(self, count: int, module: str) -> list[torch.Tensor]:
        """The next ``count`` carried values, for ``module``'s output."""
        values = self.carried[self.taken : self.taken + count]
        if len(values) != count:
            raise RuntimeError(
                f"stage {self.stage}: {module} gives {count} values computed without gradients, but only "
                f"{len(self.carried) - self.taken} of the {len(self.carried)} carried from the previous stage are "
                "left; every stage must run the modules before the blocks alike (same requires_grad everywhere)"
            )
        self.taken += count
        return values


def place(
    received: Received, args: tuple[Any, ...], kwargs: dict[str, Any], swap: dict[int, tuple[torch.Tensor, Any]]
) -> tuple[tuple, dict[str, Any]]:
    """This stage's first block call with each received tensor at its path.

    ``swap`` gets, for each local tensor replaced, ``id(local) -> (received, local)``: a value computed once
    before the blocks (an encoder's output, a mask) is passed to every block of the loop, and
    ``swapped`` puts the received one in the calls of this stage's later blocks too.
    """
    leaves, spec = tree_flatten_with_path((tuple(args), dict(kwargs)))
    index = {json.dumps(_encode(path)): i for i, (path, _) in enumerate(leaves)}
    values = [leaf for _, leaf in leaves]
    missing: list[tuple[list[Any], torch.Tensor]] = []
    for path, tensor in zip(received.paths, received.tensors, strict=True):
        key = json.dumps(path)
        if key not in index:
            missing.append((path, tensor))
            continue
        local = values[index[key]]
        if torch.is_tensor(local):
            swap[id(local)] = (tensor, local)  # the local one is kept alive, so its id stays unique
        values[index[key]] = tensor
    args, kwargs = tree_unflatten(values, spec)
    args = list(args)
    for path, tensor in missing:
        if len(path) != 2:
            raise TypeError(
                f"stage {received.stage}'s first block takes no value at {path} of its (args, kwargs), where the "
                "previous stage's block call had a tensor; the block call must have the same structure on every stage"
            )
        if path[0] == 1:
            kwargs[path[1]] = tensor
        elif path[1] < len(args):
            args[path[1]] = tensor
        else:
            args.extend([None] * (path[1] - len(args)) + [tensor])
    return tuple(args), kwargs


def swapped(swap: dict[int, tuple[torch.Tensor, Any]], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """A later block's call with every local tensor that ``place`` replaced in the first block's call replaced."""
    return tree_map_only(torch.Tensor, lambda t: swap[id(t)][0] if id(t) in swap else t, (tuple(args), dict(kwargs)))
