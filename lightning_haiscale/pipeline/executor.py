"""The one executor: runs any rank's action list with torch.distributed point-to-point operations.

[Note: executor semantics] The executor runs ``schedule.lower``'s program for its rank: a compute, or a
batch of transfers issued as one ``batch_isend_irecv`` (see [Note: communication order] in ``schedule``).
Sends are asynchronous (waited for at the end of the step, reaped as they complete); a compute waits for
the receive of its input; a payload receive is posted once its header has arrived. This is exactly the
model ``schedule.simulate`` proves runs under NCCL's rules. A transfer that fails or times out raises
``PipelineCommunicationError`` naming the stage, the action, the peer stage and the schedule's grid, and the
peer's own error when the peer failed in its own code (see [Note: a stage's own error]).
Forwards on stage ``s`` keep ``(inputs, outputs)`` until the backward of the same microbatch, so the
number of live microbatches per stage is the schedule's ``live_activation_peak``; ``peak_live`` records
what was observed.

[Note: data-parallel stages] A stage module with ``no_sync()`` (a data-parallel wrapper such as
``lightning_haiscale.ddp.DistributedDataParallel``) runs every backward but its last of the step inside
``no_sync()``, so the gradient all-reduce is issued by the final backward and overlaps it. When the
pipeline itself is inside ``no_sync()`` (gradient accumulation) every backward is. torch's
``DistributedDataParallel`` decides at *forward* time whether a backward reduces, which no pipeline
schedule can honor (backwards of other microbatches run between the last forward and the last
backward), so it is refused. A stage module that is a :class:`MicrobatchStepModule` (``lightning_haiscale.fsdp.
FullyShardedDataParallel``) runs the whole step inside its ``microbatch_step(count)``, ``count`` being its
microbatches of the step: it gathers its parameters once for all of them and reduces its gradients once, at the
``count``-th backward (the last, which is outside ``no_sync()`` too).

[Note: a stage's own error] A stage that raises in its own compute (a model's error on stage 1) ends its
process, and its peers only see gloo's "Connection closed by peer". So before it raises, it posts its error
in the job's store (``hfreduce.job_store``: the default group's rendezvous store, which every rank reaches),
and a peer whose transfer with it fails reads it there and adds it to its own error: rank 0's log names the
real cause. Best effort: when the store is gone (its host, rank 0, failed) nothing is added.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint as activation_checkpoint

from lightning_haiscale.hfreduce.job_store import job_store
from lightning_haiscale.pipeline import p2p
from lightning_haiscale.pipeline.hosts import HostWatch
from lightning_haiscale.pipeline.schedule import (
    Action,
    ActionType,
    Batch,
    Transfer,
    format_grid,
    has_header,
    header_of,
    lower,
    post_ahead,
)

__all__ = ["MicrobatchStepModule", "PipelineCommunicationError", "StepResult", "issue_order", "run_actions"]

log = logging.getLogger(__name__)

LossFn = Callable[[int, Any], torch.Tensor]


_HEADER = p2p.TensorMeta((p2p.HEADER_SLOTS,), torch.int64, False)


@runtime_checkable
class MicrobatchStepModule(Protocol):
    """A stage module that runs the microbatches of a step as one step, inside ``microbatch_step(count)``
    (``FullyShardedDataParallel``: one all-gather and one reduce-scatter per unit and step; see [Note:
    data-parallel stages])."""

    def microbatch_step(self, count: int) -> AbstractContextManager[None]: ...


class PipelineCommunicationError(RuntimeError):
    """A pipeline transfer failed or timed out: the message names the action, both stages and the schedule."""


@dataclass
class StepResult:
    """What one step produced on this rank: per-microbatch losses and outputs (last stage only)."""

    losses: dict[int, torch.Tensor] = field(default_factory=dict)
    outputs: dict[int, Any] = field(default_factory=dict)
    peak_live: int = 0


@dataclass
class StepConfig:
    """How one step runs; see ``run_actions``."""

    num_ranks: int
    num_stages: int
    group: dist.ProcessGroup | None
    training: bool
    loss_fn: LossFn | None = None
    loss_scale: float = 1.0
    grad_scaler: torch.amp.GradScaler | None = None
    keep_outputs: bool = False
    sync_grads: bool = True
    header_every_microbatch: bool = False
    checkpoint: Callable[[int], bool] = lambda m: False
    forward_context: Callable[[], AbstractContextManager] | None = None
    buffers: p2p.BufferPool | None = None
    hosts: HostWatch | None = None  # the peers on other hosts, whose loss ends a wait (see pipeline.hosts)
    """Receive buffers reused across steps (see [Note: buffer reuse] in ``p2p``); None: fresh ones."""
    calls: Sequence[tuple[tuple[Any, ...], dict[str, Any]]] | None = None
    """Each microbatch's call of a split module, given to every stage (see ``ModuleStage``); None: none."""


