"""``HaiDDPStrategy`` ("hai_ddp"): Lightning's DDP strategy with haiscale's DistributedDataParallel."""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager
from typing import Any

from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from torch.nn import Module
from typing_extensions import override

from lightning_haiscale.ddp import DistributedDataParallel

__all__ = ["HaiDDPStrategy"]

_TORCH_DDP_ONLY = ("ddp_comm_state", "ddp_comm_hook", "ddp_comm_wrapper", "model_averaging_period")


class HaiDDPStrategy(DDPStrategy):
    """Data parallel whose gradients are averaged by the hfreduce engine while backward runs.

    Everything else is Lightning's ``DDPStrategy``: launchers, samplers, ``num_nodes`` (several hosts take
    the engine's hierarchical path), checkpoints (the same format as ``"ddp"``), CPU and CUDA.

    Args:
        bucket_cap_mb: the most MiB of gradients in one all-reduce.
        find_unused_parameters: allow parameters that get no gradient in some steps.
        broadcast_buffers: copy rank 0's buffers to every rank before each forward.
        **kwargs: passed to ``DDPStrategy`` (``accelerator``, ``start_method``, ``timeout``, ...); torch DDP's
            own options (``static_graph``, ``ddp_comm_hook``, ...) raise ``TypeError`` rather than being ignored.
    """

    strategy_name = "hai_ddp"

    def __init__(
        self,
        bucket_cap_mb: float = 25,
        find_unused_parameters: bool = False,
        broadcast_buffers: bool = True,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        ignored = sorted(self._ddp_kwargs) + [name for name in _TORCH_DDP_ONLY if kwargs.get(name) is not None]
        if ignored:
            raise TypeError(
                f"HaiDDPStrategy does not take {ignored}: those configure torch's DistributedDataParallel, which "
                "hai_ddp replaces; it takes bucket_cap_mb, find_unused_parameters and broadcast_buffers"
            )
        self._hai_kwargs = {
            "bucket_cap_mb": bucket_cap_mb,
            "find_unused_parameters": find_unused_parameters,
            "broadcast_buffers": broadcast_buffers,
        }

    @override
    def _setup_model(self, model: Module) -> DistributedDataParallel:
        return DistributedDataParallel(model, device_ids=self.determine_ddp_device_ids(), **self._hai_kwargs)

    @override
    def configure_ddp(self) -> None:
        """Wraps the module. Lightning's version then registers torch DDP's communication hooks, asserting
        on CUDA that the model is torch's ``DistributedDataParallel``: hai_ddp refuses those hooks at
        construction (its engine is not torch's reducer), so there is nothing to register."""
        self.model = self._setup_model(self.model)

    @override
    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        if isinstance(self.model, DistributedDataParallel):
            with self.model.no_sync():
                yield
        else:
            yield

    @override
    def teardown(self) -> None:
        if isinstance(self.model, DistributedDataParallel):
            self.model.reducer.stop()
            self.model = self.lightning_module
        super().teardown()


def _register() -> None:
    if "hai_ddp" not in StrategyRegistry:
        StrategyRegistry.register(
            "hai_ddp", HaiDDPStrategy, description="data parallel on the hfreduce shared-memory engine"
        )
    if "hai_ddp_spawn" not in StrategyRegistry:  # Lightning's spawn launcher: trained weights come back
        StrategyRegistry.register(
            "hai_ddp_spawn",
            HaiDDPStrategy,
            description="hai_ddp with processes started by torch.multiprocessing.spawn",
            start_method="spawn",
        )


_register()
