"""Activation checkpointing of chosen submodules, applied before sharding, as Lightning's FSDP strategies apply it.

[Note: checkpointing a sharded unit]
torch's ``checkpoint_wrapper`` replaces each chosen module by a ``CheckpointWrapper`` holding it as
``_checkpoint_wrapped_module``; its forward keeps only its inputs, and backward runs the module's forward
again. Applied before :class:`~lightning_haiscale.fsdp.FullyShardedDataParallel` wraps the model, a unit chosen
by ``auto_wrap_policy`` (a ``Block``) is the wrapped module itself: its pre-backward hook gathers its parameters
again just before the recomputation reads them, as torch FSDP's units do, and its forward hooks, run again by
the recomputation, prefetch and reshard nothing (scheduler [Note: recomputation]). Parameter names then
hold ``_checkpoint_wrapped_module.``; the wrapper's state dicts use the plain model's keys.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable
from typing import Any

from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointWrapper,
    checkpoint_wrapper,
)
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    apply_activation_checkpointing as torch_apply_activation_checkpointing,
)

__all__ = ["CheckpointPolicy", "apply_activation_checkpointing", "check_ac_policy", "is_checkpointed"]

CheckpointPolicy = Callable[..., bool] | Iterable[type[nn.Module]]
"""A set of module classes, or a torch wrap policy (``ModuleWrapPolicy``, a ``transformer_auto_wrap_policy``
partial, any ``fn(module, recurse, nonwrapped_numel)``) choosing the modules to checkpoint."""


def check_ac_policy(policy: Any) -> None:
    """``TypeError`` naming ``activation_checkpointing_policy`` unless ``policy`` is module classes or a policy."""
    if callable(policy):
        return
    classes = list(policy) if isinstance(policy, Iterable) and not isinstance(policy, str | bytes) else []
    if not classes or not all(isinstance(c, type) and issubclass(c, nn.Module) for c in classes):
        raise TypeError(
            "activation_checkpointing_policy must be a set of nn.Module classes or a torch wrap policy "
            f"(ModuleWrapPolicy, a transformer_auto_wrap_policy partial), got {policy!r}"
        )


def is_checkpointed(module: nn.Module) -> bool:
    """Whether some submodule of ``module`` is already wrapped by torch's ``checkpoint_wrapper``."""
    return any(isinstance(m, CheckpointWrapper) for m in module.modules())


def apply_activation_checkpointing(module: nn.Module, policy: CheckpointPolicy) -> bool:
    """Wraps the modules ``policy`` chooses in torch's ``checkpoint_wrapper`` (non-reentrant), in place.

    A model that already contains checkpointed modules (applied by hand) is left as it is, as Lightning's FSDP
    strategy leaves it; returns whether anything was wrapped. See [Note: checkpointing a sharded unit].
    """
    check_ac_policy(policy)
    if is_checkpointed(module):
        warnings.warn(
            "activation checkpointing is configured, but the model already contains checkpointed modules: it is not "
            "applied again",
            stacklevel=2,
        )
        return False
    if callable(policy):
        torch_apply_activation_checkpointing(module, checkpoint_wrapper_fn=checkpoint_wrapper, auto_wrap_policy=policy)
    else:
        classes = tuple(policy)
        torch_apply_activation_checkpointing(
            module, checkpoint_wrapper_fn=checkpoint_wrapper, check_fn=lambda m: isinstance(m, classes)
        )
    return is_checkpointed(module)