def check_stage_module(module: nn.Module) -> None:
    """Refuses wrappers the schedules cannot drive correctly (see the note on data-parallel stages)."""
    if isinstance(module, torch.nn.parallel.DistributedDataParallel):
        raise TypeError(
            "torch's DistributedDataParallel decides at forward time whether a backward all-reduces, which "
            "pipeline schedules cannot honor; wrap the stage with lightning_haiscale.ddp.DistributedDataParallel"
        )


def run_actions(
    modules: Sequence[nn.Module],
    actions: Sequence[Action],
    schedule: dict[int, list[Action]],
    inputs: Sequence[tuple[Any, ...]] | None,
    config: StepConfig,
    program: Sequence[Action | Batch] | None = None,
) -> StepResult:
    """Runs this rank's ``actions`` on its stage ``modules`` (one per model chunk) and returns its results.

    ``inputs[m]`` is microbatch ``m``'s input tuple (first stage only). On the last stage
    ``config.loss_fn(m, output)`` gives microbatch ``m``'s loss; its backward is scaled by ``loss_scale``
    and then by ``grad_scaler`` (fp16 loss scaling), when there is one. ``program`` is
    ``issue_order(actions, config)``, which a caller running the same step again may keep (the pipelines do).
    On failure the schedule's grid is logged with the failing action.
    """
    step = _Step(modules, inputs, config, actions, schedule)
    done = False
    with contextlib.ExitStack() as stages:
        for module, count in _microbatch_counts(modules, actions, config.num_ranks):
            stages.enter_context(module.microbatch_step(count))
        try:
            for index, item in enumerate(program if program is not None else issue_order(actions, config)):
                try:
                    step.run(item)
                except Exception as error:
                    grid = format_grid(schedule)
                    log.error("pipeline step item %d (%s) failed; schedule:\n%s", index, _name(item), grid)
                    if not isinstance(error, PipelineCommunicationError):
                        _post_failure(item, error)
                    raise
            done = True
        finally:
            step.finish(wait=done)
            if not done and config.buffers is not None:
                config.buffers.clear()
    return step.result


