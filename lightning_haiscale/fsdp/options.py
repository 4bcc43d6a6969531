"""torch FSDP's keyword arguments that mean something here, checked at the border (before any collective).

[Note: torch's keywords, honoured]
- ``ignored_modules``: as torch, left alone entirely: their parameters are neither sharded nor reduced (each
  rank keeps and trains its own copy) and are saved whole, as buffers are, from rank 0.
- ``sync_module_states``: rank 0's parameters and buffers are broadcast to every rank before sharding, so
  ranks that initialized differently start alike.
- ``limit_all_gathers``: the engine runs a model's collectives in order, one at a time, and at most the next
  unit is gathered ahead (forward and ``BACKWARD_PRE`` prefetch): all-gathers are always limited so, with
  ``True`` or ``False``.
- ``forward_prefetch``: the next unit in the first forward's order is always gathered while the current one
  computes (torch's ``True``); ``False`` is accepted and changes nothing.
- ``use_orig_params``: the optimizer always sees the original parameters' names, as torch's ``True``, each a
  1-D piece of this rank's shard (see fully_sharded [Note: what the optimizer sees]); ``False`` is accepted
  and changes nothing.
- ``cpu_offload=CPUOffload(offload_params=True)``: on CPU tensors the shards already live in host memory, so
  it has no effect (logged once). Keeping CUDA shards, their gradients and the optimizer step in host memory is
  not built: it raises on a CUDA device rather than running on the device silently.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

__all__ = ["check_cpu_offload", "check_flags", "ignored", "offload_params"]

_log = logging.getLogger(__name__)
_logged: set[str] = set()


def check_flags(**flags: Any) -> None:
    """``TypeError`` naming the keyword unless every one of ``flags`` is a bool."""
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise TypeError(f"{name}={value!r} must be True or False")


def offload_params(cpu_offload: Any) -> bool:
    """Whether ``cpu_offload`` (``None``, a bool or torch's ``CPUOffload``) asks for the shards in host memory: the one
    parser, which the wrapper and the Lightning strategies (at their construction) both call."""
    offload = getattr(cpu_offload, "offload_params", cpu_offload)
    if offload is not None and not isinstance(offload, bool):
        raise TypeError(f"cpu_offload={cpu_offload!r} must be None, a bool or torch's CPUOffload(offload_params=...)")
    return bool(offload)


def check_cpu_offload(cpu_offload: Any, device: torch.device) -> None:
    """Accepts ``None``, a bool or torch's ``CPUOffload`` (see [Note: torch's keywords, honoured])."""
    if not offload_params(cpu_offload):
        return
    if device.type != "cpu":
        raise NotImplementedError(
            f"cpu_offload=CPUOffload(offload_params=True) on {device} is not supported by hai_fsdp yet (shards and "
            "their optimizer step in host memory are not built); leave cpu_offload out, or shard over more ranks"
        )
    if "cpu_offload" not in _logged:
        _logged.add("cpu_offload")
        _log.info("cpu_offload has no effect on CPU tensors: the shards already live in host memory")


def ignored(module: nn.Module, ignored_modules: Iterable[nn.Module] | None) -> tuple[set[int], set[int]]:
    """``id`` of every module of ``ignored_modules`` (with their submodules), and of every parameter they hold;
    ``TypeError`` naming the keyword for anything but submodules of ``module``."""
    if ignored_modules is None:
        return set(), set()
    ignored = list(ignored_modules)
    inside = {id(m) for m in module.modules()}
    bad = [m for m in ignored if not isinstance(m, nn.Module) or id(m) not in inside or m is module]
    if bad:
        raise TypeError(f"ignored_modules must be submodules of the wrapped module (not the module itself), got {bad}")
    return {id(sub) for m in ignored for sub in m.modules()}, {id(p) for m in ignored for p in m.parameters()}
