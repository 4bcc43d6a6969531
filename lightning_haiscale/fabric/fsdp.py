"""Fabric's ``"hai_fsdp"``: sharded data parallel on the hfreduce engine, for Lightning Fabric (checkpoints: see
``fabric.fsdp_checkpoint``).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, ExitStack, nullcontext
from datetime import timedelta
from typing import Any, Literal

import torch
from lightning.fabric.accelerators import Accelerator
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment, Precision
from lightning.fabric.strategies import STRATEGY_REGISTRY, DDPStrategy
from torch import nn
from torch.distributed.constants import default_pg_timeout
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffload, ShardingStrategy
from torch.distributed.fsdp import MixedPrecision as TorchMixedPrecision
from torch.optim import Optimizer
from typing_extensions import override

from lightning_haiscale.adapter.arguments import check_choice, check_timeout, strategy_repr
from lightning_haiscale.adapter.collectives import ExitSafeCollectives
from lightning_haiscale.adapter.fsdp_options import hai_fsdp_options, wrap_hai_fsdp
from lightning_haiscale.adapter.precision import agree_on_inf
from lightning_haiscale.adapter.registry import register_once
from lightning_haiscale.fabric import fsdp_checkpoint
from lightning_haiscale.fabric.shared import NoSyncControl, Sharded, Wrapped, setup_distributed
from lightning_haiscale.fsdp import BackwardPrefetch, FullyShardedDataParallel, MixedPrecision
from lightning_haiscale.fsdp.checkpointing import CheckpointPolicy
from lightning_haiscale.fsdp.wrap import AutoWrapPolicy

__all__ = ["HaiFSDPStrategy"]


class HaiFSDPStrategy(ExitSafeCollectives, DDPStrategy, Sharded):
    """Fabric sharded data parallel: ``Fabric(strategy="hai_fsdp")``.

    Processes, the process group and the collectives (``all_reduce``, ``barrier``, ``broadcast``) are Fabric
    ``DDPStrategy``'s; the module is sharded by :class:`lightning_haiscale.fsdp.FullyShardedDataParallel`.
    ``fabric.setup(model, optimizer)`` points the optimizer at this rank's pieces (it must not have stepped
    yet); ``fabric.init_module(empty_init=True)`` builds on the meta device and the model is materialized
    one unit at a time. Arguments as :class:`lightning_haiscale.HaiFSDPStrategy` (every keyword of Fabric's
    ``FSDPStrategy``, in its order, after our own; ``checkpoint_io`` as Fabric's ``DDPStrategy``), but
    ``state_dict_type`` defaults to ``"full"`` here too (Fabric's ``FSDPStrategy``: ``"sharded"``).
    """

    def __init__(
        self,
        backward_prefetch: BackwardPrefetch | None = BackwardPrefetch.BACKWARD_PRE,
        reshard_after_forward: bool = True,
        param_init_fn: Callable[[nn.Module], None] | None = None,
        checkpoint_io: CheckpointIO | None = None,
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        precision: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        cpu_offload: bool | CPUOffload | None = None,
        mixed_precision: TorchMixedPrecision | MixedPrecision | None = None,
        auto_wrap_policy: AutoWrapPolicy | None = None,
        activation_checkpointing: type[nn.Module] | list[type[nn.Module]] | None = None,
        activation_checkpointing_policy: CheckpointPolicy | None = None,
        sharding_strategy: str | ShardingStrategy = "FULL_SHARD",
        state_dict_type: Literal["full", "sharded"] = "full",
        device_mesh: tuple[int, int] | DeviceMesh | None = None,
        *,
        limit_all_gathers: bool | None = None,
        forward_prefetch: bool | None = None,
        use_orig_params: bool | None = None,
        sync_module_states: bool | None = None,
        ignored_modules: list[nn.Module] | None = None,
        **kwargs: Any,
    ) -> None:
        options = hai_fsdp_options(
            backward_prefetch=backward_prefetch,
            reshard_after_forward=reshard_after_forward,
            param_init_fn=param_init_fn,
            cpu_offload=cpu_offload,
            mixed_precision=mixed_precision,
            auto_wrap_policy=auto_wrap_policy,
            activation_checkpointing=activation_checkpointing,
            activation_checkpointing_policy=activation_checkpointing_policy,
            sharding_strategy=sharding_strategy,
            device_mesh=device_mesh,
            kwargs={
                **kwargs,
                "limit_all_gathers": limit_all_gathers,
                "forward_prefetch": forward_prefetch,
                "use_orig_params": use_orig_params,
                "sync_module_states": sync_module_states,
                "ignored_modules": ignored_modules,
            },
        )
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision=precision,
            process_group_backend=process_group_backend,
            timeout=check_timeout(timeout) or default_pg_timeout,
        )
        self.state_dict_type = check_choice("state_dict_type", state_dict_type, ("full", "sharded"))
        self.sharding_strategy, self.cpu_offload = options.torch_attributes()  # torch's, as Lightning's
        self._fsdp_options = options
        self._backward_sync_control = NoSyncControl(FullyShardedDataParallel, "hai_fsdp")
        self._wrapped = Wrapped()

    @property
    def mixed_precision_config(self) -> TorchMixedPrecision | None:
        """The mixed precision the wrapper runs, as torch's ``MixedPrecision`` (as Lightning's FSDP exposes it);
        ``None``: the parameters' own dtype."""
        return self._fsdp_options.torch_mixed_precision(self.precision.precision)

    def __repr__(self) -> str:
        return strategy_repr(self, "lightning_haiscale.HaiFSDPStrategy (lightning_haiscale.strategies)")

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        agree_on_inf(self.precision, type(self).__name__)  # 16-mixed: see [Note: fp16 on a split model]

    @override
    def _setup_distributed(self) -> None:
        setup_distributed(self)

    # ---------------------------------------------------------------------------- model

    @override
    def setup_module(self, module: nn.Module) -> FullyShardedDataParallel:
        wrapped = wrap_hai_fsdp(module, self.root_device, self._timeout, self.precision.precision, self._fsdp_options)
        self._wrapped.add(wrapped)
        return wrapped

    @override
    def setup_module_and_optimizers(
        self, module: nn.Module, optimizers: list[Optimizer], scheduler: Any | None = None
    ) -> tuple[nn.Module, list[Optimizer], Any | None]:
        """Shards the module, then points each optimizer at the pieces that replaced its parameters."""
        if any(optimizer.state for optimizer in optimizers):
            raise ValueError("fabric.setup(model, optimizer) needs an optimizer that has not stepped yet")
        names = {id(p): name for name, p in module.named_parameters()}
        wrapped = self.setup_module(module)
        pieces = dict(wrapped.named_parameters())
        for optimizer in optimizers:
            for group in optimizer.param_groups:
                unknown = [p for p in group["params"] if id(p) not in names]
                if unknown:
                    raise ValueError("the optimizer holds tensors that are not the model's parameters")
                group["params"] = [pieces[names[id(p)]] for p in group["params"]]
        return wrapped, optimizers, scheduler

    @override
    def module_to_device(self, module: nn.Module) -> None:
        """The wrapper creates the shards on the root device."""

    @override
    def module_init_context(self, empty_init: bool | None = None) -> AbstractContextManager:
        """``empty_init=True``: on the meta device; sharding materializes one unit at a time."""
        stack = ExitStack()
        if empty_init:
            stack.enter_context(torch.device("meta"))
        stack.enter_context(self.precision.module_init_context())
        return stack

    @override
    def module_sharded_context(self) -> AbstractContextManager:
        return nullcontext()

    @override
    def clip_gradients_norm(
        self,
        module: nn.Module,
        optimizer: Optimizer,
        max_norm: float | int,
        norm_type: float | int = 2.0,
        error_if_nonfinite: bool = True,
    ) -> torch.Tensor:
        """By the norm over every rank's pieces."""
        self.precision.unscale_gradients(optimizer)
        return _sharded(module).clip_grad_norm_(max_norm, norm_type)

    # ---------------------------------------------------------------------- checkpoints

    @override
    def save_checkpoint(
        self,
        path: Any,
        state: dict[str, Any],
        storage_options: Any | None = None,
        filter: dict[str, Callable[[str, Any], bool]] | None = None,
    ) -> None:
        """See ``fabric.fsdp_checkpoint`` [Note: Fabric checkpoints]."""
        fsdp_checkpoint.save(self, path, state, storage_options, filter)

    @override
    def load_checkpoint(
        self, path: Any, state: Any = None, strict: bool = True, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """Into the module and optimizers of ``state`` in place (a module alone: ``fabric.load_raw``); returns what
        they did not take."""
        return fsdp_checkpoint.load(self, path, state, strict, weights_only)

    @override
    def teardown(self) -> None:
        """Closes every wrapper set up (stops its engine), then Fabric's teardown."""
        self._wrapped.close_all()
        super().teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register("hai_fsdp", cls, description="fully sharded data parallel on the hfreduce engine")


def _sharded(module: nn.Module) -> FullyShardedDataParallel:
    if not isinstance(module, FullyShardedDataParallel):
        raise TypeError(
            "hai_fsdp needs the module returned by fabric.setup: this is only possible if the module passed is "
            f"wrapped in `FullyShardedDataParallel` (lightning_haiscale.fsdp's), got {type(module).__name__}"
        )
    return module


register_once(HaiFSDPStrategy, STRATEGY_REGISTRY)