def _microbatch_counts(
    modules: Sequence[nn.Module], actions: Sequence[Action], num_ranks: int
) -> list[tuple[MicrobatchStepModule, int]]:
    """Each stage module that runs a step as one, with its microbatches in ``actions`` (its forwards)."""
    return [
        (module, sum(1 for a in actions if a.type is ActionType.FORWARD and a.stage // num_ranks == chunk))
        for chunk, module in enumerate(modules)
        if isinstance(module, MicrobatchStepModule)
    ]


def issue_order(actions: Sequence[Action], config: StepConfig) -> list[Action | Batch]:
    """What this rank issues: ``lower``'s program; on a backend that runs transfers concurrently (gloo),
    with receives posted a compute ahead (``post_ahead``), since there an early receive blocks nothing."""
    program = lower(list(actions), config.header_every_microbatch)
    if p2p.runs_concurrently(config.group):
        return post_ahead(program, config.header_every_microbatch)
    return program


def _name(item: Action | Batch) -> str:
    return str(item) if isinstance(item, Action) else "batch " + ", ".join(str(t) for t in item)


class _Step:
    """The state of one step on one rank: posted receives, pending sends, saved activations."""

    def __init__(
        self,
        modules: Sequence[nn.Module],
        inputs: Sequence[tuple[Any, ...]] | None,
        config: StepConfig,
        actions: Sequence[Action],
        schedule: dict[int, list[Action]],
    ) -> None:
        self.modules = modules
        self.inputs = inputs
        self.cfg = config
        self.schedule = schedule
        self.device = _device_of(modules)
        self.result = StepResult()
        self.received: dict[Transfer, tuple[torch.Tensor, list[p2p.TensorMeta], Any]] = {}
        self.saved: dict[tuple[int, int], tuple[tuple[Any, ...], Any]] = {}
        self.outbox: dict[tuple[int, int], list[Any]] = {}
        self.sent_metas: dict[int, list[p2p.TensorMeta]] = {}
        self.recv_metas: dict[int, list[p2p.TensorMeta]] = {}
        self.sends: list[tuple[Transfer, Any, torch.Tensor]] = []
        self.last_backward = {a.stage: a.microbatch for a in actions if a.type is ActionType.BACKWARD}
        if config.grad_scaler is not None and config.training:
            # Only the last stage scales a loss, but every stage steps with the scaler (its gradients arrive
            # scaled): a scaler creates its scale on first use, so use it here on every stage.
            config.grad_scaler.scale(torch.zeros((), device=self.device))

    def run(self, item: Action | Batch) -> None:
        if not isinstance(item, Action):
            self.exchange(item)
            return
        self.sends = [s for s in self.sends if not s[1].is_completed()]  # sent tensors may go
        if item.type is ActionType.FORWARD:
            self.forward(item.stage, item.microbatch)
        else:
            self.backward(item.stage, item.microbatch)

    # ----- compute -----------------------------------------------------------------------------------

    def forward(self, stage: int, m: int) -> None:
        module = self.modules[stage // self.cfg.num_ranks]
        inputs = self._stage_inputs(stage, m)
        last = stage == self.cfg.num_stages - 1
        call = {} if self.cfg.calls is None else {"call": self.cfg.calls[m]}
        with contextlib.ExitStack() as stack:
            if self.cfg.forward_context is not None and self.cfg.training:
                stack.enter_context(self.cfg.forward_context())
            if self.cfg.training and self.cfg.checkpoint(m) and not last:
                out = activation_checkpoint(module, *inputs, use_reentrant=False, **call)
            else:
                out = module(*inputs, **call)
            loss = self.cfg.loss_fn(m, out) if last and self.cfg.loss_fn is not None else None
        if last:
            self._finish_last_forward(stage, m, inputs, out, loss)
            return
        outs = _as_tensors(out, stage)
        if self.cfg.training:
            self.saved[(stage, m)] = (inputs, outs)
            self.result.peak_live = max(self.result.peak_live, self._live(stage))
        self.outbox[(stage, m)] = self._outgoing(Action(stage, ActionType.SEND_F, m), outs)

    def _finish_last_forward(self, stage: int, m: int, inputs: tuple[Any, ...], out: Any, loss: Any) -> None:
        if loss is not None:
            if not torch.is_tensor(loss) or loss.numel() != 1:
                raise TypeError(f"the criterion must return a scalar tensor, got {_describe(loss)}")
            self.result.losses[m] = loss.detach()
        if self.cfg.keep_outputs:
            self.result.outputs[m] = _detach(out)
        if self.cfg.training:
            if loss is None:
                raise ValueError("a training step needs a criterion on the last stage")
            self.saved[(stage, m)] = (inputs, loss)
            self.result.peak_live = max(self.result.peak_live, self._live(stage))

    def backward(self, stage: int, m: int) -> None:
        module = self.modules[stage // self.cfg.num_ranks]
        inputs, out = self.saved.pop((stage, m))
        final = self.last_backward[stage] == m and self.cfg.sync_grads
        with contextlib.nullcontext() if final or not hasattr(module, "no_sync") else module.no_sync():
            if stage == self.cfg.num_stages - 1:
                torch.autograd.backward(self._scaled(out))
            else:
                grads = self._take_gradients(stage, m)
                needing = [o for o in out if o.requires_grad]
                if needing:
                    torch.autograd.backward(needing, grads)
        if stage > 0:
            self.outbox[(stage, m)] = [
                t.grad if t.grad is not None else torch.zeros_like(t) for t in inputs if _needs_grad(t)
            ]

    def _scaled(self, loss: torch.Tensor) -> torch.Tensor:
        if self.cfg.loss_scale != 1.0:  # haiscale's forward_backward: no scalar op and graph node per microbatch
            loss = loss * self.cfg.loss_scale
        return loss if self.cfg.grad_scaler is None else self.cfg.grad_scaler.scale(loss)

    def _live(self, stage: int) -> int:
        return sum(1 for s, _ in self.saved if s == stage)

    def _stage_inputs(self, stage: int, m: int) -> tuple[Any, ...]:
        if stage > 0:
            return self._take_activation(stage, m)
        if self.inputs is None:
            raise ValueError("the first stage needs the inputs; pass them to forward_backward / __call__")
        return self.inputs[m]

    # ----- communication -----------------------------------------------------------------------------

    def _peer(self, stage: int) -> int:
        return stage % self.cfg.num_ranks

    def _outgoing(self, send: Action, outs: list[torch.Tensor]) -> list[torch.Tensor | None]:
        """The header (when the schedule sends one) and payload of a stage's outputs."""
        stage, m = send.stage, send.microbatch
        metas = [p2p.TensorMeta.of(o) for o in outs]
        if has_header(send, self.cfg.header_every_microbatch):
            self.sent_metas[stage] = metas
            return [p2p.encode_header(outs).to(self.device), p2p.pack(outs)]
        if metas != self.sent_metas[stage]:
            raise ValueError(
                f"stage {stage} gave microbatch {m} outputs {metas}, but microbatch 0 gave {self.sent_metas[stage]}; "
                "in a training step every microbatch (an even split of one batch) must give the same shapes"
            )
        return [None, p2p.pack(outs)]

    def exchange(self, batch: Batch) -> None:
        """Issues one batch of the lowered schedule: every transfer in it, in its order, as one group."""
        transfers, ops, layouts = [], [], []
        for t in batch:
            message = self._message(t)
            if message is not None:  # None: a gradient message with no tensor that requires grad, at both ends
                transfers.append(t)
                ops.append(p2p.Op(t.is_send, message[0], self._peer(t.peer_stage)))
                layouts.append(message[1])
        try:
            works = p2p.exchange(ops, self.cfg.group)
        except RuntimeError as error:  # gloo: a peer that closed its connection fails the send at once
            raise PipelineCommunicationError(self._failure(transfers[0], error)) from error
        for t, op, metas, work in zip(transfers, ops, layouts, works, strict=True):
            if t.is_send:
                self.sends.append((t, work, op.tensor))
            else:
                self.received[t] = (op.tensor, metas, work)

    def _message(self, t: Transfer) -> tuple[torch.Tensor, list[p2p.TensorMeta]] | None:
        """The tensor to send, or the buffer to receive into with its layout."""
        stage, m = t.action.stage, t.action.microbatch
        kind = t.action.type
        if kind is ActionType.SEND_F:
            header, payload = self.outbox[(stage, m)]
            if not t.header:
                del self.outbox[(stage, m)]
            return (header if t.header else payload), []
        if kind is ActionType.SEND_B:
            grads = self.outbox.pop((stage, m))
            return (p2p.pack(grads), []) if grads else None
        if kind is ActionType.RECV_F and t.header:
            return self._buffer(t, [_HEADER]), []
        if kind is ActionType.RECV_F:
            metas = self._activation_metas(t)
        else:
            metas = [p2p.TensorMeta.of(o) for o in self.saved[(stage, m)][1] if o.requires_grad]
            if not metas:
                return None
        return self._buffer(t, metas), metas

    def _buffer(self, t: Transfer, metas: list[p2p.TensorMeta]) -> torch.Tensor:
        """A receive buffer: the pool's for this message of the step, when the step has a pool."""
        if self.cfg.buffers is None:
            return p2p.empty_buffer(metas, self.device)
        return self.cfg.buffers.get(t.key, metas, self.device)

    def _activation_metas(self, t: Transfer) -> list[p2p.TensorMeta]:
        """The payload's layout: from its header (waited for here: it came in an earlier batch) or this step's."""
        header = header_of(t, self.cfg.header_every_microbatch)
        if header in self.received:
            buffer, _, work = self.received.pop(header)
            self._wait(header, work)
            self.recv_metas[t.action.stage] = p2p.decode_header(buffer.cpu())
        return self.recv_metas[t.action.stage]

    def _take_activation(self, stage: int, m: int) -> tuple[Any, ...]:
        t = Transfer(Action(stage, ActionType.RECV_F, m))
        buffer, metas, work = self.received.pop(t)
        self._wait(t, work)
        tensors = p2p.unpack(buffer, metas)
        if self.cfg.training:
            for tensor, meta in zip(tensors, metas, strict=True):
                tensor.requires_grad_(meta.requires_grad)
        return tuple(tensors)

    def _take_gradients(self, stage: int, m: int) -> list[torch.Tensor]:
        t = Transfer(Action(stage, ActionType.RECV_B, m))
        if t not in self.received:
            return []
        buffer, metas, work = self.received.pop(t)
        self._wait(t, work)
        return p2p.unpack(buffer, metas)

    def _wait(self, t: Transfer, work: Any) -> None:
        """Waits for one transfer; a failure or timeout names the action, both stages and the schedule."""
        try:
            self.cfg.hosts.wait(work) if self.cfg.hosts is not None else work.wait()
        except RuntimeError as error:
            raise PipelineCommunicationError(self._failure(t, error)) from error

    def _failure(self, t: Transfer, error: RuntimeError) -> str:
        stage, m, peer = t.action.stage, t.action.microbatch, t.peer_stage
        what = {
            ActionType.RECV_F: f"receiving {stage}F{m}'s activation{' header' if t.header else ''} from stage {peer}",
            ActionType.SEND_F: f"sending {stage}F{m}'s activation{' header' if t.header else ''} to stage {peer}",
            ActionType.RECV_B: f"receiving {stage}B{m}'s output gradient from stage {peer}",
            ActionType.SEND_B: f"sending {stage}B{m}'s input gradient to stage {peer}",
        }[t.action.type]
        verb = "timed out" if "timed out" in str(error).lower() else "failed"
        own = _posted_failure(self._peer(peer), self.cfg.group)
        return (
            f"pipeline stage {stage} (rank {self._peer(stage)} of the pipeline group) {verb} {what} (rank "
            f"{self._peer(peer)}): {error}{own}\nschedule (compute per rank and step):\n{format_grid(self.schedule)}"
        )

    def finish(self, wait: bool) -> None:
        """Waits for every send (sent tensors must outlive their transfer), then drops the step's state."""
        if wait:
            for t, work, _ in self.sends:
                self._wait(t, work)
        self.sends.clear()
        self.saved.clear()
        self.received.clear()


def _device_of(modules: Sequence[nn.Module]) -> torch.device:
    for module in modules:
        for p in module.parameters():
            return p.device
    return torch.device("cpu")


def _as_tensors(out: Any, stage: int) -> list[torch.Tensor]:
    outs = list(out) if isinstance(out, (tuple, list)) else [out]
    if not outs or not all(torch.is_tensor(o) for o in outs):
        raise TypeError(
            f"stage {stage} must return a tensor or a tuple of tensors to send to the next stage, got {_describe(out)}"
        )
    return outs


def _needs_grad(t: Any) -> bool:
    return torch.is_tensor(t) and t.requires_grad


def _detach(out: Any) -> Any:
    if isinstance(out, (tuple, list)):
        return tuple(_detach(o) for o in out)
    return out.detach() if torch.is_tensor(out) else out


def _describe(value: Any) -> str:
    if torch.is_tensor(value):
        return f"a tensor of shape {tuple(value.shape)}"
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of ({', '.join(_describe(v) for v in value)})"
    return type(value).__name__


_FAILED = "lightning_haiscale/pipeline/failed/{}"  # + the global rank; in the default group's store


def _post_failure(item: Action | Batch, error: Exception) -> None:
    if not (dist.is_available() and dist.is_initialized()):
        return
    text = str(error).splitlines()[0][:400] if str(error) else ""
    try:
        job_store().set(_FAILED.format(dist.get_rank()), f"{_name(item)} raised {type(error).__name__}: {text}")
    except RuntimeError as failure:  # the store's host is gone: nothing to tell
        log.debug("could not post this stage's error: %s", failure)


def _posted_failure(peer: int, group: dist.ProcessGroup | None) -> str:
    """The error the peer (rank ``peer`` of ``group``) posted, as a sentence; or ``""``. It posted before its
    connections closed (they close when its process ends), so no wait is needed."""
    if not (dist.is_available() and dist.is_initialized()):
        return ""
    rank = dist.get_global_rank(group, peer) if group is not None else peer
    key = _FAILED.format(rank)
    try:
        store = job_store()
        return f"\n(global rank {rank}'s own error: {store.get(key).decode()})" if store.check([key]) else ""
    except RuntimeError:
        return ""
