"""Giving the pages of gathered parameters back to the OS before their unit reshards.

[Note: releasing gathered parameters early]
A unit whose backward another unit interrupts stays unsharded until its own backward ends: the root unit
(embeddings, final norm, head) from the forward to the last op of backward. At GPT-2 Medium that is 393 MiB
per rank held through the whole backward, although the head's weight is read by nothing after the head's
backward (the first op) and the embedding's backward reads only the token ids. So when the backward enters
another unit, the interrupted unit gives the OS back the pages of every gathered parameter that nothing can
read any more. (Not in the forward: a model may read a parameter directly after its module ran, as a head
tied by ``F.linear(x, self.wte.weight)`` does, and nothing tells the wrapper it will not.) Nothing reads a
parameter when:

- no tensor other than the unit's own leaves views the unsharded storage (torch's storage use count: a
  saved view of a weight, such as the ``weight.t()`` a linear layer saves, or a ``detach()``ed alias, each
  count), and
- the leaf itself is referenced only by its Python object and its gradient accumulator (its tensor use
  count): a node that saved the leaf for backward (a layer norm's weight, ``(weight ** 2).sum()``) holds it.

Where either count is unavailable (another torch) nothing is released. The pages are released with
``madvise(MADV_DONTNEED)`` on the leaf's whole pages inside the buffer (Linux, CPU tensors; elsewhere
nothing is released): the mapping stays and the memory goes back to the OS at once. The modules then hold a
:class:`Released` placeholder (the parameter's shape, dtype and device; any computation with it raises), so a
direct read during backward (from a backward hook, or by a recomputed module that holds none of the unit's
parameters) fails loudly instead of reading zeros. A forward of a module holding a parameter that was
considered for release (activation recomputation in backward) gathers the unit again first, on every rank
alike: whether a parameter is considered depends only on where backward is, not on this rank's counts.

"""

from __future__ import annotations

import ctypes
import mmap
import sys
from collections.abc import Callable
from typing import Any

import torch

from lightning_haiscale.use_counts import tensor_use_count

__all__ = ["Released", "give_back", "unread"]

_MADV_DONTNEED = 4  # Linux
_PAGE = mmap.PAGESIZE


def _madvise() -> Callable[[int, int, int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    function = getattr(ctypes.CDLL(None, use_errno=True), "madvise", None)
    if function is not None:
        function.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        function.restype = ctypes.c_int
    return function


_MADVISE = _madvise()


def unread(leaf: torch.Tensor) -> bool:
    """True if no autograd node holds ``leaf`` (see [Note: releasing gathered parameters early])."""
    count = tensor_use_count(leaf)
    return count is not None and count <= 1 + int(leaf.requires_grad)


def give_back(tensor: torch.Tensor) -> int:
    """Releases the whole pages inside contiguous CPU ``tensor`` to the OS (they read as zeros afterwards);
    returns the bytes released (0 where not supported)."""
    if _MADVISE is None or tensor.device.type != "cpu" or not tensor.is_contiguous():
        return 0
    start = tensor.data_ptr()
    first = -(-start // _PAGE) * _PAGE
    last = (start + tensor.numel() * tensor.element_size()) // _PAGE * _PAGE
    if last <= first or _MADVISE(first, last - first, _MADV_DONTNEED) != 0:
        return 0
    return last - first


class Released(torch.Tensor):
    """Stands in a module for a parameter whose gathered pages were released: its shape, dtype and device are
    the parameter's, and any computation with it raises (instead of reading zeros)."""

    @staticmethod
    def __new__(cls, like: torch.Tensor) -> Released:
        return torch.Tensor._make_wrapper_subclass(cls, like.shape, dtype=like.dtype, device=like.device)

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        raise RuntimeError(
            f"hai_fsdp released this parameter's gathered copy during backward ({func}): nothing in the autograd "
            "graph read it any more. Read a parameter during backward only through its own module's forward "
            "(activation recomputation gathers it again), not directly from a backward hook or another module"
        )
