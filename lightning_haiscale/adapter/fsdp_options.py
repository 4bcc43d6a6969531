"""Lightning ``FSDPStrategy``'s keywords, checked once and translated into ``hai_fsdp``'s wrapper options.

Shared by the Trainer's and Fabric's ``HaiFSDPStrategy``: each keyword is either honoured (passed to
:class:`lightning_haiscale.fsdp.FullyShardedDataParallel` or applied around it) or refused when the strategy is
built, with the reason and the fix, never dropped.

[Note: what each FSDPStrategy keyword becomes]
- ``sharding_strategy``: ``FULL_SHARD``, ``SHARD_GRAD_OP``, ``NO_SHARD``, ``HYBRID_SHARD``, ``_HYBRID_SHARD_ZERO2``
  (strings in any case, or torch's ``ShardingStrategy``), parsed by ``fsdp.sharding``. The strategy hands the
  wrapper its ``timeout``, the deadline of every engine the wrapper builds.
- ``device_mesh``: hybrid only, ``(replicate, shard)`` or a 2-D ``DeviceMesh`` (checked by ``fsdp.mesh``); without
  it, shard within each host and replicate across hosts.
- ``activation_checkpointing_policy`` (or the deprecated ``activation_checkpointing``): torch's
  ``checkpoint_wrapper`` on the policy's modules before sharding (``fsdp.checkpointing``): a recomputed unit
  gathers its parameters again.
- ``cpu_offload``: ``True`` or torch's ``CPUOffload`` (parsed by ``fsdp.options``). On CPU the shards are in host
  memory already: accepted, and said once. On CUDA it goes to the wrapper, which refuses it until it is built.
- ``mixed_precision``: torch's ``MixedPrecision`` (or ours) wins over the Trainer's ``precision``, as in
  Lightning; ``keep_low_precision_grads=True`` is refused.
- ``limit_all_gathers``, ``forward_prefetch``, ``use_orig_params``, ``sync_module_states``, ``ignored_modules``
  (torch FSDP's, Lightning's ``**kwargs``; named parameters of ours), ``backward_prefetch``, ``param_init_fn``:
  passed to the wrapper. ``process_group``, ``device_id``, ``ignored_states`` and any other name raise (see
  ``_REFUSED``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
from lightning.fabric.utilities.rank_zero import rank_zero_deprecation, rank_zero_warn
from torch import nn
from torch.distributed.fsdp import BackwardPrefetch as TorchBackwardPrefetch
from torch.distributed.fsdp import CPUOffload
from torch.distributed.fsdp import MixedPrecision as TorchMixedPrecision
from torch.distributed.fsdp import ShardingStrategy as TorchShardingStrategy

from lightning_haiscale.adapter.arguments import check_bool
from lightning_haiscale.fsdp import BackwardPrefetch, FullyShardedDataParallel, MixedPrecision
from lightning_haiscale.fsdp.checkpointing import CheckpointPolicy, apply_activation_checkpointing, check_ac_policy
from lightning_haiscale.fsdp.mesh import check_device_mesh
from lightning_haiscale.fsdp.options import offload_params
from lightning_haiscale.fsdp.sharding import ShardingStrategy, parse_sharding_strategy
from lightning_haiscale.fsdp.wrap import check_policy

__all__ = ["HaiFSDPOptions", "hai_fsdp_options", "wrap_hai_fsdp"]

_PASSED = ("limit_all_gathers", "forward_prefetch", "use_orig_params", "sync_module_states", "ignored_modules")
"""torch FSDP keywords (Lightning's ``**kwargs``) that the wrapper takes as they are."""

_REFUSED = {
    "process_group": "hai_fsdp shards over the Trainer's world (devices x num_nodes); pass device_mesh for hybrid "
    "sharding instead",
    "device_id": "the strategy places each rank on its own device from the Trainer's devices; remove it",
    "ignored_states": "pass the modules to leave unsharded as ignored_modules= instead",
    "module": "the strategy wraps the LightningModule (or the module given to fabric.setup) itself",
}


@dataclass(frozen=True)
class HaiFSDPOptions:
    """Checked keywords of a ``HaiFSDPStrategy``.

    Attributes:
        wrapper: keywords of :class:`FullyShardedDataParallel` (but ``mixed_precision``, ``device_id`` and those
            below).
        sharding_strategy: what is sharded.
        mixed_precision: the user's policy; ``None``: derived from the Trainer's or Fabric's ``precision``.
        torch_mixed_precision_given: the user's policy as given, when it is torch's ``MixedPrecision``.
        activation_checkpointing: the modules whose activations are recomputed in backward (``None``: none).
        cpu_offload: shards and gradients live in host memory.
    """

    wrapper: dict[str, Any] = field(default_factory=dict)
    sharding_strategy: ShardingStrategy = ShardingStrategy.FULL_SHARD
    mixed_precision: MixedPrecision | None = None
    torch_mixed_precision_given: TorchMixedPrecision | None = None
    activation_checkpointing: CheckpointPolicy | None = None
    cpu_offload: bool = False

    def mixed_precision_for(self, precision: str) -> MixedPrecision | None:
        """The policy the wrapper runs under the Trainer's or Fabric's ``precision``: the user's; without one,
        bf16-mixed gathers and reduces in bf16 (half the traffic) while autocast still runs the ops."""
        if self.mixed_precision is None and precision == "bf16-mixed":
            return MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16, cast_forward_inputs=False)
        return self.mixed_precision

    def torch_attributes(self) -> tuple[ShardingStrategy, CPUOffload]:
        """``sharding_strategy`` and ``cpu_offload`` as torch's objects: the public attributes of Lightning's
        ``FSDPStrategy``, which users compare with torch's enum."""
        return TorchShardingStrategy[self.sharding_strategy.name], CPUOffload(offload_params=self.cpu_offload)

    def torch_mixed_precision(self, precision: str) -> TorchMixedPrecision | None:
        """:meth:`mixed_precision_for` as torch's ``MixedPrecision`` (Lightning's ``mixed_precision_config``): the
        user's own object when it is torch's, as Lightning returns it."""
        if self.torch_mixed_precision_given is not None:
            return self.torch_mixed_precision_given
        mixed = self.mixed_precision_for(precision)
        if mixed is None:
            return None
        return TorchMixedPrecision(
            param_dtype=mixed.param_dtype,
            reduce_dtype=mixed.reduce_dtype,
            cast_forward_inputs=mixed.cast_forward_inputs,
        )


