"""The one executor: runs any rank's action list with torch.distributed point-to-point operations.

[Note: executor semantics] Sends are asynchronous (``isend``; waited for at the end of the step); a
receive action posts an ``irecv`` and the compute that needs it waits. This is exactly the model
``schedule.simulate`` proves deadlock-free. Forwards on stage ``s`` keep ``(inputs, outputs)`` until the
backward of the same microbatch, so the number of live microbatches per stage is the schedule's
``live_activation_peak``; ``peak_live`` records what was observed.

[Note: data-parallel stages] A stage module with ``no_sync()`` (a data-parallel wrapper such as
``lightning_haiscale.ddp.DistributedDataParallel``) runs every backward but its last of the step inside
``no_sync()``, so the gradient all-reduce is issued by the final backward and overlaps it. When the
pipeline itself is inside ``no_sync()`` (gradient accumulation) every backward is. torch's
``DistributedDataParallel`` decides at *forward* time whether a backward reduces, which no pipeline
schedule can honor (backwards of other microbatches run between the last forward and the last
backward), so it is refused.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint as activation_checkpoint

from lightning_haiscale.pipeline import p2p
from lightning_haiscale.pipeline.schedule import Action, ActionType, format_grid

__all__ = ["StepResult", "run_actions"]

log = logging.getLogger(__name__)

_HEADER, _ACTIVATION, _GRADIENT = range(3)
LossFn = Callable[[int, Any], torch.Tensor]


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
    num_microbatches: int
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
) -> StepResult:
    """Runs this rank's ``actions`` on its stage ``modules`` (one per model chunk) and returns its results.

    ``inputs[m]`` is microbatch ``m``'s input tuple (first stage only). On the last stage
    ``config.loss_fn(m, output)`` gives microbatch ``m``'s loss; its backward is scaled by ``loss_scale``
    and then by ``grad_scaler`` (fp16 loss scaling), when there is one.
    On failure the schedule's grid is logged with the failing action.
    """
    step = _Step(modules, inputs, config, actions)
    done = False
    try:
        for index, action in enumerate(actions):
            try:
                step.run(action)
            except Exception:
                log.error("pipeline action %d (%s) failed; schedule:\n%s", index, action, format_grid(schedule))
                raise
        done = True
    finally:
        step.finish(wait=done)
    return step.result


class _Step:
    """The state of one step on one rank: posted receives, pending sends, saved activations."""

    def __init__(
        self,
        modules: Sequence[nn.Module],
        inputs: Sequence[tuple[Any, ...]] | None,
        config: StepConfig,
        actions: Sequence[Action],
    ) -> None:
        self.modules = modules
        self.inputs = inputs
        self.cfg = config
        self.device = _device_of(modules)
        self.result = StepResult()
        self.headers: dict[tuple[int, int], tuple[torch.Tensor, dist.Work]] = {}
        self.payloads: dict[tuple[int, int], tuple[torch.Tensor, list[p2p.TensorMeta], dist.Work]] = {}
        self.grads: dict[tuple[int, int], tuple[torch.Tensor, list[p2p.TensorMeta], dist.Work] | None] = {}
        self.saved: dict[tuple[int, int], tuple[tuple[Any, ...], Any]] = {}
        self.outbox: dict[tuple[int, int], list[Any]] = {}
        self.sent_metas: dict[int, list[p2p.TensorMeta]] = {}
        self.recv_metas: dict[int, list[p2p.TensorMeta]] = {}
        self.deferred: dict[int, list[int]] = {}
        self.sends: list[tuple[dist.Work, torch.Tensor]] = []
        self.last_backward = {a.stage: i for i, a in enumerate(actions) if a.type is ActionType.BACKWARD}
        self.position = 0

    def run(self, action: Action) -> None:
        handler = {
            ActionType.FORWARD: self.forward,
            ActionType.BACKWARD: self.backward,
            ActionType.SEND_F: self.send_activation,
            ActionType.RECV_F: self.post_activation,
            ActionType.SEND_B: self.send_gradient,
            ActionType.RECV_B: self.post_gradient,
        }[action.type]
        handler(action.stage, action.microbatch)
        self.position += 1

    # ----- compute -----------------------------------------------------------------------------------

    def forward(self, stage: int, m: int) -> None:
        self._advance()
        module = self.modules[stage // self.cfg.num_ranks]
        inputs = self._stage_inputs(stage, m)
        last = stage == self.cfg.num_stages - 1
        with contextlib.ExitStack() as stack:
            if self.cfg.forward_context is not None and self.cfg.training:
                stack.enter_context(self.cfg.forward_context())
            if self.cfg.training and self.cfg.checkpoint(m) and not last:
                out = activation_checkpoint(module, *inputs, use_reentrant=False)
            else:
                out = module(*inputs)
            loss = self.cfg.loss_fn(m, out) if last and self.cfg.loss_fn is not None else None
        if last:
            self._finish_last_forward(stage, m, inputs, out, loss)
            return
        outs = _as_tensors(out, stage)
        if self.cfg.training:
            self.saved[(stage, m)] = (inputs, outs)
            self.result.peak_live = max(self.result.peak_live, self._live(stage))
        self.outbox[(stage, m)] = self._outgoing(stage, m, outs)

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
        self._advance()
        module = self.modules[stage // self.cfg.num_ranks]
        inputs, out = self.saved.pop((stage, m))
        final = self.last_backward[stage] == self.position and self.cfg.sync_grads
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

    def _tag(self, kind: int, stage: int, m: int) -> int:
        return (kind * self.cfg.num_stages + stage) * self.cfg.num_microbatches + m

    def _peer(self, stage: int) -> int:
        return stage % self.cfg.num_ranks

    def _has_header(self, m: int) -> bool:
        return m == 0 or self.cfg.header_every_microbatch

    def _outgoing(self, stage: int, m: int, outs: list[torch.Tensor]) -> list[torch.Tensor | None]:
        """The header (first microbatch, or every one in evaluation) and payload of a stage's outputs."""
        metas = [p2p.TensorMeta.of(o) for o in outs]
        if self._has_header(m):
            self.sent_metas[stage] = metas
            return [p2p.encode_header(outs).to(self.device), p2p.pack(outs)]
        if metas != self.sent_metas[stage]:
            raise ValueError(
                f"stage {stage} gave microbatch {m} outputs {metas}, but microbatch 0 gave {self.sent_metas[stage]}; "
                "in a training step every microbatch (an even split of one batch) must give the same shapes"
            )
        return [None, p2p.pack(outs)]

    def send_activation(self, stage: int, m: int) -> None:
        header, payload = self.outbox.pop((stage, m))
        for tensor, kind in ((header, _HEADER), (payload, _ACTIVATION)):
            if tensor is not None:
                work = p2p.isend(tensor, self._peer(stage + 1), self.cfg.group, self._tag(kind, stage + 1, m))
                self.sends.append((work, tensor))

    def post_activation(self, stage: int, m: int) -> None:
        """Posts the header receive, or the payload's when this step's shapes on this edge are known."""
        if self._has_header(m):
            header = torch.empty(p2p.HEADER_SLOTS, dtype=torch.int64, device=self.device)
            work = p2p.irecv(header, self._peer(stage - 1), self.cfg.group, self._tag(_HEADER, stage, m))
            self.headers[(stage, m)] = (header, work)
        elif stage in self.recv_metas:
            self._post_payload(stage, m, self.recv_metas[stage])
        else:
            self.deferred.setdefault(stage, []).append(m)

    def _receive_header(self, key: tuple[int, int]) -> None:
        header, work = self.headers.pop(key)
        work.wait()
        stage, m = key
        self.recv_metas[stage] = p2p.decode_header(header.cpu())
        self._post_payload(stage, m, self.recv_metas[stage])
        for later in self.deferred.pop(stage, []):
            self._post_payload(stage, later, self.recv_metas[stage])

    def _post_payload(self, stage: int, m: int, metas: list[p2p.TensorMeta]) -> None:
        buffer = p2p.empty_buffer(metas, self.device)
        work = p2p.irecv(buffer, self._peer(stage - 1), self.cfg.group, self._tag(_ACTIVATION, stage, m))
        self.payloads[(stage, m)] = (buffer, metas, work)

    def _advance(self) -> None:
        """Posts the payload receive of every arrived header (payloads move during compute); reaps sends."""
        self.sends = [(work, tensor) for work, tensor in self.sends if not work.is_completed()]
        for key in [k for k, (_, work) in self.headers.items() if work.is_completed()]:
            self._receive_header(key)

    def _take_activation(self, stage: int, m: int) -> tuple[Any, ...]:
        if (stage, m) in self.headers:
            self._receive_header((stage, m))
        buffer, metas, work = self.payloads.pop((stage, m))
        work.wait()
        tensors = p2p.unpack(buffer, metas)
        if self.cfg.training:
            for t, meta in zip(tensors, metas, strict=True):
                t.requires_grad_(meta.requires_grad)
        return tuple(tensors)

    def send_gradient(self, stage: int, m: int) -> None:
        grads = self.outbox.pop((stage, m))
        if grads:
            payload = p2p.pack(grads)
            work = p2p.isend(payload, self._peer(stage - 1), self.cfg.group, self._tag(_GRADIENT, stage - 1, m))
            self.sends.append((work, payload))

    def post_gradient(self, stage: int, m: int) -> None:
        _, outs = self.saved[(stage, m)]
        metas = [p2p.TensorMeta.of(o) for o in outs if o.requires_grad]
        if not metas:
            self.grads[(stage, m)] = None
            return
        buffer = p2p.empty_buffer(metas, self.device)
        work = p2p.irecv(buffer, self._peer(stage + 1), self.cfg.group, self._tag(_GRADIENT, stage, m))
        self.grads[(stage, m)] = (buffer, metas, work)

    def _take_gradients(self, stage: int, m: int) -> list[torch.Tensor]:
        posted = self.grads.pop((stage, m))
        if posted is None:
            return []
        buffer, metas, work = posted
        work.wait()
        return p2p.unpack(buffer, metas)

    def finish(self, wait: bool) -> None:
        """Waits for every send (sent tensors must outlive their transfer), then drops the step's state."""
        if wait:
            for work, _ in self.sends:
                work.wait()
        self.sends.clear()
        self.saved.clear()


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
