"""The pipelined Lightning step: unmodified step code run around a pipeline, its loss and logs published.

[Note: capture and replay] A training step such as ``x, y = batch; out = self(x); loss = F(out, y)``
calls the network once. The strategy puts ``StageProxy`` where the network was. On the first stage the
step runs once per microbatch in *capture* mode: the network call raises ``InputsCaptured`` carrying its
arguments, so whatever the step does before the call (reading the batch, reshaping) decides that
microbatch's pipeline input. On the last stage the step runs once per microbatch in *replay* mode: the
network call returns that microbatch's pipeline output (with its autograd graph), so whatever the step does
after the call (the criterion, metrics, ``self.log``) is the loss function. The network must be called
exactly once per step, and the step must treat batch rows independently (microbatches are row slices of
the batch, split once per step by ``lightning_haiscale.pipeline.split_batch``).

[Note: pipelines inside automatic optimization] Lightning's closure runs ``training_step``, then
``zero_grad``, then ``backward``. The whole schedule (every microbatch's forward and backward) runs in
``training_step``, so the strategy owns ``zero_grad``: it calls the module's ``optimizer_zero_grad`` at the
start of each accumulation window, before the schedule, and turns the call Lightning makes later into a
no-op; ``backward`` only runs the ``on_before_backward`` / ``on_after_backward`` hooks. Each microbatch's
loss is scaled by ``1 / (chunks * accumulate_grad_batches)``, so accumulated gradients are those of the mean.
A batch that does not split evenly (an epoch's smaller last batch) splits into sizes that differ by one, and
each microbatch's loss is weighted by its share of the rows, so the gradient is still the batch mean's.

[Note: shadowing the module's methods] Two of the user's methods are shadowed by instance attributes, in
``shadowed`` alone, because no strategy or loop hook does the job:
- ``optimizer_zero_grad``: the automatic-optimization closure calls the module's hook itself
  (``call._call_lightning_module_hook``) between ``training_step`` and ``backward``; no strategy hook runs
  around that call. Moving the gradients aside around it instead would skip a user's own override, which
  the strategy calls, once per window, at the start of the window.
- ``log``: ``LightningModule.log`` writes into the Trainer's private result collection. A pipelined step
  must record each microbatch's values (to average them and send them from the last stage) and drop those
  of a capture; replacing the result collection would reach into the Trainer's private state.
"""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Callable, Generator, Mapping, Sequence
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch import nn

from lightning_haiscale.hfreduce import kept_collectives
from lightning_haiscale.pipeline import Pipeline, SequentialModel
from lightning_haiscale.pipeline.pipelines import batch_rows, microbatch_sizes, split_batch

__all__ = [
    "ForwardStandIn",
    "InputsCaptured",
    "LogRecorder",
    "PipelinedStep",
    "StageProxy",
    "StandInMode",
    "capture_inputs",
    "shadowed",
]


class StandInMode(enum.Enum):
    """What a call of the network's stand-in does; one mode at a time, entered and left only by ``_in_mode``."""

    IDLE = enum.auto()
    """Outside a pipelined step: a call is a mistake, and raises saying where the network may be called."""
    CAPTURE = enum.auto()
    """Before the step's first run: the call raises :class:`InputsCaptured` with its arguments, the pipeline's
    inputs."""
    REPLAY = enum.auto()
    """While the step's code runs again after the pipeline: the call returns the pipeline's output."""