def hai_fsdp_options(
    *,
    backward_prefetch: Any = BackwardPrefetch.BACKWARD_PRE,
    reshard_after_forward: Any = True,
    param_init_fn: Any = None,
    cpu_offload: Any = None,
    mixed_precision: Any = None,
    auto_wrap_policy: Any = None,
    activation_checkpointing: Any = None,
    activation_checkpointing_policy: Any = None,
    sharding_strategy: Any = "FULL_SHARD",
    device_mesh: Any = None,
    kwargs: dict[str, Any] | None = None,
) -> HaiFSDPOptions:
    """Checks every keyword of a ``HaiFSDPStrategy`` (see [Note: what each FSDPStrategy keyword becomes])."""
    kwargs = {k: v for k, v in (kwargs or {}).items() if not (k in _PASSED and v is None)}  # the wrapper's default
    backward_prefetch = kwargs.pop("backward_prefetch", backward_prefetch)  # Lightning passes it in **kwargs
    param_init_fn = kwargs.pop("param_init_fn", param_init_fn)
    check_policy(auto_wrap_policy)
    check_bool("reshard_after_forward", reshard_after_forward)
    if param_init_fn is not None and not callable(param_init_fn):
        raise TypeError(f"param_init_fn={param_init_fn!r} must be a function fn(module) or None")
    sharding = parse_sharding_strategy(sharding_strategy)
    mesh = check_device_mesh(sharding, device_mesh)
    wrapper = {
        "auto_wrap_policy": auto_wrap_policy,
        "backward_prefetch": _backward_prefetch(backward_prefetch),
        "reshard_after_forward": reshard_after_forward,
        "param_init_fn": param_init_fn,
        **_torch_kwargs(kwargs),
        **({} if mesh is None else {"device_mesh": mesh}),
    }
    return HaiFSDPOptions(
        wrapper=wrapper,
        sharding_strategy=sharding,
        mixed_precision=_mixed_precision(mixed_precision),
        torch_mixed_precision_given=mixed_precision if isinstance(mixed_precision, TorchMixedPrecision) else None,
        activation_checkpointing=_checkpointing(activation_checkpointing, activation_checkpointing_policy),
        cpu_offload=offload_params(cpu_offload),
    )


