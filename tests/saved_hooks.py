"""The saved-tensor hooks autograd would use now, on every supported torch.

torch 2.7 and later answer with ``torch._C._autograd._top_saved_tensors_default_hooks``; 2.6 has no such
query, so there the pushes and pops of ``torch.autograd.graph.saved_tensors_hooks`` (and of anything else
that installs hooks) are recorded once this module is imported. Both are thread-local in autograd; the
record is kept for the thread that installs hooks in these tests, the main one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

_autograd = torch._C._autograd
_query = getattr(_autograd, "_top_saved_tensors_default_hooks", None)
_recorded: list[tuple[Callable[..., Any], Callable[..., Any]]] = []


def installed_hooks() -> tuple[Callable[..., Any], Callable[..., Any]] | None:
    """The innermost ``(pack, unpack)`` pair installed, or None."""
    if _query is not None:
        return _query(False)
    return _recorded[-1] if _recorded else None


if _query is None:
    _push, _pop = _autograd._push_saved_tensors_default_hooks, _autograd._pop_saved_tensors_default_hooks

    def _recording_push(pack: Callable[..., Any], unpack: Callable[..., Any]) -> None:
        _push(pack, unpack)
        _recorded.append((pack, unpack))

    def _recording_pop() -> None:
        _pop()
        _recorded.pop()

    _autograd._push_saved_tensors_default_hooks = _recording_push
    _autograd._pop_saved_tensors_default_hooks = _recording_pop
