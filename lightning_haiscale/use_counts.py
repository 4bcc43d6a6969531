"""torch's counts of who uses a tensor or its storage, in one place: they are private to torch.

Two pieces of memory reuse ask them: the pipelines' receive-buffer pool (is a buffer still held?) and
hai_fsdp's early release of gathered parameters (does anything still read one?). What a count includes
besides tensors differs between torch versions (asking for a storage's count makes a storage object, which
counts once on torch 2.13 and not at all on 2.6), so callers compare a count with one read in a known
state, never with a constant. Where torch lacks a count, ``None``: callers then reuse or release nothing.
"""

from __future__ import annotations

import torch

__all__ = ["storage_use_count", "tensor_use_count"]


def storage_use_count(tensor: torch.Tensor) -> int | None:
    """How many users ``tensor``'s storage has (tensors viewing it, and what the version counts besides)."""
    count = getattr(torch._C, "_storage_Use_Count", None)
    return None if count is None else int(count(tensor.untyped_storage()._cdata))


def tensor_use_count(tensor: torch.Tensor) -> int | None:
    """How many holders ``tensor`` itself has: its Python object, and each autograd node that saved it or
    accumulates into it."""
    count = getattr(tensor, "_use_count", None)
    return None if count is None else int(count())