def _backward_prefetch(value: Any) -> BackwardPrefetch | None:
    if value is None or isinstance(value, BackwardPrefetch):
        return value
    if isinstance(value, TorchBackwardPrefetch):
        return BackwardPrefetch[value.name]
    raise TypeError(
        f"backward_prefetch={value!r} must be None, BackwardPrefetch.BACKWARD_PRE or BACKWARD_POST "
        "(lightning_haiscale.fsdp's or torch's)"
    )


def _torch_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """torch FSDP's keywords the wrapper honours; any other name raises, naming it and why."""
    for name in kwargs:
        if name in _REFUSED:
            raise ValueError(f"HaiFSDPStrategy({name}=...) is not supported: {_REFUSED[name]}")
        if name not in _PASSED:
            raise TypeError(
                f"HaiFSDPStrategy got an unexpected keyword argument {name!r}: it is not an argument of Lightning's "
                f"FSDPStrategy nor of torch's FullyShardedDataParallel that hai_fsdp honours ({', '.join(_PASSED)})"
            )
    for name in ("limit_all_gathers", "forward_prefetch", "use_orig_params", "sync_module_states"):
        if name in kwargs:
            check_bool(name, kwargs[name])
    ignored = kwargs.get("ignored_modules")
    if ignored is not None:
        modules = list(ignored) if isinstance(ignored, Iterable) else [ignored]
        if not all(isinstance(m, nn.Module) for m in modules):
            raise TypeError(f"ignored_modules={ignored!r} must be a list of the model's submodules")
        kwargs["ignored_modules"] = modules
    return kwargs


def _mixed_precision(value: Any) -> MixedPrecision | None:
    """torch's ``MixedPrecision`` in our terms: the gathered parameters' and the reduction's dtypes, and whether
    the root's floating inputs are cast (torch's ``cast_root_forward_inputs``)."""
    if value is None or isinstance(value, MixedPrecision):
        return value
    if not isinstance(value, TorchMixedPrecision):
        raise TypeError(f"mixed_precision={value!r} must be torch.distributed.fsdp.MixedPrecision or None")
    if value.keep_low_precision_grads:
        raise ValueError(
            "mixed_precision=MixedPrecision(keep_low_precision_grads=True) is not supported: hai_fsdp keeps the "
            "gradient shards in the parameters' dtype; pass keep_low_precision_grads=False"
        )
    return MixedPrecision(
        param_dtype=value.param_dtype,
        reduce_dtype=value.reduce_dtype,
        cast_forward_inputs=value.cast_root_forward_inputs or value.cast_forward_inputs,
    )


def _checkpointing(classes: Any, policy: Any) -> CheckpointPolicy | None:
    """Lightning's two spellings: ``activation_checkpointing`` (a class or a list, deprecated) and
    ``activation_checkpointing_policy`` (a set of classes or a policy)."""
    if classes is not None and policy is not None:
        raise ValueError(
            "You cannot set both `activation_checkpointing` and `activation_checkpointing_policy`. Use the latter."
        )
    if classes is not None:
        classes = set(classes) if isinstance(classes, list | tuple | set) else {classes}
        rank_zero_deprecation(
            f"`HaiFSDPStrategy(activation_checkpointing={classes})` is deprecated (as in Lightning's FSDPStrategy), "
            f"use `activation_checkpointing_policy={classes}` instead."
        )
        policy = classes
    if policy is not None:
        check_ac_policy(policy)
    return policy


def wrap_hai_fsdp(
    module: nn.Module,
    device: torch.device,
    timeout: timedelta,
    precision: str,
    options: HaiFSDPOptions,
) -> FullyShardedDataParallel:
    """Applies activation checkpointing, then shards ``module``; ``timeout`` is the engine's deadline.

    The mixed precision: :meth:`HaiFSDPOptions.mixed_precision_for`.
    """
    mixed = options.mixed_precision_for(precision)
    if options.activation_checkpointing is not None:
        apply_activation_checkpointing(module, options.activation_checkpointing)
    extra: dict[str, Any] = {"sharding_strategy": options.sharding_strategy}
    extra["timeout"] = timeout  # every engine the wrapper builds (only those its strategy uses) takes this deadline
    if options.cpu_offload:
        if device.type == "cpu":
            rank_zero_warn("HaiFSDPStrategy(cpu_offload=True) has no effect on CPU: the shards are in host memory")
        else:
            extra["cpu_offload"] = CPUOffload(offload_params=True)
    return FullyShardedDataParallel(module, mixed_precision=mixed, device_id=device, **options.wrapper, **extra)
