"""Which bytes a saved tensor adds to an offload region, and how the region recognises them again.

The rule is written once, in ``span_pack``: the pack hook of every region, whatever its ratio. A region that
offloads nothing only counts (inline, see [Note: counting at ratio 0]); one that offloads passes what the rule
finds to its ``SpanActions``.

[Note: what a saved tensor becomes]
The pack hook sees every tensor autograd saves inside the region. It works on storage spans rather
than tensors: the bytes of the tensor's storage (the whole storage unless the tensor covers less than
half of it) are counted and copied once, however many views of them are saved (``q``, ``k`` and ``v``
of one projection are one copy), and each view is rebuilt in backward with its own dtype, size, stride
and offset. Parameters, views of parameters and other leaves that require grad stay resident and are not
counted; so are tensors on other devices (CPU tensors unless ``cpu_too``), tensors without a storage
(sparse, mkldnn) and tensor subclasses. A conjugate or negative view counts (its bytes are saved like any
other) but is no candidate for a copy: the bit is not in the bytes, so the copy path could not rebuild it.

[Note: recognising a span]
Each entry of a region has a token. The first save of a span marks its storage's Python object with an
attribute ``(token, the storage's address, {(first byte, byte count): slot})`` (the key ``None`` for the
whole storage); every later save of the
span in the entry finds the mark. torch keeps one Python object per live storage
(``t.untyped_storage() is t.untyped_storage()``, since torch 2.1: the object lives as long as the storage),
so the mark dies with its storage: a storage freed and replaced at the same address has no mark, a later
entry's token differs, and a storage resized meanwhile has another address, so each of those is a new span.
A mark holds no tensor (a region's slot is an index into its own list), so a dropped graph frees everything
it saved.

[Note: the cost of the hooks]
The pack runs for every saved tensor, thousands of times a step in a large model, so its Python cost is a
cost per step (``benchmarks/offload_overhead.py`` measures it against ``save_on_cpu``). Hence one closure
over locals, the rule's checks cheapest and most decisive first (a view of a parameter ends at its
``_base``; an activation base ends at ``is_leaf``; a layout without a storage ends at the exception of
``untyped_storage()``, free until raised), and no call out of the closure on the ratio-0 path.
- A handle detaches only a tensor that owns a graph node (requires grad, not a leaf): holding the tensor
  itself would hold its node, which holds the handle, a cycle through autograd's C++ that the garbage
  collector cannot see (``save_on_cpu``'s CPU pack returns the tensor and leaks a saved output whose graph
  is dropped unused). A parameter (a leaf) or a tensor that does not require grad owns no node: it is its
  own handle. So is a view of a leaf that requires grad: its node is the view's (``t()``, ``view``, a
  slice), which saves nothing, so no cycle can pass through it.
- A plain tensor is detached with ``.data``, a third cheaper than ``detach()`` (no dispatcher call). The
  two differ only in the version counter, which ``.data`` does not share: autograd checks no versions of
  tensors that went through saved-tensor hooks, so none is read.

[Note: counting at ratio 0]
Ratio 0 must still count (``offload_stats``: bytes and spans saved, each span once; the tag's next entry
plans from the candidate sizes), by the rule of the other ratios. Its pack appends each span counted to
``sizes``, and to ``candidates`` when it is at least ``min_bytes`` and rebuildable, and returns the handle:
nothing in it touches a device, and nothing calls out of the closure.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Protocol

import torch
from torch import nn

__all__ = ["SpanActions", "extent", "parameter_like", "span_pack"]

_TENSOR = torch.Tensor
_PARAMETER = nn.Parameter
_MARK = "_lightning_haiscale_offload_counted"
_Mark = tuple[object, int, "dict[tuple[int, int] | None, object]"]  # (token, address, {span: slot}); None: whole


class SpanActions(Protocol):
    """What a region that offloads does with the saved tensors ``span_pack`` classifies."""

    def resident(self, handle: torch.Tensor) -> object:
        """A saved tensor that is not counted (a parameter, another device, ...): its pack result."""

    def first(
        self, t: torch.Tensor, handle: torch.Tensor, storage: torch.UntypedStorage, start: int, nbytes: int, fit: bool
    ) -> tuple[object, object]:
        """The first save of a span in the entry (already counted; ``fit``: a candidate for a copy): the pack
        result and the slot its mark keeps for the later saves."""

    def again(self, t: torch.Tensor, handle: torch.Tensor, start: int, nbytes: int, slot: object) -> object:
        """A later save of a span: its pack result."""


def span_pack(
    cpu_too: bool, min_bytes: int, sizes: list[int], candidates: list[int], actions: SpanActions | None
) -> Callable[[torch.Tensor], object]:
    """The pack hook of one region entry: counts each new span into ``sizes`` (and ``candidates`` when it is at
    least ``min_bytes`` and rebuildable); with ``actions``, hands every saved tensor to them, else keeps it.

    Args:
        cpu_too: count CPU tensors too (``CPUOffload(force_copy=True)``); otherwise only CUDA tensors count.
    """
    token = object()  # this entry's: a storage marked with another entry's token is new here
    count, candidate = sizes.append, candidates.append
    resident = actions.resident if actions is not None else None

    def pack(t: torch.Tensor) -> object:
        if t.requires_grad:
            if t.is_leaf:  # a parameter: not counted, and it owns no graph node
                return t if resident is None else resident(t)
            if type(t) is not _TENSOR:  # a subclass: not counted
                return t.detach() if resident is None else resident(t.detach())
            base = t._base
            if base is not None and (type(base) is _PARAMETER or (base.is_leaf and parameter_like(base))):
                # a view of a parameter: not counted; a leaf's view owns a node that saves nothing
                handle = t if base.requires_grad and base.is_leaf else t.data
                return handle if resident is None else resident(handle)
            handle = t.data  # see [Note: the cost of the hooks]
        elif type(t) is not _TENSOR or getattr(t, "_is_param", False):  # a subclass or a frozen parameter
            return t if resident is None else resident(t)
        else:
            base = t._base
            if base is not None and (type(base) is _PARAMETER or (base.is_leaf and parameter_like(base))):
                return t if resident is None else resident(t)  # a view of a frozen parameter
            handle = t
        if not ((cpu_too and t.is_cpu) or t.is_cuda):
            return handle if resident is None else resident(handle)
        try:
            storage = t.untyped_storage()
        except (NotImplementedError, RuntimeError):  # sparse, mkldnn and other layouts without a storage
            return handle if resident is None else resident(handle)
        total = storage.nbytes()
        nbytes = t.nbytes if t.is_contiguous() else extent(t)
        if not nbytes:  # an empty tensor (of any storage) saves nothing
            return handle if resident is None else resident(handle)
        if 2 * nbytes >= total:
            start, nbytes, key = 0, total, None  # the whole storage: no key to build
        else:
            start = t.storage_offset() * t.element_size()
            key = (start, nbytes)
        mark: _Mark | None = getattr(storage, _MARK, None)
        address = storage.data_ptr()
        if mark is not None and mark[0] is token and mark[1] == address:
            spans = mark[2]
            if key in spans:
                return handle if actions is None else actions.again(t, handle, start, nbytes, spans[key])
        else:
            spans = None
        count(nbytes)
        fit = nbytes >= min_bytes and not (t.is_conj() or t.is_neg())  # ``rebuildable``, inlined
        if fit:
            candidate(nbytes)
        result, slot = (handle, None) if actions is None else actions.first(t, handle, storage, start, nbytes, fit)
        if spans is None:
            storage._lightning_haiscale_offload_counted = (token, address, {key: slot})  # half a setattr call
        else:
            spans[key] = slot
        return result

    return pack


def extent(t: torch.Tensor) -> int:
    """Bytes from ``t``'s first element to its last: its element count when contiguous (empty ones are)."""
    if t.is_contiguous():
        return t.nbytes
    stride = t.stride()  # every size is >= 1 (else it would be contiguous): 1 + sum((size - 1) * stride)
    return t.element_size() * (1 + sum(map(operator.mul, t.size(), stride)) - sum(stride))


def parameter_like(x: torch.Tensor) -> bool:
    """A parameter, or a leaf that requires grad: resident whatever a region does.

    A parameter is a leaf, so an activation (the common base) ends at ``is_leaf``. For a plain tensor,
    ``isinstance(x, nn.Parameter)`` is the ``_is_param`` flag its metaclass reads (read directly: the
    metaclass check is the most expensive step of a pack).
    """
    cls = type(x)
    if cls is _PARAMETER:
        return True
    if not x.is_leaf:
        return False
    return x.requires_grad or bool(getattr(x, "_is_param", False) if cls is _TENSOR else isinstance(x, nn.Parameter))


def rebuildable(t: torch.Tensor) -> bool:
    """Whether the copy path can rebuild ``t`` from its bytes (a conjugate or negative bit is not in them)."""
    return not (t.is_conj() or t.is_neg())
