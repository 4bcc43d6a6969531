"""``HaiDDPStrategy`` ("hai_ddp"): Lightning's DDP strategy with haiscale's DistributedDataParallel."""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from torch.distributed.constants import default_pg_timeout
from torch.nn import Module
from typing_extensions import override

from lightning_haiscale.adapter.arguments import check_choice, check_timeout, strategy_repr
from lightning_haiscale.adapter.checkpoint_io import check_file_targets, optimizer_states_of, save_file
from lightning_haiscale.adapter.collectives import ExitSafeCollectives
from lightning_haiscale.adapter.ddp_options import START_METHODS, TORCH_DDP_ONLY, hai_ddp_options, wrap_hai_ddp
from lightning_haiscale.adapter.process_group import init_dist_connection
from lightning_haiscale.adapter.registry import register_once
from lightning_haiscale.ddp import DistributedDataParallel
from lightning_haiscale.hfreduce import abort_job

__all__ = ["HaiDDPStrategy"]

_UNUSED_PARAMETERS = "got no gradient in this backward"


class HaiDDPStrategy(ExitSafeCollectives, DDPStrategy):
    """Data parallel whose gradients are averaged by the hfreduce engine while backward runs.

    Everything else is Lightning's ``DDPStrategy``: launchers, samplers, ``num_nodes`` (several hosts take
    the engine's hierarchical path), checkpoints (the same format as ``"ddp"``), CPU and CUDA, and
    ``block_backward_sync`` (it enters the wrapper's ``no_sync()``, as :func:`~.parallel.no_sync_of` does). The
    parameters are ``DDPStrategy``'s, in its order, then hai_ddp's own; the explicit signature is what
    LightningCLI and ``--help`` show (``DDPStrategy``'s ``**kwargs`` lead into torch DDP's options).

    Args:
        accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin: as for
            ``DDPStrategy`` (the Trainer sets what is not given).
        ddp_comm_state, ddp_comm_hook, ddp_comm_wrapper, model_averaging_period: torch DDP's communication
            hooks and model averaging, which hai_ddp replaces: only ``None`` is accepted (they keep
            ``DDPStrategy``'s positions).
        process_group_backend: torch.distributed backend (default: gloo on CPU, nccl on CUDA).
        timeout: deadline of the process group and of every wait of the hfreduce engine.
        start_method: ``"popen"`` (Lightning's subprocess launcher), ``"spawn"``, ``"fork"``, ``"forkserver"``.
        bucket_cap_mb: the most MiB of gradients in one all-reduce.
        find_unused_parameters: allow parameters that get no gradient in some steps.
        broadcast_buffers: copy rank 0's buffers to every rank before each forward.
        **torch_ddp_options: torch DDP's other options (``static_graph``, ``gradient_as_bucket_view``, ...):
            refused with ``TypeError`` rather than silently ignored.
    """

    strategy_name = "hai_ddp"

    def __init__(
        self,
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        ddp_comm_state: None = None,
        ddp_comm_hook: None = None,
        ddp_comm_wrapper: None = None,
        model_averaging_period: None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        bucket_cap_mb: float = 25,
        find_unused_parameters: bool = False,
        broadcast_buffers: bool = True,
        **torch_ddp_options: Any,
    ) -> None:
        refused = sorted(torch_ddp_options) + [
            name
            for name, value in zip(
                TORCH_DDP_ONLY, (ddp_comm_state, ddp_comm_hook, ddp_comm_wrapper, model_averaging_period), strict=True
            )
            if value is not None
        ]
        hai_kwargs = hai_ddp_options(refused, bucket_cap_mb, find_unused_parameters, broadcast_buffers)
        check_choice("start_method", start_method, START_METHODS)
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=check_timeout(timeout),
            start_method=start_method,
        )
        self._hai_kwargs = hai_kwargs

    def __repr__(self) -> str:
        return strategy_repr(self, "lightning_haiscale.fabric.HaiDDPStrategy")

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        """True: the weights load once ``setup`` has given the module its training dtype. Loaded before, as
        Lightning's ``ddp`` loads them, a ``"64-true"`` checkpoint went through the float32 module first and
        resumed rounded (about 1e-8 off)."""
        return True

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Lightning's, with the checks of its FSDP when fitting (its ``ddp`` zips the states with the optimizers,
        dropping extra ones silently): one state per optimizer, and an earlier pipeline file names its fix."""
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        fitting = self.lightning_module is not None and self.lightning_module.trainer.state.fn == TrainerFn.FITTING
        if fitting and ("optimizer_states" in checkpoint or "pipeline" in checkpoint):
            optimizer_states_of(checkpoint, checkpoint_path, len(self.optimizers))
        return checkpoint

    @override
    def _setup_model(self, model: Module) -> DistributedDataParallel:
        return wrap_hai_ddp(model, self.determine_ddp_device_ids(), self._timeout, self._hai_kwargs)

    @override
    def setup_distributed(self) -> None:
        """As ``DDPStrategy``'s, on a store that survives torchrun's restarts (see :func:`.init_dist_connection`)."""
        reset_seed()
        self.set_world_ranks()
        self._process_group_backend = self._get_process_group_backend()
        environment = self.cluster_environment
        if environment is None:
            raise RuntimeError("HaiDDPStrategy needs a cluster environment; the Trainer sets it")
        init_dist_connection(environment, self._process_group_backend, self._timeout, self.root_device)

    @override
    def configure_ddp(self) -> None:
        """Wraps the module. Lightning's version then registers torch DDP's communication hooks, asserting
        on CUDA that the model is torch's ``DistributedDataParallel``: hai_ddp refuses those hooks at
        construction (its engine is not torch's reducer), so there is nothing to register."""
        self.model = self._setup_model(self.model)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register("hai_ddp", cls, description="data parallel on the hfreduce shared-memory engine")
        strategy_registry.register(
            "hai_ddp_find_unused_parameters_true",
            cls,
            description="hai_ddp with find_unused_parameters=True",
            find_unused_parameters=True,
        )
        # Lightning's spawn launcher: trained weights come back to the launching process.
        strategy_registry.register(
            "hai_ddp_spawn",
            cls,
            description="hai_ddp with processes started by torch.multiprocessing.spawn",
            start_method="spawn",
        )

    @override
    def on_exception(self, exception: BaseException) -> None:
        """Ends every rank's waits on this job's engines at once, naming this rank (see ``hfreduce.abort``); adds
        Lightning's hint for unused parameters to the engine's error (which names them)."""
        abort_job(exception)
        message = exception.args[0] if exception.args else None
        if isinstance(message, str) and _UNUSED_PARAMETERS in message:
            exception.args = (f"{message}\n{_LIGHTNING_UNUSED_HINT}", *exception.args[1:])

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """Rank 0 writes one file that a kill leaves as the previous or the new one (see ``adapter.checkpoint_io``); a
        directory at ``filepath`` raises on every rank, as Lightning's ``FSDPStrategy``."""
        check_file_targets(self.broadcast, self.is_global_zero, [filepath])
        if self.is_global_zero:
            save_file(self.checkpoint_io, checkpoint, filepath, storage_options)

    @override
    def teardown(self) -> None:
        """Closes the wrapper (stops its engine), then Lightning's teardown."""
        if isinstance(self.model, DistributedDataParallel):
            self.model.close()
            self.model = self.lightning_module
        super().teardown()


# Lightning's DDPStrategy.on_exception text for the same case, naming hai_ddp's spellings.
_LIGHTNING_UNUSED_HINT = (
    "It looks like your LightningModule has parameters that were not used in producing the loss returned by "
    "training_step. If this is intentional, you must enable the detection of unused parameters in DDP, either by "
    "setting the string value `strategy='hai_ddp_find_unused_parameters_true'` or by setting the flag in the "
    "strategy with `strategy=HaiDDPStrategy(find_unused_parameters=True)`."
)


register_once(HaiDDPStrategy, StrategyRegistry)