class InputsCaptured(Exception):
    """Raised by a stand-in in capture mode to stop the step at the network call, with the call's arguments."""

    def __init__(self, inputs: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        super().__init__("pipeline input captured")
        self.inputs, self.kwargs = inputs, kwargs


class _StandIn:
    """Stands in for the network inside step code: captures its call or replays its output, never computes."""

    def _init_stand_in(self) -> None:
        self._mode = StandInMode.IDLE
        self._output: Any = None
        self._calls = 0

    @contextlib.contextmanager
    def capturing(self) -> Generator[None, None, None]:
        with self._in_mode(StandInMode.CAPTURE, None):
            yield

    @contextlib.contextmanager
    def replaying(self, output: Any) -> Generator[None, None, None]:
        with self._in_mode(StandInMode.REPLAY, output):
            yield
            if self._calls != 1:
                raise RuntimeError(
                    f"the step called the pipelined network {self._calls} times; pipeline strategies support "
                    "steps that call it exactly once (out = self(x) or self.<network>(x))"
                )

    @contextlib.contextmanager
    def _in_mode(self, mode: StandInMode, output: Any) -> Generator[None, None, None]:
        self._mode, self._output, self._calls = mode, output, 0
        try:
            yield
        finally:
            self._mode, self._output = StandInMode.IDLE, None

    def _stand_in_call(self, inputs: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        self._calls += 1
        if self._mode is StandInMode.CAPTURE:
            raise InputsCaptured(inputs, kwargs)
        if self._mode is StandInMode.REPLAY:
            return self._output
        raise RuntimeError(
            "this network is split across pipeline stages; call it only inside the training, validation, test "
            "or predict step that the pipeline strategy runs"
        )


class StageProxy(_StandIn, SequentialModel):
    """Holds this rank's layers of a Sequential network (original names, so state dicts stay slices of the
    full network) and stands in for the network inside step code."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self._init_stand_in()

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        return self._stand_in_call(inputs, kwargs)  # keywords are refused by name in ``PipelinedStep``


class ForwardStandIn(_StandIn):
    """Stands in for a split module's ``forward`` (an instance attribute shadowing it, see ``shadowed``): the
    module stays the user's object (its attributes, ``config``, state dict names), its call is captured."""

    def __init__(self) -> None:
        self._init_stand_in()

    def __call__(self, *inputs: Any, **kwargs: Any) -> Any:
        return self._stand_in_call(inputs, kwargs)


@contextlib.contextmanager
def shadowed(obj: Any, name: str, value: Any) -> Generator[None, None, None]:
    """``obj.name`` is ``value`` inside (an instance attribute shadowing the method), as before outside.

    The one place the pipeline strategies patch the user's module: see [Note: shadowing the module's methods].
    """
    missing = object()
    previous = obj.__dict__.get(name, missing)
    obj.__dict__[name] = value
    try:
        yield
    finally:
        if previous is missing:
            obj.__dict__.pop(name, None)
        else:
            obj.__dict__[name] = previous


def _ignore_log(*args: Any, **kwargs: Any) -> None:
    """Stands in for ``self.log`` while the first stage runs a step only to capture the network's inputs."""


def _skip_zero_grad(*args: Any, **kwargs: Any) -> None:
    """Lightning's own zero_grad comes after the schedule ran; the strategy zeroes before it instead."""


def capture_inputs(
    module: pl.LightningModule, proxy: _StandIn, step: Callable[..., Any], args: tuple, kwargs: dict
) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """The network's call in ``step(*args, **kwargs)`` (run up to it): ``(args, kwargs)``; ``None``: no call."""
    with proxy.capturing(), shadowed(module, "log", _ignore_log):
        try:
            step(*args, **kwargs)
        except InputsCaptured as captured:
            return captured.inputs, captured.kwargs
    return None


class LogRecorder:
    """Collects a step's ``self.log`` calls per microbatch, to log them once, averaged, on every stage."""

    def __init__(self, weights: Sequence[float] | None = None) -> None:
        self.weights = weights  # per microbatch (uneven splits); None: all equal
        self.calls: dict[str, tuple[list[tuple[float, Any]], dict[str, Any]]] = {}
        self.module: nn.Module | None = None

    @contextlib.contextmanager
    def recording(self, module: pl.LightningModule, microbatch: int) -> Generator[None, None, None]:
        self.module = module

        def record(name: str, value: Any, *args: Any, **kwargs: Any) -> None:
            if args:
                raise TypeError("pipeline strategies need self.log's options as keywords (self.log(name, value, k=v))")
            values, _ = self.calls.setdefault(name, ([], kwargs))
            values.append((1.0 if self.weights is None else self.weights[microbatch], value))

        with shadowed(module, "log", record):
            yield

    def summary(self) -> list[tuple[str, str, Any, dict[str, Any]]]:
        """``(name, "metric", attribute path, kwargs)`` or ``(name, "value", mean as float, kwargs)``."""
        out = []
        for name, (values, kwargs) in self.calls.items():
            first = values[0][1]
            if isinstance(first, nn.Module):
                path = next((p for p, m in self.module.named_modules() if m is first), None)
                if path is None:
                    raise ValueError(f"self.log({name!r}, metric): the metric must be an attribute of the module")
                out.append((name, "metric", path, kwargs))
            else:
                total = sum(w * float(torch.as_tensor(v).detach().float().mean()) for w, v in values)
                out.append((name, "value", total / sum(w for w, _ in values), kwargs))
        return out


class PipelinedStep:
    """Runs the module's training, validation, test and predict steps around this rank's ``pipeline``.

    Args:
        module: the LightningModule whose ``network_name`` attribute is split.
        network_name: that attribute's name.
        proxy: what stands in for the network in step code (``StageProxy`` or ``ForwardStandIn``).
        pipeline: this rank's plain-layer pipeline.
        group: the pipeline's process group (``None``: a pipeline of one rank).
        device: where published losses and logged values live.
    """

    def __init__(
        self,
        module: pl.LightningModule,
        network_name: str,
        proxy: _StandIn,
        pipeline: Pipeline,
        group: dist.ProcessGroup | None,
        device: torch.device,
    ) -> None:
        self.module, self.network_name, self.proxy, self.pipeline = module, network_name, proxy, pipeline
        self.group, self.device = group, device
        self._shadows = contextlib.ExitStack()
        self._module_zero_grad: Callable[..., Any] | None = None
        self._checked: set[str] = set()

    def take_over_zero_grad(self) -> None:
        """See [Note: pipelines inside automatic optimization]; ``close`` gives it back."""
        if self._module_zero_grad is None:
            self._module_zero_grad = self.module.optimizer_zero_grad
            self._shadows.enter_context(shadowed(self.module, "optimizer_zero_grad", _skip_zero_grad))

    def close(self) -> None:
        """Removes what this object shadowed on the module."""
        self._shadows.close()
        self._module_zero_grad = None

    def train(
        self, args: tuple, kwargs: dict, optimizers: Sequence[torch.optim.Optimizer], grad_scaler: Any = None
    ) -> torch.Tensor:
        """One training step: every microbatch's forward and backward; returns the last stage's mean loss."""
        module, trainer, chunks = self.module, self.module.trainer, self.pipeline.chunks
        accumulate = trainer.accumulate_grad_batches
        batch_idx = args[1] if len(args) > 1 else kwargs.get("batch_idx", 0)
        if batch_idx % accumulate == 0 and self._module_zero_grad is not None:
            for optimizer in optimizers:
                self._module_zero_grad(trainer.current_epoch, batch_idx, optimizer)
        self.check_step_form(module.training_step, args, kwargs)
        batches, weights = self._split(args[0])
        recorder = LogRecorder(weights)

        def loss_fn(m: int, output: Any) -> torch.Tensor:
            with self.proxy.replaying(output), recorder.recording(module, m):
                loss = _loss_of(module.training_step(batches[m], *args[1:], **kwargs))
            return loss if weights is None else loss * weights[m]

        inputs, calls = self._network_calls(module.training_step, [((b, *args[1:]), kwargs) for b in batches or []])
        result = self.pipeline.run_microbatches(
            inputs,
            loss_fn,
            loss_scale=1.0 / (chunks * accumulate),
            uneven=weights is not None,
            grad_scaler=grad_scaler,
            calls=calls,
        )
        loss = torch.stack([result.losses[m] for m in range(chunks)]).mean() if result.losses else None
        return self.publish(recorder, loss)

    def _split(self, batch: Any) -> tuple[list[Any] | None, list[float] | None]:
        """The microbatches (first and last stage; split once), and the loss weight of each when the batch does
        not split evenly (an epoch's smaller last batch): its share of the rows times ``chunks``, so that the
        weighted microbatch losses average to the batch's mean loss. Every rank sees the same batch, so all
        agree on the weights and on whether the split is uneven."""
        chunks = self.pipeline.chunks
        rows = batch_rows(batch)
        if rows is not None and rows < chunks:
            raise ValueError(
                f"a training batch of {rows} rows cannot make chunks={chunks} microbatches: use fewer chunks, "
                "or DataLoader(..., drop_last=True) if it is the last batch of the epoch"
            )
        weights = None
        if rows is not None and rows % chunks:
            weights = [size * chunks / rows for size in microbatch_sizes(rows, chunks)]
        needed = self.pipeline.is_first_stage or self.pipeline.is_last_stage or self.pipeline.runs_whole_module
        return (split_batch(batch, chunks, even=False) if needed else None), weights

    def evaluate(self, step: Callable[..., Any], args: tuple, kwargs: dict, publish: bool = True) -> Any:
        """A pipelined validation, test or predict step; the step's result on the last stage, else ``None``.

        A split module's step is replayed once per microbatch (as few as the schedule allows: one, or one per
        rank for Interleaved1F1B), its logs averaged by rows; with several, the results come as a list.
        """
        if self.pipeline.runs_whole_module:
            return self._evaluate_calls(step, args, kwargs, publish)
        self.check_step_form(step, args, kwargs)
        inputs, _ = self._network_calls(step, [(args, kwargs)])
        output = self.pipeline(*inputs[0]) if inputs is not None else self.pipeline()
        recorder, result = LogRecorder(), None
        if self.pipeline.is_last_stage:
            with self.proxy.replaying(output), recorder.recording(self.module, 0):
                result = step(*args, **kwargs)
        if publish:
            self.publish(recorder, None)
        return result

    def _evaluate_calls(self, step: Callable[..., Any], args: tuple, kwargs: dict, publish: bool) -> Any:
        n = self.pipeline.min_microbatches
        batches = split_batch(args[0], n, even=False)
        rows = batch_rows(args[0])
        weights = None if rows is None else microbatch_sizes(rows, n)
        _, calls = self._network_calls(step, [((b, *args[1:]), kwargs) for b in batches])
        outputs = self.pipeline.run_forward(calls)
        recorder, results = LogRecorder(weights), []
        if self.pipeline.is_last_stage:
            for m, batch in enumerate(batches):
                with self.proxy.replaying(outputs[m]), recorder.recording(self.module, m):
                    results.append(step(batch, *args[1:], **kwargs))
        if publish:
            self.publish(recorder, None)
        return (results[0] if n == 1 else results) if results else None

    def _network_calls(
        self, step: Callable[..., Any], steps: Sequence[tuple[tuple, dict]]
    ) -> tuple[list[tuple[Any, ...]] | None, list[tuple[tuple, dict]] | None]:
        """Each microbatch's network inputs (first stage of a Sequential) or call (every stage of a split module)."""
        if self.pipeline.runs_whole_module:
            return [()] * len(steps), [self._capture(step, a, k) for a, k in steps]
        if not self.pipeline.is_first_stage:
            return None, None
        return [self._positional_call(step, a, k) for a, k in steps], None

    def check_step_form(self, step: Callable[..., Any], args: tuple, kwargs: dict) -> None:
        """Runs ``step`` up to the network call on every rank once (a Sequential's later stages never run it
        before the schedule), so a step the strategy cannot replay raises on every rank, before any transfer."""
        if step.__name__ not in self._checked:
            if not self.pipeline.runs_whole_module:
                self._positional_call(step, args, kwargs)
            self._checked.add(step.__name__)

    def _positional_call(self, step: Callable[..., Any], args: tuple, kwargs: dict) -> tuple[Any, ...]:
        inputs, keywords = self._capture(step, args, kwargs)
        if keywords:
            raise TypeError(
                f"{step.__name__} calls the Sequential {self.network_name!r} with keywords {sorted(keywords)}; "
                f"a Sequential takes positional inputs (self.{self.network_name}(x)); a module with keyword inputs "
                "is split at its blocks instead (module_name= naming it, or split_points=)"
            )
        return inputs

    def _capture(self, step: Callable[..., Any], args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        call = capture_inputs(self.module, self.proxy, step, args, kwargs)
        if call is None:
            raise RuntimeError(
                f"{step.__name__} never called the network {self.network_name!r}; pipeline strategies need the step "
                f"to call it once (out = self(x) with forward calling self.{self.network_name}, or "
                f"loss = self.{self.network_name}(input_ids=x, labels=y).loss)"
            )
        return call

    def publish(self, recorder: LogRecorder, loss: torch.Tensor | None) -> torch.Tensor:
        """Broadcasts the last stage's loss and logs over the pipeline and logs them on every stage."""
        payload = {"loss": None if loss is None else float(loss), "logs": recorder.summary()}
        if self.pipeline.num_ranks > 1:
            last = (self.pipeline.num_stages - 1) % self.pipeline.num_ranks
            payload = kept_collectives.broadcast_object(payload, dist.get_global_rank(self.group, last), self.group)
        for name, kind, value, log_kwargs in payload["logs"]:
            shown = self.module.get_submodule(value) if kind == "metric" else torch.tensor(value, device=self.device)
            self.module.log(name, shown, **log_kwargs)
        value = payload["loss"]
        return torch.tensor(value if value is not None else float("nan"), device=self.device)


def _loss_of(result: Any) -> torch.Tensor:
    loss = result.get("loss") if isinstance(result, Mapping) else result
    if not torch.is_tensor(loss):
        raise TypeError(
            "pipeline strategies need training_step to return the loss tensor or a dict with 'loss'; got "
            f"{type(result).__name__}"
        )
    return loss
