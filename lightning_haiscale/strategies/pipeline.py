"""``GPipeStrategy`` ("hai_gpipe"), ``PipeDreamStrategy`` ("hai_pipedream"), ``Interleaved1F1BStrategy``
("hai_interleaved_1f1b"): Lightning adapters over ``lightning_haiscale.pipeline``.

The strategy holds the DP x PP topology and the stage surgery (the module's ``nn.Sequential`` is replaced by a
``StageProxy`` of this rank's layers); the step protocol lives in ``strategies.pipeline_step`` (see its
notes on capture and replay and on automatic optimization) and the checkpoint format in
``strategies.pipeline_checkpoint``.

[Note: supported step forms] The network is the LightningModule's one ``nn.Sequential`` attribute (or
``module_name=``). Steps run unmodified through capture and replay: the step must call the network
exactly once (``out = self(x)`` with ``forward`` calling it, or ``self.net(x)``), batch rows must be
independent, ``training_step`` must return the loss tensor (or a dict with ``"loss"``) under automatic
optimization, and values given to ``self.log`` are averaged over microbatches. Anything else raises with
the reason. The loss and logs of the last stage are broadcast to its pipeline and logged on every rank, so
rank 0's progress bar and loggers see them, and ``sync_dist`` over the world averages the data-parallel
replicas; torchmetrics objects are logged by attribute on every rank (they sync themselves).

[Note: forward context] ``forward_context`` (default: a null context) is entered around every training
microbatch's forward. ``CPUOffloadCallback`` sets it in its ``setup`` hook, since the callback's own
hooks cannot bracket forwards whose backwards run inside ``training_step``; the strategy never looks for
callbacks.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any, ClassVar

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.utilities.apply_func import move_data_to_device
from lightning.pytorch.strategies import StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import CombinedLoader
from torch import nn
from typing_extensions import override

from lightning_haiscale.ddp import DistributedDataParallel
from lightning_haiscale.pipeline import GPipe, Interleaved1F1B, PipeDream, Pipeline, make_subgroups, partition
from lightning_haiscale.strategies import pipeline_checkpoint as stage_files
from lightning_haiscale.strategies.arguments import check_choice, check_int
from lightning_haiscale.strategies.parallel import HaiParallelStrategy, register_once
from lightning_haiscale.strategies.pipeline_step import PipelinedStep, StageProxy, capture_inputs

__all__ = ["GPipeStrategy", "Interleaved1F1BStrategy", "PipeDreamStrategy"]

log = logging.getLogger(__name__)


class _PipelineStrategy(HaiParallelStrategy):
    """What the three pipeline strategies share; subclasses only build their pipeline.

    Args:
        chunks: microbatches per batch (must divide the training batch size).
        pp_size: stages per pipeline; ``world_size / pp_size`` pipelines train data parallel (default: one
            pipeline over the world). Pipelines are consecutive ranks (see ``make_subgroups``).
        balance: layers per stage, or ``None`` to balance parameter counts, or ``"time"`` (with
            ``example_inputs``) to balance measured layer time.
        num_model_chunks: model chunks per rank (interleaved schedules).
        checkpoint: activation checkpointing policy of GPipe (``"never"``, ``"always"``, ``"except_last"``).
        module_name: the attribute holding the ``nn.Sequential`` (found when there is exactly one).
        example_inputs: a batch's network inputs, for ``balance="time"``.
        **kwargs: passed to :class:`HaiParallelStrategy`: ``timeout`` (for every collective and point-to-point
            transfer), ``process_group_backend``, and what the Trainer sets.
    """

    strategy_name: ClassVar[str]
    description: ClassVar[str]  # in Lightning's StrategyRegistry
    interleaved: ClassVar[bool] = False  # several model chunks per rank

    def __init__(
        self,
        chunks: int = 4,
        pp_size: int | None = None,
        balance: Sequence[int] | str | None = None,
        num_model_chunks: int = 1,
        checkpoint: str = "never",
        module_name: str | None = None,
        example_inputs: tuple[Any, ...] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self._check_arguments(chunks, pp_size, balance, num_model_chunks, checkpoint, module_name, example_inputs)
        self.chunks, self.pp_size, self.balance = chunks, pp_size, balance
        self.num_model_chunks, self.checkpoint, self.module_name = num_model_chunks, checkpoint, module_name
        self._example_inputs = example_inputs
        self._dp_group: dist.ProcessGroup | None = None
        self._pp_group: dist.ProcessGroup | None = None
        self._stages: list[nn.Module] = []
        self._pipeline: Pipeline | None = None
        self._step: PipelinedStep | None = None
        self._saved_layers: list[str] | None = None
        self._forward_context: Callable[[], AbstractContextManager] = contextlib.nullcontext

    def _check_arguments(
        self,
        chunks: Any,
        pp_size: Any,
        balance: Any,
        num_model_chunks: Any,
        checkpoint: Any,
        module_name: Any,
        example_inputs: Any,
    ) -> None:
        """Each argument's type and range, and the pairs that cannot go together, before anything starts."""
        name = type(self).__name__
        check_int("chunks", chunks, 1, "the number of microbatches per batch, e.g. chunks=4")
        if pp_size is not None:
            check_int("pp_size", pp_size, 1, "stages per pipeline, or pp_size=None for one pipeline over the world")
        check_int("num_model_chunks", num_model_chunks, 1)
        if num_model_chunks != 1 and not self.interleaved:
            raise ValueError(
                f"num_model_chunks={num_model_chunks}: {name} runs one model chunk per rank; use "
                "Interleaved1F1BStrategy for several"
            )
        check_choice("checkpoint", checkpoint, ("never", "always", "except_last"))
        if checkpoint != "never" and not isinstance(self, GPipeStrategy):
            raise ValueError(f"checkpoint={checkpoint!r} is GPipe's activation checkpointing; use GPipeStrategy")
        _check_balance(balance, None if pp_size is None else pp_size * num_model_chunks)
        if module_name is not None and not isinstance(module_name, str):
            raise TypeError(f"module_name={module_name!r} must be the name of the module's nn.Sequential attribute")
        if example_inputs is not None and not isinstance(example_inputs, tuple):
            raise TypeError(f"example_inputs={example_inputs!r} must be a tuple of the network's inputs, e.g. (x,)")

    # ----- topology ----------------------------------------------------------------------------------

    @property
    def stages_per_pipeline(self) -> int:
        return self.pp_size or self.world_size

    @property
    def pp_rank(self) -> int:
        return self.global_rank % self.stages_per_pipeline

    @property
    def dp_rank(self) -> int:
        return self.global_rank // self.stages_per_pipeline

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Every stage of a pipeline reads the same batch: shard by data-parallel rank."""
        return {"num_replicas": self.world_size // self.stages_per_pipeline, "rank": self.dp_rank}

    @property
    def pipeline(self) -> Pipeline | None:
        """The plain-layer pipeline this rank runs (after ``setup``)."""
        return self._pipeline

    @property
    def forward_context(self) -> Callable[[], AbstractContextManager]:
        """A callable returning a context manager, entered around every training microbatch's forward
        (default: a null context); ``CPUOffloadCallback`` sets it. See [Note: forward context]."""
        return self._forward_context

    @forward_context.setter
    def forward_context(self, context: Callable[[], AbstractContextManager]) -> None:
        if not callable(context):
            raise TypeError(f"forward_context={context!r} must be a callable returning a context manager")
        self._forward_context = context
        if self._pipeline is not None:
            self._pipeline.forward_context = context

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        if self.world_size % self.stages_per_pipeline:
            raise ValueError(f"pp_size={self.pp_size} must divide the world size {self.world_size}")
        self._dp_group, self._pp_group = make_subgroups(self.stages_per_pipeline, timeout=self._timeout)

    # ----- model -------------------------------------------------------------------------------------

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting and not self.lightning_module.automatic_optimization:
            raise ValueError(
                f"{type(self).__name__} needs automatic optimization: the schedule runs every microbatch's forward "
                "and backward inside training_step, so manual_backward has nothing to do; set "
                "self.automatic_optimization = True and return the loss from training_step"
            )
        self.accelerator.setup(trainer)
        self._install_proxy()
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self._pipeline = self._build_pipeline(self._wrap_stages(fitting))
        self._pipeline.forward_context = self.forward_context
        module, group, device = self.lightning_module, self._pp_group, self.root_device
        self._step = PipelinedStep(module, self.module_name, self._pipeline, group, device)
        if fitting:
            self._step.take_over_zero_grad()
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if fitting:
            self._optimizer_states_to_device()

    def _install_proxy(self) -> None:
        """Replaces the module's network by a ``StageProxy`` of this rank's layers (once per module)."""
        module = self.lightning_module
        name = self.module_name or _find_network(module)
        network = getattr(module, name)
        if isinstance(network, StageProxy):
            if not self._stages:
                raise RuntimeError(
                    f"{type(module).__name__}.{name} was partitioned by another pipeline strategy; load the full "
                    "checkpoint into a fresh module to train it with a new one"
                )
            return
        if not isinstance(network, nn.Sequential):
            raise TypeError(f"{type(module).__name__}.{name} must be an nn.Sequential, got {type(network).__name__}")
        example_inputs = self._example_inputs
        if self.balance == "time" and example_inputs is None:
            example_inputs = self._first_batch_inputs(name, network)
        if self.balance == "time":  # profile on the device the stages will run on (see partition's note)
            example_inputs = move_data_to_device(example_inputs, self.root_device)
        parts = partition(
            network,
            self.pp_rank,
            self.stages_per_pipeline,
            self.balance,
            self.num_model_chunks,
            example_inputs=example_inputs,
            process_group=self._pp_group,
        )
        self._stages = parts if isinstance(parts, list) else [parts]
        layers = OrderedDict(item for stage in self._stages for item in stage._modules.items())
        setattr(module, name, StageProxy(layers))
        self.module_name = name

    def _first_batch_inputs(self, name: str, network: nn.Sequential) -> tuple[Any, ...]:
        """``balance="time"`` without ``example_inputs``: the network's inputs for the first training batch,
        found by running ``training_step`` up to the network call (as every step is captured)."""
        module = self.lightning_module
        trainer = module.trainer
        if trainer.state.fn != TrainerFn.FITTING:
            raise ValueError(
                f"balance='time' profiles the layers on the first training batch; to {trainer.state.fn} a module "
                "never partitioned by this strategy, pass example_inputs=(a batch's network inputs,)"
            )
        trainer.fit_loop.setup_data()  # the loop reuses it: the dataloader is requested once
        if trainer.train_dataloader is None:
            raise ValueError("balance='time' needs example_inputs=(a batch's network inputs,) or a training dataloader")
        loader = iter(CombinedLoader(trainer.train_dataloader, "max_size_cycle"))
        batch = next(loader)[0]
        proxy = StageProxy(OrderedDict(network._modules.items()))
        setattr(module, name, proxy)
        try:
            inputs = capture_inputs(module, proxy, module.training_step, (batch, 0), {})
        finally:
            setattr(module, name, network)
        if inputs is not None:
            return inputs
        raise RuntimeError(f"training_step never called the network {name!r}, so balance='time' has nothing to time")

    def _wrap_stages(self, fitting: bool) -> list[nn.Module]:
        if not fitting or self.world_size == self.stages_per_pipeline:
            return list(self._stages)
        return [DistributedDataParallel(s, process_group=self._dp_group) for s in self._stages]

    def _build_pipeline(self, stages: list[nn.Module]) -> Pipeline:
        raise NotImplementedError

    @override
    def model_to_device(self) -> None:
        self.model.to(self.root_device)

    @override
    def clip_grad_norm_(self, max_norm: float) -> None:
        self._pipeline.clip_grad_norm_(max_norm)

    # ----- steps -------------------------------------------------------------------------------------

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """Every microbatch's forward and backward (see ``pipeline_step``); the last stage's mean loss."""
        scaler = getattr(self.precision_plugin, "scaler", None)  # 16-mixed: see _agree_on_inf
        with self.precision_plugin.train_step_context():
            return self._step.train(args, kwargs, self.optimizers, scaler)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.val_step_context():
            return self._step.evaluate(self.lightning_module.validation_step, args, kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.test_step_context():
            return self._step.evaluate(self.lightning_module.test_step, args, kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        """The last stage's predictions; ``None`` on the other stages."""
        with self.precision_plugin.predict_step_context():
            return self._step.evaluate(self.lightning_module.predict_step, args, kwargs, publish=False)

    @property
    def _proxy(self) -> StageProxy:
        return getattr(self.lightning_module, self.module_name)

    @override
    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        """The schedule already ran every backward in ``training_step``: only the hooks run here."""
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, self.lightning_module)
        closure_loss = self.precision_plugin.post_backward(closure_loss, self.lightning_module)
        self.post_backward(closure_loss)
        return closure_loss

    @override
    def _gradient_synchronizer(self) -> Pipeline | None:
        return self._pipeline  # block_backward_sync enters its no_sync()

    # ----- checkpoints -------------------------------------------------------------------------------

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The full module's state dict, gathered from the stages of this rank's pipeline."""
        local = {k: v.detach().cpu() for k, v in self.lightning_module.state_dict().items()}
        if self.stages_per_pipeline == 1:
            return local
        parts: list[Any] = [None] * self.stages_per_pipeline
        dist.all_gather_object(parts, local, group=self._pp_group)
        return {k: v for part in parts for k, v in part.items()}

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: str | os.PathLike, storage_options: Any | None = None
    ) -> None:
        """See [Note: stage files] and [Note: one save, many files] in ``pipeline_checkpoint``."""
        save_id = self.broadcast(secrets.token_hex(8))
        if self.dp_rank == 0:
            stage = stage_files.stage_checkpoint(self._proxy.state_dict(), self.module_name, checkpoint, save_id)
            uncommitted = stage_files.stage_path(filepath, self.pp_rank, save_id)  # checkpoint_io creates the folder
            self.checkpoint_io.save_checkpoint(stage, uncommitted, storage_options)
        self.barrier()
        if self.is_global_zero:
            full = stage_files.full_checkpoint(checkpoint, self.stages_per_pipeline, self.num_model_chunks, save_id)
            self.checkpoint_io.save_checkpoint(full, filepath, storage_options=storage_options)
        self.barrier()
        if self.dp_rank == 0:
            os.replace(uncommitted, stage_files.stage_path(filepath, self.pp_rank))
            for leftover in stage_files.stage_files_of(filepath, self.pp_rank)[1:]:
                os.remove(leftover)

    @override
    def remove_checkpoint(self, filepath: str | os.PathLike) -> None:
        for stage_file in stage_files.stage_files_of(filepath, self.pp_rank) if self.dp_rank == 0 else []:
            os.remove(stage_file)
        super().remove_checkpoint(filepath)

    @override
    def load_checkpoint(self, checkpoint_path: str | os.PathLike, weights_only: bool | None = None) -> dict[str, Any]:
        """The full checkpoint, with this stage's optimizer states when its stage file matches this layout."""
        checkpoint = dict(self.checkpoint_io.load_checkpoint(checkpoint_path, weights_only=weights_only))
        save_id = checkpoint.get("pipeline", {}).get("save_id")
        self._saved_layers, checkpoint["optimizer_states"] = stage_files.load_stage_file(
            self.checkpoint_io, checkpoint_path, self.pp_rank, weights_only, save_id
        )
        return checkpoint

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Restores optimizers only from a stage file of this very layout (same layers on this rank)."""
        if self._saved_layers != sorted(self._proxy.state_dict()):
            log.info("the checkpoint has no optimizer states for this stage layout: optimizers start fresh")
            return
        super().load_optimizer_state_dict(checkpoint)

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        """Loads this stage's slice of a full state dict (from any number of stages, or none)."""
        module = self.lightning_module
        state = stage_files.stage_slice(checkpoint["state_dict"], module.state_dict().keys(), strict)
        module.load_state_dict(state, strict=strict)

    @override
    def teardown(self) -> None:
        for stage in self._pipeline.stages if self._pipeline is not None else []:
            if isinstance(stage, DistributedDataParallel):
                stage.close()
        if self._step is not None:
            self._step.close()
        super().teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(cls.strategy_name, cls, description=cls.description)


