"""One traced call of a module: which block lists it runs in turn, and where the other modules run among them.

[Note: one sequence of blocks] An encoder-decoder model (T5, BART, Whisper) runs two block lists in turn: the
encoder's, then the decoder's. The traced call (the first training microbatch, every rank alike) records every
module call; the block lists it runs whole, each block once and in order, one list after the other, are cut as
one sequence of stages (the main list, the largest or the one ``split_points`` name, always among them). Each
module outside the lists goes to the stage that runs it: its position is the number of blocks of that sequence
run before its first call (0: the first stage; all of them: the last; else the stage holding the block just
before it, e.g. the encoder's final norm with the encoder's last block). A module called by several names (T5's
shared embedding is also ``encoder.embed_tokens`` and ``decoder.embed_tokens``) is named by the module calling
it. A module with parameters that runs inside a list (between two of its blocks) cannot be placed: refused.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

__all__ = ["Trace", "block_lists", "trace_call"]


@dataclass
class Trace:
    """``lists``: the block lists cut, in call order; ``position[name]``: blocks of them run before the first
    call of module ``name`` (or the first use of parameter ``name``)."""

    lists: list[str]
    position: dict[str, int] = field(default_factory=dict)


def block_lists(module: nn.Module) -> list[str]:
    """Every ``ModuleList``/``Sequential`` of two or more same-class blocks with parameters, by name."""
    found = []
    for name, child in module.named_modules():
        listed = isinstance(child, (nn.ModuleList, nn.Sequential)) and len(child) >= 2
        if listed and len({type(b) for b in child}) == 1 and any(True for _ in child.parameters()):
            found.append(name)
    return found


def _nested(a: str, b: str) -> bool:
    return a == b or a.startswith(b + ".") or b.startswith(a + ".")


class _Recorder(TorchFunctionMode):
    """Records module calls (by the name their caller knows them by), block calls and parameter uses."""

    def __init__(self, module: nn.Module, candidates: list[str], params: dict[int, str]) -> None:
        super().__init__()
        self.names: dict[int, list[str]] = {}
        for name, sub in module.named_modules(remove_duplicate=False):
            self.names.setdefault(id(sub), []).append(name)
        self.block_of = {id(b): (c, i) for c in candidates for i, b in enumerate(module.get_submodule(c))}
        self.params = params
        self.stack: list[str] = []
        self.blocks: list[tuple[str, int]] = []  # every block call, in order
        self.calls: list[tuple[str, int, tuple[str, int] | None]] = []  # (name, blocks so far, inside which)
        self.inside: dict[str, tuple[str, int]] = {}  # list -> (first block index seen, last block index done)
        self.current: tuple[str, int] | None = None

    def pre(self, sub: nn.Module, args: Any) -> None:
        names = self.names[id(sub)]
        parent = self.stack[-1] if self.stack else None
        name = next((n for n in names if parent is not None and n.rpartition(".")[0] == parent), names[0])
        self.stack.append(name)
        self.calls.append((name, len(self.blocks), self.current))
        if id(sub) in self.block_of:
            self.blocks.append(self.block_of[id(sub)])
            self.current = self.block_of[id(sub)]

    def post(self, sub: nn.Module, args: Any, output: Any) -> None:
        self.stack.pop()

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        for t in tree_leaves((args, kwargs)):
            if id(t) in self.params:
                self.calls.append((self.params[id(t)], len(self.blocks), self.current))
        return func(*args, **kwargs)


def trace_call(
    module: nn.Module, main: str, params: list[str], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[Trace, list[tuple[str, tuple[str, int] | None, int]]]:
    """Runs ``module(*args, **kwargs)`` once without gradients; returns the trace and the raw calls
    ``(name, inside, position)`` (``inside``: the list and block index of the last block begun before it)."""
    candidates = [main] + [c for c in block_lists(module) if not _nested(c, main)]
    candidates = [c for c in candidates if c == main or not any(_nested(c, o) and c != o for o in candidates)]
    recorder = _Recorder(module, candidates, {id(module.get_parameter(p)): p for p in params})
    handles = []
    for sub in dict.fromkeys(module.modules()):
        handles.append(sub.register_forward_pre_hook(recorder.pre))
        handles.append(sub.register_forward_hook(recorder.post, always_call=True))
    try:
        with torch.no_grad(), recorder:
            module(*args, **kwargs)
    finally:
        for handle in handles:
            handle.remove()
    lists = _whole_lists(module, candidates, recorder.blocks, main)
    trace, calls = Trace(lists), []
    for name, so_far, inside in recorder.calls:
        position = sum(1 for b in recorder.blocks[:so_far] if b[0] in lists)
        trace.position.setdefault(name, position)
        calls.append((name, inside if inside is not None and inside[0] in lists else None, position))
    return trace, calls


def _whole_lists(module: nn.Module, candidates: list[str], blocks: list[tuple[str, int]], main: str) -> list[str]:
    """The candidate lists run whole (each block once, in order, without another list's blocks between), in
    the order they ran; just ``[main]`` when the main list itself is not run so."""
    runs: list[str] = []
    for name, _ in blocks:
        if not runs or runs[-1] != name:
            runs.append(name)
    whole = []
    for c in candidates:
        order = [i for n, i in blocks if n == c]
        if runs.count(c) == 1 and order == list(range(len(module.get_submodule(c)))):
            whole.append(c)
    if main not in whole:
        return [main]
    return sorted(whole, key=runs.index)
