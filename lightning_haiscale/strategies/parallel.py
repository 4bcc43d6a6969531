"""``HaiParallelStrategy``: one process per device in a ``torch.distributed`` world, with no DDP wrapper.

What ``hai_fsdp`` and the pipeline strategies share: topology, launch, the process group, the collectives
Lightning calls for logging and checkpoints (``adapter.collectives``, which every strategy of both faces mixes
in), and ``block_backward_sync``. Lightning's ``DDPStrategy`` does the same work, but around torch's
``DistributedDataParallel``; Lightning's own FSDP and ModelParallel strategies each repeat it, and so would we
without this base.

What every Trainer strategy of this package shares lives here too: :func:`no_sync_of`. The private Lightning
helpers the Trainer strategies use (the subprocess launcher, ``_optimizers_to_device``,
``Strategy._reset_optimizers_and_schedulers``) are the ones every Lightning strategy uses; they are imported or
called in this one module so a Lightning upgrade touches one place (the process group's own,
``_init_dist_connection``, in ``adapter.process_group``, which both faces share).
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Generator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from datetime import timedelta
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.utilities.distributed import (
    _get_default_process_group_backend_for_device,
)
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.rank_zero import rank_zero_only as fabric_rank_zero_only
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning.pytorch.utilities.types import DistributedDataParallel as _HasNoSync
from torch.distributed.constants import default_pg_timeout
from typing_extensions import override

from lightning_haiscale.adapter.arguments import check_timeout
from lightning_haiscale.adapter.checkpoint_io import check_file_targets, save_file
from lightning_haiscale.adapter.collectives import ExitSafeCollectives
from lightning_haiscale.adapter.precision import agree_on_inf
from lightning_haiscale.adapter.process_group import init_dist_connection
from lightning_haiscale.hfreduce import abort_job

__all__ = ["HaiParallelStrategy", "no_sync_of"]


class HaiParallelStrategy(ExitSafeCollectives, ParallelStrategy):
    """A process per device, started like ``"ddp"`` (torchrun, SLURM, or Lightning's subprocess launcher).

    Args:
        timeout: deadline of the process group (and, in subclasses, of the engine's waits).
        process_group_backend: torch.distributed backend (default: gloo on CPU, nccl on CUDA).
        accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin: set by the
            Trainer, as for every Lightning strategy.
    """

    def __init__(
        self,
        timeout: timedelta = default_pg_timeout,
        process_group_backend: str | None = None,
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
    ) -> None:
        super().__init__(accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin)
        self._timeout = check_timeout(timeout) or default_pg_timeout
        if process_group_backend is not None and not isinstance(process_group_backend, str):
            raise TypeError(f"process_group_backend={process_group_backend!r} must be a name such as 'gloo' or 'nccl'")
        self._process_group_backend = process_group_backend
        self._num_nodes = 1

    @property
    @override
    def root_device(self) -> torch.device:
        if not self.parallel_devices:
            raise RuntimeError(f"{type(self).__name__} has no devices yet; the Trainer sets them")
        return self.parallel_devices[self.local_rank]

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def is_distributed(self) -> bool:
        """Makes Lightning inject a ``DistributedSampler`` and honor ``self.log(sync_dist=True)``.

        Lightning treats only its own DDP/FSDP/DeepSpeed/ModelParallel strategies as distributed otherwise:
        without this, every rank would see the whole dataset and ``sync_dist`` would be silently local.
        """
        return True

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.num_nodes * self.num_processes, "rank": self.global_rank}

    @property
    def process_group_backend(self) -> str:
        return self._process_group_backend or _get_default_process_group_backend_for_device(self.root_device)

    @override
    def _configure_launcher(self) -> None:
        self._launcher = _SubprocessScriptLauncher(self._environment(), self.num_processes, self.num_nodes)

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        """True: checkpoints load once ``setup`` has built the model as it trains (sharded, cut into stages, in
        its training dtype). Loaded before, as Lightning's ``ddp`` loads them, a ``"64-true"`` checkpoint went
        through the float32 module and resumed rounded (about 1e-8 off)."""
        return True

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        reset_seed()
        self.set_world_ranks()
        init_dist_connection(self._environment(), self.process_group_backend, self._timeout, self.root_device)

    def set_world_ranks(self) -> None:
        environment = self._environment()
        environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
        environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = fabric_rank_zero_only.rank = self.global_rank

    def _environment(self) -> ClusterEnvironment:
        if self.cluster_environment is None:
            raise RuntimeError(f"{type(self).__name__} needs a cluster environment; the Trainer sets it")
        return self.cluster_environment

    @override
    def setup_precision_plugin(self) -> None:
        super().setup_precision_plugin()
        self._agree_on_inf()
        # Trainer(gradient_clip_val=) clips through the precision plugin with torch's clip_grad_norm_, which
        # would see only this rank's part of the model: route it to the norm over every part.
        self.precision_plugin.clip_grad_by_norm = self._clip_grad_by_norm  # type: ignore[method-assign]

    def _agree_on_inf(self) -> None:
        """16-mixed: makes the loss scaler decide to skip a step on every rank alike (see agree_on_inf)."""
        if isinstance(self.precision_plugin, MixedPrecision):
            agree_on_inf(self.precision_plugin, type(self).__name__)

    def _clip_grad_by_norm(self, optimizer: torch.optim.Optimizer, clip_val: float) -> None:
        self.clip_grad_norm_(clip_val)

    @abstractmethod
    def clip_grad_norm_(self, max_norm: float) -> None:
        """Clips the gradients of the whole model, of which this rank holds a part, by its global norm."""

    @override
    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Gradient accumulation: backwards inside skip the gradient all-reduce (see :func:`no_sync_of`)."""
        with no_sync_of(self._gradient_synchronizer()):
            yield

    def _gradient_synchronizer(self) -> Any:
        """What averages the gradients over the ranks: the wrapped model (a pipeline strategy: its pipeline)."""
        return self.model

    def _reset_optimizers(self) -> None:
        """Forgets the optimizers of an earlier fit before ``setup_optimizers`` builds new ones (Lightning's
        private ``Strategy._reset_optimizers_and_schedulers``, as its FSDP strategy calls it)."""
        self._reset_optimizers_and_schedulers()

    def _optimizer_states_to_device(self) -> None:
        """Moves the optimizers' states to the root device (Lightning's private ``_optimizers_to_device``, as
        ``Strategy.setup`` calls it)."""
        _optimizers_to_device(self.optimizers, self.root_device)

    @override
    def on_exception(self, exception: BaseException) -> None:
        """Ends every rank's waits on this job's engines at once, naming this rank (see ``hfreduce.abort``)."""
        abort_job(exception)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """Rank 0 writes one file that a kill leaves as the previous or the new one (see ``adapter.checkpoint_io``); a
        directory at ``filepath`` raises on every rank, as Lightning's ``FSDPStrategy``."""
        check_file_targets(self.broadcast, self.is_global_zero, [filepath])
        if self.is_global_zero:
            save_file(self.checkpoint_io, checkpoint, filepath, storage_options)


def no_sync_of(module: Any) -> AbstractContextManager[None]:
    """``module.no_sync()`` if it has one (our DDP, FSDP and pipeline wrappers), else a null context.

    The one mechanism behind every ``block_backward_sync`` here: Lightning's ``ParallelStrategy`` makes the same
    check (its runtime-checkable ``DistributedDataParallel`` protocol) for ``hai_ddp``, which inherits it. Before
    setup the model is the bare LightningModule, which has no ``no_sync``: nothing to block.
    """
    return module.no_sync() if isinstance(module, _HasNoSync) else nullcontext()
