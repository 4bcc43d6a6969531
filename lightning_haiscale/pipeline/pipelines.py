"""GPipe, PipeDream (1F1B) and Interleaved1F1B: one stage module per rank, one executor, three schedules."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn

from lightning_haiscale.clip_grad import clip_grad_norm_
from lightning_haiscale.grad_sync import sync_off
from lightning_haiscale.pipeline.executor import (
    LossFn,
    StepConfig,
    StepResult,
    check_stage_module,
    issue_order,
    run_actions,
)
from lightning_haiscale.pipeline.hosts import HostWatch
from lightning_haiscale.pipeline.module_stage import ModuleStage
from lightning_haiscale.pipeline.p2p import BufferPool
from lightning_haiscale.pipeline.partition import SequentialModel
from lightning_haiscale.pipeline.schedule import (
    Action,
    Batch,
    Order,
    build_schedule,
    check_chunks,
    gpipe_order,
    interleaved_order,
    one_f_one_b_order,
)
from lightning_haiscale.pipeline.ties import Tie, TiedParameters

__all__ = [
    "GPipe",
    "Interleaved1F1B",
    "PipeDream",
    "Pipeline",
    "batch_rows",
    "microbatch_sizes",
    "recorded_ties",
    "split_batch",
    "split_microbatches",
]

_CHECKPOINT_POLICIES = ("never", "always", "except_last")


def split_microbatches(args: Sequence[Any], chunks: int, even: bool = True) -> list[tuple[Any, ...]]:
    """Splits every tensor of ``args`` along dim 0 into ``chunks`` microbatches; other values are repeated.

    ``even=True`` (training) requires ``chunks`` to divide the batch, so each microbatch's mean loss weighs
    the same; ``even=False`` (evaluation) allows sizes that differ by one. Tensors inside tuples, lists and
    dicts are split too (see ``split_batch``, the one splitter both this and the Lightning strategies use).
    """
    check_chunks(chunks)
    if any(torch.is_tensor(arg) and arg.dim() == 0 for arg in args):
        raise ValueError("a pipeline input is a 0-d tensor; inputs are split along dim 0 into microbatches")
    return [tuple(part) for part in split_batch(tuple(args), chunks, even)]


def split_batch(batch: Any, chunks: int, even: bool = True) -> list[Any]:
    """Splits every tensor of at least one dimension in a (nested tuple/list/dict) batch along dim 0 into
    ``chunks`` microbatches (``torch.tensor_split``: sizes differ by at most one, the larger first); 0-d
    tensors and other values are repeated. ``even=True`` requires ``chunks`` to divide every batch size."""
    if torch.is_tensor(batch):
        if batch.dim() == 0:
            return [batch] * chunks
        if even and batch.size(0) % chunks:
            raise ValueError(f"chunks={chunks} does not divide batch size {batch.size(0)}")
        return list(torch.tensor_split(batch, chunks))
    if isinstance(batch, Mapping):
        parts = {k: split_batch(v, chunks, even) for k, v in batch.items()}
        return [type(batch)({k: p[m] for k, p in parts.items()}) for m in range(chunks)]  # type: ignore[call-arg]
    if isinstance(batch, Sequence) and not isinstance(batch, str):
        columns = [split_batch(v, chunks, even) for v in batch]
        rows = [[c[m] for c in columns] for m in range(chunks)]
        return [type(batch)(*r) if hasattr(batch, "_fields") else type(batch)(r) for r in rows]
    return [batch] * chunks


def batch_rows(batch: Any) -> int | None:
    """Dim 0 of the first tensor of at least one dimension in a (nested tuple/list/dict) batch; None: none."""
    if torch.is_tensor(batch):
        return batch.size(0) if batch.dim() else None
    if isinstance(batch, (Mapping, Sequence)) and not isinstance(batch, str):
        items = batch.values() if isinstance(batch, Mapping) else batch
        return next((n for n in map(batch_rows, items) if n is not None), None)
    return None


def microbatch_sizes(rows: int, chunks: int) -> list[int]:
    """The rows of each microbatch ``split_batch`` makes of ``rows`` rows (``torch.tensor_split``'s sizes)."""
    return [rows // chunks + (1 if m < rows % chunks else 0) for m in range(chunks)]


class Pipeline(nn.Module):
    """Runs this rank's stage(s) of a pipeline with a schedule; subclasses choose the schedule.

    Every rank of ``process_group`` builds its pipeline with the same ``chunks`` and calls the same
    methods in the same order. ``forward_context``, when set, is entered around every training
    microbatch's forward (CPU activation offload brackets them this way).

    [Note: no hidden loss scaling] haiscale's ``forward_backward`` backpropagates each microbatch's
    ``criterion(*outputs, *labels)`` unscaled, and its published GPT-2 scripts rely on it: the pipeline script
    builds ``GPTLoss(chunks)`` (each microbatch's mean divided by ``chunks``), the DDP-only one ``GPTLoss()``,
    with the same learning rate and global batch. Scaling here too would give a ported script ``1/chunks`` of
    its gradients (a ``chunks``-times smaller SGD step; clipping and Adam's ``eps`` at the wrong scale). The
    Lightning strategies own their loss and pass their own ``loss_scale`` to ``run_microbatches``.

    Layers run once per microbatch, so a BatchNorm normalizes each microbatch by its own statistics and
    updates its running statistics ``chunks`` times a step (a data-parallel stage copies dp rank 0's buffers
    to its replicas before every forward, as torch's DDP does).
    """

    order: ClassVar[Order]

    def __init__(
        self,
        modules: Sequence[nn.Module],
        chunks: int,
        process_group: dist.ProcessGroup | None = None,
        *,
        checkpoint: str = "never",
        forward_context: Callable[[], AbstractContextManager] | None = None,
    ) -> None:
        super().__init__()
        check_chunks(chunks)
        if checkpoint not in _CHECKPOINT_POLICIES:
            raise ValueError(f"checkpoint={checkpoint!r} must be one of {_CHECKPOINT_POLICIES}")
        for module in modules:
            check_stage_module(module)
        self.stages = nn.ModuleList(modules)
        self.chunks = chunks
        self.process_group = process_group
        self.checkpoint = checkpoint
        self.forward_context = forward_context
        initialized = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank(process_group) if initialized else 0
        self.num_ranks = dist.get_world_size(process_group) if initialized else 1
        self.num_stages = self.num_ranks * len(modules)
        self.hosts = HostWatch(process_group) if initialized and self.num_ranks > 1 else None
        if self.num_ranks == 1 and len(modules) > 1:
            raise ValueError(
                f"{len(modules)} model chunks per rank need at least 2 pipeline ranks, got 1: use one chunk per "
                "rank (num_model_chunks=1, GPipe or PipeDream) or more ranks"
            )
        self._sync_grads = True
        self._schedules: dict[tuple[int, bool], dict[int, list[Action]]] = {}
        self._programs: dict[tuple[int, bool, bool], list[Action | Batch]] = {}  # this rank's, per step kind
        self._receive_buffers = BufferPool()  # receive buffers kept between steps, as torch's PipelineStage keeps its
        self.peak_live = 0
        self.tied = TiedParameters(*recorded_ties(modules), process_group)
        self.tied.broadcast_()  # tied copies start equal: the first holder's value
        self.schedule(chunks)  # build and check the training schedule now: errors before any step

    @property
    def is_first_stage(self) -> bool:
        return self.rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.rank == (self.num_stages - 1) % self.num_ranks

    def schedule(self, microbatches: int, forward_only: bool = False) -> dict[int, list[Action]]:
        """Every rank's actions for a step of ``microbatches`` (built once, validated and simulated)."""
        key = (microbatches, forward_only)
        if key not in self._schedules:
            order = self.order
            self._schedules[key] = build_schedule(
                order, self.num_ranks, microbatches, len(self.stages), forward_only=forward_only
            )
        return self._schedules[key]

    def close(self) -> None:
        """Stops watching the stages on other hosts (see [Note: a silent host in a pipeline] in ``hosts``);
        a finished process also stops at exit. Idempotent."""
        if self.hosts is not None:
            self.hosts.close()

    def no_sync(self) -> AbstractContextManager[None]:
        """Gradient accumulation: no data-parallel stage all-reduces inside this context."""
        return sync_off(self, "_sync_grads")

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clips every stage's gradients by the norm of the whole pipeline's; returns that norm.

        Every rank of the pipeline calls it after the step's backward (a collective over ``process_group``).
        ``torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)``, as haiscale's scripts call it, clips
        each stage by its own stage's norm instead (no communication), as it did under haiscale.
        """
        params = list(self.parameters())
        counted = [p for p in params if not self.tied.is_duplicate(p)]  # a tied parameter counts once
        total = clip_grad_norm_(counted, max_norm, norm_type, self.process_group)
        torch.nn.utils.clip_grads_with_norm_([p for p in params if self.tied.is_duplicate(p)], max_norm, total)
        return total

    def forward_backward(
        self,
        *inputs: Any,
        criterion: Callable[..., torch.Tensor],
        labels: Sequence[Any] = (),
        return_outputs: bool = False,
        grad_scaler: torch.amp.GradScaler | None = None,
        kwargs: Mapping[str, Any] | None = None,
    ) -> tuple[torch.Tensor | None, Any]:
        """Forward and backward of one batch, split along dim 0 into ``chunks`` microbatches (haiscale's API).

        ``criterion(*outputs, *labels)`` gives each microbatch's loss, which is backpropagated as it is: the
        step's gradient is the SUM over microbatches, as in haiscale (see [Note: no hidden loss scaling]).
        For the gradient of the batch's mean loss, divide by ``chunks`` in the criterion, as haiscale's GPT-2
        scripts do (``GPTLoss(chunks)``). Returns ``(losses, outputs)`` on the last stage (``losses`` of shape
        ``(chunks,)``, the criterion's values; ``outputs`` joined along dim 0 when ``return_outputs``),
        ``(None, None)`` on every other stage. With fp16 autocast, pass ``grad_scaler``: each microbatch's
        backward starts from ``grad_scaler.scale(loss)`` (the returned losses are unscaled), then step with
        ``grad_scaler.step(optimizer)`` as usual; the scaler must agree on inf/NaN over every stage (torch's
        ``ShardedGradScaler`` does, over the world). Under ``torch.no_grad()`` it raises on every rank before
        any communication (there is nothing to backpropagate); ``model(x)`` is the pipelined evaluation.
        """
        if not torch.is_grad_enabled():
            raise RuntimeError(
                "forward_backward() was called with gradients disabled (torch.no_grad()); call it with "
                "gradients enabled, or use model(*inputs) for pipelined evaluation"
            )
        _check_labels(inputs, labels)
        calls = self._calls(inputs, dict(kwargs or {}), even=True)
        batches = split_microbatches(inputs, self.chunks) if inputs and calls is None else None
        batches = [()] * self.chunks if calls is not None else batches
        label_batches = split_microbatches(tuple(labels), self.chunks)

        def loss_fn(m: int, out: Any) -> torch.Tensor:
            outs = out if isinstance(out, tuple) and calls is None else (out,)  # a module's output is one value
            return criterion(*outs, *label_batches[m])

        result = self.run_microbatches(
            batches, loss_fn, loss_scale=1.0, keep_outputs=return_outputs, grad_scaler=grad_scaler, calls=calls
        )
        if not self.is_last_stage:
            return None, None
        losses = torch.stack([result.losses[m] for m in range(self.chunks)])
        return losses, _join(result.outputs, self.chunks) if return_outputs else None

    def run_microbatches(
        self,
        microbatches: Sequence[tuple[Any, ...]] | None,
        loss_fn: LossFn,
        *,
        loss_scale: float,
        keep_outputs: bool = False,
        uneven: bool = False,
        grad_scaler: torch.amp.GradScaler | None = None,
        calls: Sequence[tuple[tuple[Any, ...], dict[str, Any]]] | None = None,
    ) -> StepResult:
        """One training step over already-split ``microbatches`` (first stage) with a custom ``loss_fn``.

        ``loss_fn(m, output)`` runs on the last stage; the backward of microbatch ``m`` starts from
        ``loss_fn(m, output) * loss_scale``, scaled by ``grad_scaler`` when given. ``uneven``: the microbatches'
        shapes differ within the step, so each carries its shape header (every rank passes the same value).
        ``calls[m]``: microbatch ``m``'s ``(args, kwargs)`` of a split module's forward, on every rank (see
        ``ModuleStage``). The Lightning strategies use this entry point. Tied parameters' gradients are summed
        over their stages at the end (outside ``no_sync``).
        """
        config = self._config(
            self.chunks, training=True, loss_fn=loss_fn, loss_scale=loss_scale, keep=keep_outputs, uneven=uneven
        )
        config.grad_scaler, config.calls = grad_scaler, calls
        result = self._run(self.chunks, False, microbatches, config)
        self.peak_live = result.peak_live
        if self._sync_grads:
            self.tied.reduce_gradients_()
        return result

    def forward(self, *inputs: Any, microbatches: int | None = None, kwargs: Mapping[str, Any] | None = None) -> Any:
        """Pipelined evaluation (no gradients): the output joined along dim 0 on the last stage, else ``None``.

        The batch is split into ``chunks`` microbatches (sizes may differ by one), or ``microbatches``. A split
        module's keywords come as ``kwargs``; its outputs that are not tensors come as a list, one per microbatch.
        """
        n = microbatches or self.chunks
        calls = self._calls(inputs, dict(kwargs or {}), even=False, n=n)
        batches = [()] * n if calls is not None else split_microbatches(inputs, n, even=False) if inputs else None
        config = self._config(n, training=False, loss_fn=None, loss_scale=1.0, keep=True, uneven=True)
        config.calls = calls
        with torch.no_grad():
            result = self._run(n, True, batches, config)
        return _join(result.outputs, n) if self.is_last_stage else None

    @property
    def min_microbatches(self) -> int:
        """The fewest microbatches a step of this schedule takes (Interleaved1F1B: one per rank)."""
        return self.num_ranks if len(self.stages) > 1 else 1

    def run_forward(self, calls: Sequence[tuple[tuple[Any, ...], dict[str, Any]]]) -> list[Any]:
        """Pipelined evaluation of a split module's already-split ``calls`` (every rank): the last stage's output
        of each microbatch, else an empty list."""
        n = len(calls)
        config = self._config(n, training=False, loss_fn=None, loss_scale=1.0, keep=True, uneven=True)
        config.calls = calls
        with torch.no_grad():
            result = self._run(n, True, [()] * n, config)
        return [result.outputs[m] for m in range(n)] if self.is_last_stage else []

    @property
    def runs_whole_module(self) -> bool:
        """True for stages of a split module: every stage gets the module's call (see ``ModuleStage``)."""
        return any(isinstance(getattr(m, "module", m), ModuleStage) for m in self.stages)

    def _calls(
        self, inputs: tuple[Any, ...], kwargs: dict[str, Any], even: bool, n: int | None = None
    ) -> list[tuple[tuple[Any, ...], dict[str, Any]]] | None:
        if not self.runs_whole_module:
            if kwargs:
                raise TypeError(f"keyword inputs {sorted(kwargs)} need a split module's stages, not a Sequential's")
            return None
        return [tuple(c) for c in split_batch((tuple(inputs), dict(kwargs)), n or self.chunks, even)]

    def _config(
        self, n: int, training: bool, loss_fn: LossFn | None, loss_scale: float, keep: bool, uneven: bool
    ) -> StepConfig:
        policy = self.checkpoint
        return StepConfig(
            num_ranks=self.num_ranks,
            num_stages=self.num_stages,
            group=self.process_group,
            training=training,
            loss_fn=loss_fn,
            loss_scale=loss_scale,
            keep_outputs=keep,
            sync_grads=self._sync_grads,
            header_every_microbatch=uneven,
            checkpoint=lambda m: policy == "always" or (policy == "except_last" and m != n - 1),
            forward_context=self.forward_context,
            buffers=self._receive_buffers,
            hosts=self.hosts,
        )

    def _run(
        self, n: int, forward_only: bool, batches: Sequence[tuple[Any, ...]] | None, config: StepConfig
    ) -> StepResult:
        if self.is_first_stage and batches is None:
            raise ValueError("the first pipeline stage needs the inputs; pass the batch on every rank")
        schedule = self.schedule(n, forward_only)
        key = (n, forward_only, config.header_every_microbatch)
        if key not in self._programs:  # lowering takes 0.15-0.5 ms of Python: once, not every step
            self._programs[key] = issue_order(schedule[self.rank], config)
        return run_actions(self.stages, schedule[self.rank], schedule, batches, config, self._programs[key])


class GPipe(Pipeline):
    """GPipe: all forwards, then all backwards; ``checkpoint`` recomputes activations in the backward.

    ``checkpoint="except_last"`` keeps the last microbatch's activations, whose backward comes first.
    Live activations per stage: ``chunks`` (inputs only, when checkpointed).
    """

    order = staticmethod(gpipe_order)

    def __init__(
        self,
        module: nn.Module,
        chunks: int,
        process_group: dist.ProcessGroup | None = None,
        checkpoint: str = "never",
        *,
        forward_context: Callable[[], AbstractContextManager] | None = None,
    ) -> None:
        super().__init__([module], chunks, process_group, checkpoint=checkpoint, forward_context=forward_context)

    @property
    def module(self) -> nn.Module:
        return self.stages[0]


class PipeDream(Pipeline):
    """PipeDream-flush (1F1B): stage ``r`` of ``S`` keeps at most ``S - r`` microbatches' activations."""

    order = staticmethod(one_f_one_b_order)

    def __init__(
        self,
        module: nn.Module,
        chunks: int,
        process_group: dist.ProcessGroup | None = None,
        *,
        forward_context: Callable[[], AbstractContextManager] | None = None,
    ) -> None:
        super().__init__([module], chunks, process_group, forward_context=forward_context)

    @property
    def module(self) -> nn.Module:
        return self.stages[0]


class Interleaved1F1B(Pipeline):
    """Interleaved 1F1B: each rank holds ``len(modules)`` chunks (``partition(..., num_model_chunks=V)``).

    Shrinks the pipeline bubble by ``V``; ``chunks`` must be a multiple of the number of pipeline ranks.
    """

    order = staticmethod(interleaved_order)

    @property
    def module(self) -> nn.ModuleList:
        """This rank's model chunks: haiscale's scripts save ``model.module.state_dict()`` for every schedule."""
        return self.stages

    def __init__(
        self,
        modules: Sequence[nn.Module],
        chunks: int,
        process_group: dist.ProcessGroup | None = None,
        *,
        forward_context: Callable[[], AbstractContextManager] | None = None,
    ) -> None:
        if isinstance(modules, nn.Module) and not isinstance(modules, (list, tuple, nn.ModuleList)):
            modules = [modules]
        super().__init__(list(modules), chunks, process_group, forward_context=forward_context)


def _check_labels(inputs: Sequence[Any], labels: Sequence[Any]) -> None:
    """Labels must have the batch size of the inputs: fewer rows would broadcast silently in many losses.

    Checked on every rank that is given both (haiscale's usage passes the batch and labels on every rank),
    before the step, so those ranks all raise; a rank given only one of them cannot check.
    """
    sizes = {t.size(0) for t in inputs if torch.is_tensor(t) and t.dim() > 0}
    label_sizes = {t.size(0) for t in labels if torch.is_tensor(t) and t.dim() > 0}
    if sizes and label_sizes and sizes != label_sizes:
        raise ValueError(
            f"labels have batch size {', '.join(map(str, sorted(label_sizes)))} but the inputs have "
            f"{', '.join(map(str, sorted(sizes)))}; pass labels for the same rows as the inputs (dim 0)"
        )


def recorded_ties(modules: Sequence[nn.Module]) -> tuple[list[Tie], dict[Tie, nn.Parameter]]:
    """The ties ``partition`` recorded on the stages (also under a data-parallel wrapper's ``module``), the same
    on every rank, and this rank's copy of each it holds."""
    ties, local = [], {}
    for module in modules:
        stage = getattr(module, "module", module)
        if isinstance(stage, (SequentialModel, ModuleStage)):
            ties = stage.ties or ties
            local.update(stage.local_ties())
    return ties, local


def _join(outputs: dict[int, Any], n: int) -> Any:
    parts = [outputs[m] for m in range(n)]
    if not torch.is_tensor(parts[0]) and not isinstance(parts[0], tuple):
        return parts
    if isinstance(parts[0], tuple):
        return tuple(torch.cat([p[i] for p in parts]) for i in range(len(parts[0])))
    return torch.cat(parts)
