"""What the Fabric strategies share: one backward-sync control over the wrappers' ``no_sync()``, the record of
the wrappers a strategy made, which its teardown closes, and the process group's setup on a store that survives
torchrun's restarts.

The private Fabric names they build on (``_BackwardSyncControl``, ``_Sharded``: interfaces every Fabric strategy
implements; ``_apply_filter`` and ``_validate_keys_for_strict_loading``: how every Fabric strategy saves with a
filter and loads strictly) are imported in this one module, so a Lightning upgrade touches one place, as
``strategies/parallel.py`` does for the Trainer strategies.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Protocol

from lightning.fabric.strategies import DDPStrategy
from lightning.fabric.strategies.strategy import (
    _apply_filter,
    _BackwardSyncControl,
    _Sharded,
    _validate_keys_for_strict_loading,
)
from torch import nn
from typing_extensions import override

from lightning_haiscale.adapter.process_group import init_dist_connection

__all__ = ["NoSyncControl", "Sharded", "Wrapped", "apply_filter", "check_strict_keys", "setup_distributed"]

Sharded = _Sharded  # Fabric's interface of a strategy that shards parameters at creation
apply_filter = _apply_filter  # fabric.save(filter=): the entries of a state a function accepts, as Fabric keeps them
check_strict_keys = _validate_keys_for_strict_loading  # strict=True: Fabric's KeyError for a requested key missing


class NoSyncControl(_BackwardSyncControl):
    """``fabric.no_backward_sync(module)``: the module's ``no_sync()``; the module must be a ``wrapper``.

    Args:
        wrapper: the class ``fabric.setup`` wraps modules in.
        strategy: the strategy's name, for the error.
    """

    def __init__(self, wrapper: type[nn.Module], strategy: str) -> None:
        self._wrapper = wrapper
        self._strategy = strategy

    @override
    def no_backward_sync(self, module: nn.Module, enabled: bool) -> AbstractContextManager:
        if not enabled:
            return nullcontext()
        if not isinstance(module, self._wrapper):
            raise TypeError(
                f"no_backward_sync needs the module set up by {self._strategy} (fabric.setup), got "
                f"{type(module).__name__}"
            )
        return module.no_sync()


class _Closeable(Protocol):
    def close(self) -> None: ...


class Wrapped:
    """The wrappers ``fabric.setup`` made, each holding an engine: teardown closes them all (idempotent)."""

    def __init__(self) -> None:
        self._wrappers: list[_Closeable] = []

    def add(self, wrapper: _Closeable) -> None:
        self._wrappers.append(wrapper)

    def close_all(self) -> None:
        for wrapper in self._wrappers:
            wrapper.close()
        self._wrappers.clear()


def setup_distributed(strategy: DDPStrategy) -> None:
    """Fabric ``DDPStrategy._setup_distributed``, on a store that survives torchrun's restarts (see
    :mod:`lightning_haiscale.adapter.process_group`): a killed rank costs one restart, with torchrun's defaults."""
    strategy._set_world_ranks()
    strategy._process_group_backend = strategy._get_process_group_backend()
    environment = strategy.cluster_environment
    if environment is None:
        raise RuntimeError(f"{type(strategy).__name__} has no cluster environment: set it up through Fabric")
    init_dist_connection(environment, strategy._process_group_backend, strategy._timeout, strategy.root_device)
