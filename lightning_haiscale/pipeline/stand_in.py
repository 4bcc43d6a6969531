"""Stand-ins for the modules another pipeline stage holds: the module itself, without its compute.

[Note: stand-ins] Every stage runs the user's whole ``forward`` (see ``pipeline.module_stage``), so it calls
modules that another stage holds (the embeddings on every stage after the first). A model's forward reads
more of them than their output: HF ``ViTModel`` reads ``self.embeddings.patch_embeddings.projection.weight
.dtype`` before calling them, others read a module's ``config`` or its class. So the stand-in is a copy of
the module (its class, attributes, submodules and configuration) whose parameters and buffers are on the
meta device: held as plain attributes, not registered, so they are in no ``parameters()``, ``state_dict()``
or optimizer, and Lightning's ``.to(device)`` never copies out of them. One registered, empty, non-persistent
buffer (the probe) follows Lightning's conversions: when its dtype changes (``precision="64-true"`` runs
``.double()``), the meta tensors take it, so the stand-in computes in the model's training dtype.

Called, it runs on the meta device for its output's structure (tensors, tuples, ``ModelOutput``\\ s), and
returns that structure with zeros on the probe's device. Zeros, not meta tensors: the code between it and
the blocks (HF's mask builders) may read values (``.all()``, ``.item()``), which meta tensors cannot give,
and the first block's inputs are replaced by the activations received from the previous stage anyway. What
such a module computes without gradients (a random mask, the indices that restore the patch order) is
carried from the stage that ran it, so those values are the real ones (see ``module_stage``).
"""

from __future__ import annotations

import copy
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map_only

__all__ = ["is_stand_in", "stand_in"]

_PROBE = "pipeline_stand_in_probe"


def is_stand_in(module: nn.Module) -> bool:
    """True for a module made by ``stand_in``."""
    return "_stand_in_name" in module.__dict__


def stand_in(module: nn.Module, name: str) -> nn.Module:
    """A meta copy of ``module`` (named ``name`` in the network) that stands in for it on another stage."""
    memo: dict[int, Any] = {
        id(p): nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
        for p in module.parameters()
    }
    memo.update({id(b): torch.empty_like(b, device="meta") for b in module.buffers()})
    copied = copy.deepcopy(module, memo)
    for sub in copied.modules():
        sub.__dict__.update(sub._parameters)  # plain attributes: read as before, registered nowhere
        sub.__dict__.update(sub._buffers)
        sub._parameters.clear()
        sub._buffers.clear()
        sub._non_persistent_buffers_set.clear()
    dtype = next((p.dtype for p in module.parameters() if p.is_floating_point()), torch.get_default_dtype())
    copied.register_buffer(_PROBE, torch.empty(0, dtype=dtype), persistent=False)
    copied.__dict__["_stand_in_name"] = name
    copied.__dict__["_stand_in_dtype"] = dtype
    depth = [0]  # calls of the stand-in's modules in progress: only the outermost converts
    for sub in copied.modules():  # the model may call a submodule directly (timm: ``self.patch_embed.proj(x)``)
        sub.register_forward_pre_hook(partial(_to_meta, copied, depth), with_kwargs=True)
        sub.register_forward_hook(partial(_to_zeros, copied, depth), always_call=True)
    return copied


def _follow_dtype(module: nn.Module) -> None:
    """The meta tensors take the probe's dtype when a conversion changed it (see [Note: stand-ins])."""
    dtype = getattr(module, _PROBE).dtype
    if module.__dict__["_stand_in_dtype"] == dtype:
        return
    for sub in module.modules():
        for key, value in list(sub.__dict__.items()):
            if torch.is_tensor(value) and value.is_meta and value.is_floating_point():
                moved = value.to(dtype)
                if isinstance(value, nn.Parameter):
                    moved = nn.Parameter(moved, value.requires_grad)
                sub.__dict__[key] = moved
    module.__dict__["_stand_in_dtype"] = dtype


def _to_meta(
    root: nn.Module, depth: list[int], module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple, dict[str, Any]] | None:
    depth[0] += 1
    if depth[0] > 1:
        return None
    _follow_dtype(root)
    return tree_map_only(torch.Tensor, lambda t: t.to("meta"), (args, kwargs))


def _to_zeros(root: nn.Module, depth: list[int], module: nn.Module, args: Any, output: Any) -> Any:
    depth[0] -= 1
    if depth[0] or output is None:  # an inner call, or the forward raised (``always_call``)
        depth[0] = max(depth[0], 0) if output is not None else 0
        return None
    device = getattr(root, _PROBE).device

    def zeros(t: torch.Tensor) -> torch.Tensor:
        # A leaf that requires grad where the real output does: code that checks it behaves as on one process.
        return torch.zeros(t.shape, dtype=t.dtype, device=device, requires_grad=t.requires_grad)

    return tree_map_only(torch.Tensor, zeros, output)
