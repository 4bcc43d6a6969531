"""``GPipeStrategy`` ("hai_gpipe"), ``PipeDreamStrategy`` ("hai_pipedream"), ``Interleaved1F1BStrategy``
("hai_interleaved_1f1b"): Lightning adapters over ``lightning_haiscale.pipeline``.

The strategy holds the DP x PP topology and hands the rest to modules named for their idea: finding the network
and cutting it (``strategies.pipeline_network``: a Sequential between its layers, any other module between
its blocks), the step protocol (``strategies.pipeline_step``: capture and replay, automatic optimization), the
checkpoint format (``strategies.pipeline_checkpoint``) and the arguments' checks.

[Note: supported step forms] The network is the LightningModule's one ``nn.Sequential`` attribute, the
attribute holding the largest block list, or ``module_name=`` / ``split_points=``. Steps run unmodified
through capture and replay: the step must call the network exactly once (``out = self(x)`` with
``forward`` calling it, ``self.net(x)``, or ``self.model(input_ids=x, labels=y).loss``), batch rows must be
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
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any, ClassVar

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.utilities.apply_func import move_data_to_device
from lightning.pytorch.strategies import StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn
from typing_extensions import override

from lightning_haiscale.adapter.registry import register_once
from lightning_haiscale.clip_grad import clip_grad_norm_
from lightning_haiscale.ddp import DistributedDataParallel
from lightning_haiscale.fsdp import FullyShardedDataParallel
from lightning_haiscale.pipeline import GPipe, Interleaved1F1B, PipeDream, Pipeline
from lightning_haiscale.pipeline.pipelines import recorded_ties
from lightning_haiscale.pipeline.ties import ties_within_a_rank
from lightning_haiscale.rank_layout import RankGroups, RankLayout
from lightning_haiscale.strategies.parallel import HaiParallelStrategy
from lightning_haiscale.strategies.pipeline_arguments import check_pipeline_arguments
from lightning_haiscale.strategies.pipeline_checkpoint import LoadedCheckpoint, PipelineCheckpoints
from lightning_haiscale.strategies.pipeline_network import Network, find_network, first_batch_inputs, split_network
from lightning_haiscale.strategies.pipeline_sharding import ShardedStages, check_data_parallel, sharded_layout
from lightning_haiscale.strategies.pipeline_step import ForwardStandIn, PipelinedStep, StageProxy

__all__ = ["GPipeStrategy", "Interleaved1F1BStrategy", "PipeDreamStrategy"]


class _PipelineStrategy(PipelineCheckpoints, HaiParallelStrategy):
    """What the three pipeline strategies share; subclasses only build their pipeline.

    Args:
        chunks: microbatches per batch (must divide the training batch size).
        pp_size: stages per pipeline; ``world_size / pp_size`` pipelines train data parallel (default: one
            pipeline over the world). Pipelines are consecutive ranks (see ``RankLayout``).
        balance: layers per stage, or ``None`` to balance parameter counts, or ``"time"`` (with
            ``example_inputs``) to balance measured layer time.
        num_model_chunks: model chunks per rank (interleaved schedules).
        checkpoint: activation checkpointing policy of GPipe (``"never"``, ``"always"``, ``"except_last"``).
        module_name: the attribute holding the network (found when there is exactly one ``nn.Sequential``, else
            the attribute holding the largest block list).
        example_inputs: a batch's network inputs, for ``balance="time"``.
        split_points: names of the blocks that begin each stage after the first, from the LightningModule
            (``["model.transformer.h.6"]``): cuts any module at its blocks (see ``pipeline_network``).
        data_parallel: how the ``world_size / pp_size`` pipelines train together: ``"ddp"`` replicates each
            stage, ``"fsdp"`` shards its parameters, gradients and optimizer state over them (PP x FSDP, see
            ``pipeline_sharding``).
        sharding_strategy, auto_wrap_policy, activation_checkpointing_policy, device_mesh: with
            ``data_parallel="fsdp"``, ``hai_fsdp``'s: ``FULL_SHARD`` (default), ``SHARD_GRAD_OP`` or
            ``HYBRID_SHARD`` (a stage sharded within a host, replicated across hosts; ``device_mesh=(replicate,
            shard)`` over the pipelines sets the split), the units of each stage, the blocks recomputed in backward.
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
        split_points: Sequence[str] | None = None,
        data_parallel: str = "ddp",
        sharding_strategy: Any = None,
        auto_wrap_policy: Any = None,
        activation_checkpointing_policy: Any = None,
        device_mesh: tuple[int, int] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        check_pipeline_arguments(
            type(self).__name__, self.interleaved, isinstance(self, GPipeStrategy), chunks=chunks, pp_size=pp_size,
            balance=balance, num_model_chunks=num_model_chunks, checkpoint=checkpoint, module_name=module_name,
            example_inputs=example_inputs, split_points=split_points,
        )  # fmt: skip
        sharding = {
            "sharding_strategy": sharding_strategy,
            "auto_wrap_policy": auto_wrap_policy,
            "activation_checkpointing_policy": activation_checkpointing_policy,
            "device_mesh": device_mesh,
        }
        self._sharding = check_data_parallel(type(self).__name__, data_parallel, sharding)
        self.data_parallel = data_parallel
        self.split_points = list(split_points) if split_points is not None else None
        self.chunks, self.pp_size, self.balance = chunks, pp_size, balance
        self.num_model_chunks, self.checkpoint, self.module_name = num_model_chunks, checkpoint, module_name
        self._example_inputs = example_inputs
        self._dp_group: dist.ProcessGroup | None = None
        self._pp_group: dist.ProcessGroup | None = None
        self._stages: list[nn.Module] = []
        self._pipeline: Pipeline | None = None
        self._step: PipelinedStep | None = None
        self._saved_layers: list[str] | None = None
        self._loaded: LoadedCheckpoint | None = None  # what load_checkpoint read
        self._network: Network | None = None
        self._layout: RankLayout | None = None  # after setup_environment (hybrid sharding asks the hosts)
        self._groups: RankGroups | None = None
        self._sharded: ShardedStages | None = None  # the stages as sharded by data_parallel="fsdp"
        self._forward_context: Callable[[], AbstractContextManager] = contextlib.nullcontext

    # ----- topology ----------------------------------------------------------------------------------

    @property
    def rank_layout(self) -> RankLayout:
        """Where each rank sits: ``world_size / pp_size`` pipelines of ``pp_size`` consecutive ranks (and, for
        hybrid sharding, their replicas; known after ``setup_environment``)."""
        return self._layout or RankLayout(self.world_size, pp_size=self.stages_per_pipeline)

    @property
    def stages_per_pipeline(self) -> int:
        return self.pp_size or self.world_size

    @property
    def pp_rank(self) -> int:
        return self.rank_layout.stage(self.global_rank)

    @property
    def dp_rank(self) -> int:
        return self.rank_layout.dp_rank(self.global_rank)

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Every stage of a pipeline reads the same batch: shard by data-parallel rank."""
        return {"num_replicas": self.rank_layout.dp_size, "rank": self.dp_rank}

    @property
    def pp_group(self) -> dist.ProcessGroup | None:
        """This rank's pipeline's process group (after ``setup_environment``)."""
        return self._pp_group

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
        layout = RankLayout(self.world_size, pp_size=self.stages_per_pipeline)
        if self._sharding is not None:
            layout = sharded_layout(self._sharding, self.world_size, self.stages_per_pipeline)
        self._layout, self._groups = layout, layout.groups(self._timeout)
        self._dp_group, self._pp_group = self._groups.data_parallel, self._groups.pipeline

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
        self.precision_plugin.convert_module(self.model)  # first: the split's traced call runs as training will
        self._install_proxy()
        self.model_to_device()
        self._pipeline = self._build_pipeline(self._wrap_stages(fitting))
        self._pipeline.forward_context = self.forward_context
        module, group, device = self.lightning_module, self._pp_group, self.root_device
        self._step = PipelinedStep(module, self.module_name, self._network.proxy, self._pipeline, group, device)
        if fitting:
            self._step.take_over_zero_grad()
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if fitting:
            self._optimizer_states_to_device()

    def _install_proxy(self) -> None:
        """Cuts the module's network into this rank's stages (once per module); see ``pipeline_network``."""
        module = self.lightning_module
        if self._network is not None:
            return
        name = find_network(module, self.module_name, self.split_points)
        network = getattr(module, name)
        if isinstance(network, StageProxy) or isinstance(network.__dict__.get("forward"), ForwardStandIn):
            raise RuntimeError(
                f"{type(module).__name__}.{name} was partitioned by another pipeline strategy; load the full "
                "checkpoint into a fresh module to train it with a new one"
            )
        example_inputs = self._example_inputs
        if self.balance == "time" and example_inputs is None and isinstance(network, nn.Sequential):
            example_inputs = first_batch_inputs(self, name, network)
        if self.balance == "time":  # profile on the device the stages will run on (see partition's note)
            example_inputs = move_data_to_device(example_inputs, self.root_device)
        self._network = split_network(self, name, self.split_points, example_inputs)
        self._stages = self._network.stages
        self.module_name = name

    def _wrap_stages(self, fitting: bool) -> list[nn.Module]:
        if not fitting or self.world_size == self.stages_per_pipeline:
            return list(self._stages)
        ties = recorded_ties(self._stages)[0]
        shared = ties_within_a_rank(ties, self.stages_per_pipeline)
        if shared:  # every rank knows every tie: all raise, before any collective
            raise ValueError(
                f"{type(self).__name__}(pp_size={self.pp_size}) trains {self.world_size // self.stages_per_pipeline} "
                f"pipelines data parallel, and {shared[0].describe()} is one parameter held by two model chunks "
                "of one rank; each chunk reduces its gradients over the data-parallel ranks on its own, so a "
                "parameter two chunks share is not supported there. Untie it, choose split_points that keep its "
                "uses in one stage, or train one pipeline over every rank (pp_size=None)"
            )
        if self._sharding is not None:
            self._sharded = ShardedStages.wrap(
                self._stages, ties, self._sharding, self.rank_layout, self._groups, self.root_device,
                self._timeout, str(self.precision_plugin.precision),
            )  # fmt: skip
            return list(self._sharded.wrappers)
        return [DistributedDataParallel(s, process_group=self._dp_group) for s in self._stages]

    def _build_pipeline(self, stages: list[nn.Module]) -> Pipeline:
        raise NotImplementedError

    @override
    def model_to_device(self) -> None:
        self.model.to(self.root_device)

    @override
    def clip_grad_norm_(self, max_norm: float) -> None:
        if self._sharded is None:
            self._pipeline.clip_grad_norm_(max_norm)
            return
        groups = (self._sharded.shard_group, self._pp_group)  # a stage's shards, then the pipeline's stages
        params, tied = list(self._pipeline.parameters()), self._pipeline.tied
        counted = [p for p in params if not tied.is_duplicate(p)]  # a tied parameter counts once
        total = clip_grad_norm_(counted, max_norm, process_group=groups)
        torch.nn.utils.clip_grads_with_norm_([p for p in params if tied.is_duplicate(p)], max_norm, total)

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

    @override
    def teardown(self) -> None:
        for stage in self._pipeline.stages if self._pipeline is not None else []:
            if isinstance(stage, DistributedDataParallel | FullyShardedDataParallel):
                stage.close()
        if self._step is not None:
            self._step.close()
        if self._pipeline is not None:
            self._pipeline.close()
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


for _strategy in (GPipeStrategy, PipeDreamStrategy, Interleaved1F1BStrategy):
    register_once(_strategy, StrategyRegistry)
