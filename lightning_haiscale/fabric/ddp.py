"""Fabric's ``"hai_ddp"``: Lightning Fabric's DDP strategy with haiscale's DistributedDataParallel."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any, Literal

import torch
from lightning.fabric.accelerators import Accelerator
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment, Precision
from lightning.fabric.strategies import STRATEGY_REGISTRY, DDPStrategy
from torch.distributed.constants import default_pg_timeout
from torch.nn import Module
from typing_extensions import override

from lightning_haiscale.adapter.arguments import check_choice, check_timeout, strategy_repr
from lightning_haiscale.adapter.checkpoint_io import check_file_targets, save_file
from lightning_haiscale.adapter.collectives import ExitSafeCollectives
from lightning_haiscale.adapter.ddp_options import START_METHODS, hai_ddp_options, wrap_hai_ddp
from lightning_haiscale.adapter.registry import register_once
from lightning_haiscale.ddp import DistributedDataParallel
from lightning_haiscale.fabric.shared import NoSyncControl, Wrapped, setup_distributed

__all__ = ["HaiDDPStrategy"]


class HaiDDPStrategy(ExitSafeCollectives, DDPStrategy):
    """Fabric data parallel on the hfreduce engine: ``Fabric(strategy="hai_ddp")``.

    The parameters are Fabric ``DDPStrategy``'s, in its order, then hai_ddp's own (see
    :class:`lightning_haiscale.HaiDDPStrategy`); torch DDP's options raise ``TypeError``.
    """

    def __init__(
        self,
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        bucket_cap_mb: float = 25,
        find_unused_parameters: bool = False,
        broadcast_buffers: bool = True,
        **torch_ddp_options: Any,
    ) -> None:
        options = hai_ddp_options(sorted(torch_ddp_options), bucket_cap_mb, find_unused_parameters, broadcast_buffers)
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision=precision,
            process_group_backend=process_group_backend,
            timeout=check_timeout(timeout),
            start_method=check_choice("start_method", start_method, START_METHODS),
        )
        self._hai_kwargs = options
        self._backward_sync_control = NoSyncControl(DistributedDataParallel, "hai_ddp")
        self._wrapped = Wrapped()

    def __repr__(self) -> str:
        return strategy_repr(self, "lightning_haiscale.HaiDDPStrategy (lightning_haiscale.strategies)")

    @override
    def _setup_distributed(self) -> None:
        setup_distributed(self)

    @override
    def setup_module(self, module: Module) -> DistributedDataParallel:
        wrapped = wrap_hai_ddp(module, self._determine_ddp_device_ids(), self._timeout, self._hai_kwargs)
        self._wrapped.add(wrapped)
        return wrapped

    @override
    def get_module_state_dict(self, module: Module) -> dict[str, Any]:
        return super().get_module_state_dict(_unwrap(module))

    @override
    def load_module_state_dict(self, module: Module, state_dict: dict[str, Any], strict: bool = True) -> None:
        super().load_module_state_dict(_unwrap(module), state_dict, strict=strict)

    @override
    def save_checkpoint(
        self,
        path: Any,
        state: dict[str, Any],
        storage_options: Any | None = None,
        filter: dict[str, Callable[[str, Any], bool]] | None = None,
    ) -> None:
        """One file, written by rank 0 so that a kill leaves the previous file or the new one (see ``save_file``)."""
        check_file_targets(self.broadcast, self.is_global_zero, [path])
        checkpoint = self._convert_stateful_objects_in_state(state, filter=filter or {})
        if self.is_global_zero:
            save_file(self.checkpoint_io, checkpoint, path, storage_options)

    @override
    def teardown(self) -> None:
        """Closes every wrapper set up (stops its engine), then Fabric's teardown."""
        self._wrapped.close_all()
        super().teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register("hai_ddp", cls, description="data parallel on the hfreduce shared-memory engine")
        strategy_registry.register(
            "hai_ddp_spawn", cls, description="hai_ddp started by torch.multiprocessing.spawn", start_method="spawn"
        )
        strategy_registry.register(
            "hai_ddp_find_unused_parameters_true",
            cls,
            description="hai_ddp with find_unused_parameters=True",
            find_unused_parameters=True,
        )


def _unwrap(module: Module) -> Module:
    return module.module if isinstance(module, DistributedDataParallel) else module


register_once(HaiDDPStrategy, STRATEGY_REGISTRY)