class GPipeStrategy(_PipelineStrategy):
    """GPipe: all forwards, then all backwards; ``checkpoint`` ("never", "always", "except_last")."""

    strategy_name = "hai_gpipe"
    description = "pipeline parallel, GPipe schedule (lightning_haiscale.pipeline)"

    @override
    def _build_pipeline(self, stages: list[nn.Module]) -> Pipeline:
        return GPipe(stages[0], self.chunks, self._pp_group, checkpoint=self.checkpoint)


class PipeDreamStrategy(_PipelineStrategy):
    """PipeDream-flush (1F1B): stage ``r`` of ``S`` keeps at most ``S - r`` microbatches' activations."""

    strategy_name = "hai_pipedream"
    description = "pipeline parallel, 1F1B schedule (lightning_haiscale.pipeline)"

    @override
    def _build_pipeline(self, stages: list[nn.Module]) -> Pipeline:
        return PipeDream(stages[0], self.chunks, self._pp_group)


class Interleaved1F1BStrategy(_PipelineStrategy):
    """Interleaved 1F1B with ``num_model_chunks`` chunks per rank (default 2); ``chunks`` a multiple of pp_size."""

    strategy_name = "hai_interleaved_1f1b"
    description = "pipeline parallel, interleaved 1F1B schedule (lightning_haiscale.pipeline)"
    interleaved = True

    def __init__(self, *args: Any, num_model_chunks: int = 2, **kwargs: Any) -> None:
        super().__init__(*args, num_model_chunks=num_model_chunks, **kwargs)

    @override
    def _build_pipeline(self, stages: list[nn.Module]) -> Pipeline:
        return Interleaved1F1B(stages, self.chunks, self._pp_group)


def _check_balance(balance: Any, parts: int | None) -> None:
    if balance is None or balance == "time":
        return
    if isinstance(balance, str) or not isinstance(balance, Sequence):
        raise ValueError(f"balance={balance!r} must be None, 'time' or a list of layer counts per stage")
    if not all(isinstance(c, int) and not isinstance(c, bool) and c > 0 for c in balance):
        raise ValueError(f"balance={list(balance)} must hold positive integer layer counts")
    if parts is not None and len(balance) != parts:
        raise ValueError(f"balance={list(balance)} must have pp_size x num_model_chunks = {parts} layer counts")


def _find_network(module: nn.Module) -> str:
    names = [n for n, child in module.named_children() if isinstance(child, nn.Sequential)]
    if len(names) != 1:
        raise ValueError(
            f"{type(module).__name__} has {len(names)} nn.Sequential attributes ({names}); pipeline strategies need "
            "exactly one, or module_name= naming the network"
        )
    return names[0]


for _strategy in (GPipeStrategy, PipeDreamStrategy, Interleaved1F1BStrategy):
    register_once(_strategy, StrategyRegistry)
