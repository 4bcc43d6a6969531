"""The hook scheduler of :class:`~lightning_haiscale.fsdp.FullyShardedDataParallel`: from the module and autograd
hooks, when each unit is gathered, resharded and reduced within a step, and in which order.

[Note: schedule]
Forward: a unit's pre-forward hook waits for (or starts) its all-gather, starts the next unit's
all-gather (forward order recorded in the first forward), and installs the unsharded views; its
post-forward hook reshards it (the root stays unsharded: its backward comes first) and registers a
pre-backward hook on its outputs. Backward: the pre-backward hook unshards the unit again and, with
``BACKWARD_PRE``, starts the all-gather of the next unit in backward order (recorded in the first
backward); once the post-accumulate-grad hooks of the unit's parameters (see param_group [Note: unsharded
views and storage]) have all fired, the unit starts reducing its gradients (with ``BACKWARD_POST``, after
starting the next all-gather) and reshards, then finishes the previous unit's reduction (see [Note: one
reduce-scatter in flight]). Entering a unit's backward first starts reducing the gradients another,
interrupted unit already has (param_group [Note: reducing a unit's gradients]) and lets it give back the pages
of the gathered parameters nothing will read again (release [Note: releasing gathered parameters early]).
A callback queued on the autograd engine by the first backward hook (a :class:`BackwardPass` exists from then
on) waits for the last reductions once the whole backward is done, and gives the pieces their ``.grad``.
All ranks must run the same units in the same order, as with torch FSDP.

[Note: recomputation]
Under activation checkpointing (``fsdp.checkpointing``) backward runs a unit's forward again, and its forward
hooks with it, after its pre-backward hook has gathered it. Run as in forward, the pre-forward hook started
the all-gather of the next unit in forward order, whose backward was already done, and nothing resharded that
unit before the next step: every recomputation left one more unit gathered, and checkpointing raised the peak
memory instead of cutting it. So from the first backward hook to the end of backward, a unit's forward is a
recomputation: its pre-forward hook gathers the unit (one inside a larger checkpointed module may not be
gathered yet) and prefetches nothing; its post-forward hook does nothing once the unit's backward has begun
(its backward reads the parameters next; torch's reentrant checkpoint reaches that hook, the non-reentrant
one stops the recomputation before it), and otherwise reshards and registers the pre-backward hook as in
forward. FSDP2 skips its hooks the same way (its ``PRE_BACKWARD`` state). Inside a microbatch step (see [Note:
microbatch steps]) the whole model's forward may be recomputed too (a pipeline's ``checkpoint``): the root
gathers its own unit only, and the recomputed output starts no new backward pass. Outside one, a forward while
a backward pass is open is the next step's after an exception ended that backward, which is forgotten.

[Note: one reduce-scatter in flight]
A reduce-scatter reads the unit's whole unsharded gradient, which the engine keeps alive until the
collective is waited on. Waiting for all of them only at the end of backward kept every unit's unsharded
gradient alive at once: the size of the whole model in fp32 (1.5 GiB of GPT-2 Medium's 406M parameters),
the largest part of hai_fsdp's peak memory. So each unit's post-backward hook, after starting its own
reduce-scatter, waits for the previous unit's: the engine runs collectives in order and that one had the
current unit's whole backward to finish, so the wait is short, and at most two units' unsharded gradients
live at once, as in FSDP2 (an interrupted unit's parts count as one of them).

[Note: microbatch steps]
A pipeline runs each stage's forward and backward once per microbatch, each backward a ``backward()`` call of
its own. Run as separate steps, every microbatch gathered every unit for its forward and again for its
backward (for a stage of 4 units and 4 microbatches, 28 all-gathers per rank and step under FULL_SHARD, 16 under
SHARD_GRAD_OP). Inside
:meth:`StepScheduler.microbatch_step` (``FullyShardedDataParallel.microbatch_step``, which the pipelines enter
around every step of a stage that has it) the microbatches are one step, as torchtitan runs FSDP2 under
pipelining:

- a unit is gathered at its first use (the next one prefetched, as in any forward) and stays gathered until
  the step ends: no reshard after a forward (unless the step's ``reshard_after_forward``: then its backward
  gathers it again, and it stays gathered after that backward, since the next use is near), none after a
  backward but the last;
- every backward but the ``count``-th leaves its gradients unreduced on the leaves (ACCUMULATED, as under
  ``no_sync()``), where the next backward adds to them; the ``count``-th reduces each unit once, as a
  step's only backward would, and reshards it;
- the end of the step reshards every unit (a forward-only step of evaluation gathers each once too).

So a stage gathers each unit once per step and reduce-scatters it once. An interrupted unit gives nothing back
early (release [Note: releasing gathered parameters early]) but in the last backward: the next microbatch
would gather it again.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lightning_haiscale.fsdp.api import BackwardPrefetch
from lightning_haiscale.fsdp.param_group import FSDPParamGroup, GradShards, TrainingState

__all__ = ["BackwardPass", "MicrobatchStep", "StepScheduler"]


@dataclass
class BackwardPass:
    """One backward pass over the model (one ``backward()`` call reaching it), from its first hook to the
    callback that ends it: what the hooks of its units share.

    Attributes:
        sync: whether it reduces the gradients (False inside ``no_sync()`` and in a microbatch step's backwards
            but its last).
        reshard: whether each unit reshards once its backward is done (False in a microbatch step's backwards
            but its last, see [Note: microbatch steps]).
        unfinished: units holding gradients of this pass whose backward is not done, in the order they got them.
        reducing: the unit whose reduction started last (see [Note: one reduce-scatter in flight]).
    """

    sync: bool
    reshard: bool = True
    unfinished: dict[int, FSDPParamGroup] = field(default_factory=dict)
    reducing: FSDPParamGroup | None = None


@dataclass
class MicrobatchStep:
    """A step of ``count`` microbatches run as one (see [Note: microbatch steps]).

    Attributes:
        count: the microbatches of the step; its ``count``-th backward reduces the gradients.
        reshard_after_forward: whether a unit reshards after each microbatch's forward.
        backwards: the backward passes begun so far.
    """

    count: int
    reshard_after_forward: bool
    backwards: int = 0


class StepScheduler:
    """Gathers, reshards and reduces the units of one wrapped module from its hooks (see [Note: schedule]).

    Args:
        root: the wrapped module (its own unit, when it owns parameters, is gathered by :meth:`forward`).
        groups: every unit, by the module that owns it, in module order.
        backward_prefetch: when backward starts the next unit's all-gather (``None``: it does not).
        reshard_after_forward: whether a unit (but the root's) frees its gathered parameters after its forward.
    """

    def __init__(
        self,
        root: nn.Module,
        groups: dict[nn.Module, FSDPParamGroup],
        backward_prefetch: BackwardPrefetch | None,
        reshard_after_forward: bool,
    ) -> None:
        self.groups = groups
        self.root_group = groups.get(root)
        self.backward_prefetch = backward_prefetch
        self.reshard_after_forward = reshard_after_forward
        self.sync_grads = True
        """Whether the next backward reduces the gradients: the flag ``no_sync()`` turns off (see ``grad_sync``)."""
        self._forward_order: list[FSDPParamGroup] | None = None
        self._backward_order: list[FSDPParamGroup] | None = None
        self._recording: list[FSDPParamGroup] = []
        self._backward: BackwardPass | None = None
        self._step: MicrobatchStep | None = None
        self._grad_shards = GradShards(list(groups.values()))
        for group in groups.values():
            group.grad_space = functools.partial(self._grad_shards.take, group)
        self._register_hooks(root)

    def _register_hooks(self, root: nn.Module) -> None:
        for unit, group in self.groups.items():
            for index, leaf in enumerate(group.leaves):
                if leaf.requires_grad:
                    leaf.register_post_accumulate_grad_hook(functools.partial(self._grad_arrived, group, index))
            if unit is not root:
                unit.register_forward_pre_hook(functools.partial(self._unit_pre_forward, group))
                unit.register_forward_hook(functools.partial(self._unit_post_forward, group))
            for holder in group.holder_modules():  # see release [Note: releasing gathered parameters early]
                holder.register_forward_pre_hook(lambda module, args, group=group: group.holder_pre_forward())

    def reshard_all(self) -> None:
        """Every unit -> SHARDED (the modules hold their pieces)."""
        for group in self.groups.values():
            group.reshard()

    @contextmanager
    def microbatch_step(self, count: int, reshard_after_forward: bool) -> Iterator[None]:
        """Runs the forwards and backwards inside as one step of ``count`` microbatches (see [Note: microbatch
        steps]); ``RuntimeError`` at its end when some backward ran but not ``count`` of them."""
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ValueError(f"microbatch_step(count={count!r}): count is the number of microbatches, at least 1")
        if self._step is not None:
            raise RuntimeError("microbatch_step() is already active on this model; do not nest it")
        self._forget_unended_backward()
        self._step = step = MicrobatchStep(count, reshard_after_forward)
        try:
            yield
            if 0 < step.backwards != count:
                raise RuntimeError(
                    f"microbatch_step(count={count}) ran {step.backwards} backward passes, so no backward reduced "
                    f"the gradients (the {count}-th does); run one backward per microbatch, or pass their number"
                )
        except BaseException:
            self._forget_unended_backward()  # a backward the exception ended
            raise
        finally:
            self._step = None
            self.reshard_all()

    # ----------------------------------------------------------------------------- forward

    def forward(self, run: Callable[[], Any]) -> Any:
        """The root's forward: ``run()`` (the wrapped module's call) between the root unit's gather and the
        registration of the backward's first hook on its output."""
        if self._backward is not None and self._step is not None:  # see [Note: recomputation]
            if self.root_group is not None:
                self._gather_for_recomputation(self.root_group)
            return run()
        self._forget_unended_backward()
        if self.root_group is not None:
            self._pre_forward(self.root_group)
        output = run()
        if self._forward_order is None:
            self._forward_order, self._recording = self._recording, []
        tensors = _grad_tensors(output) if torch.is_grad_enabled() else []
        if tensors:
            torch.autograd.graph.register_multi_grad_hook(tensors, self._root_pre_backward, mode="any")
        elif self._step is None:  # no backward will follow (a microbatch step reshards at its end)
            self.reshard_all()
        return output

    def _forget_unended_backward(self) -> None:
        """Before a step, or leaving one by an exception: a backward that never ended (an exception inside it) is
        forgotten."""
        if self._backward is not None:
            self._backward = None
            for group in self.groups.values():
                group.forget_backward()

    def _pre_forward(self, group: FSDPParamGroup) -> None:
        if self._forward_order is None and group not in self._recording:
            self._recording.append(group)
        group.unshard()
        group.wait_unshard()
        _prefetch_after(self._forward_order, group)
        group.use_unsharded_views()

    def _unit_pre_forward(self, group: FSDPParamGroup, module: nn.Module, args: Any) -> None:
        if self._backward is not None:
            self._gather_for_recomputation(group)
        else:
            self._pre_forward(group)

    def _gather_for_recomputation(self, group: FSDPParamGroup) -> None:
        """A forward inside the backward: gathers ``group`` and prefetches nothing (see [Note: recomputation])."""
        group.unshard()
        group.wait_unshard()
        group.use_unsharded_views()

    def _unit_post_forward(self, group: FSDPParamGroup, module: nn.Module, args: Any, output: Any) -> None:
        if group.training_state is not TrainingState.IDLE:
            return  # a recomputation inside the unit's own backward, which reads the gathered parameters next
        if self._step.reshard_after_forward if self._step is not None else self.reshard_after_forward:
            group.reshard()
        tensors = _grad_tensors(output) if torch.is_grad_enabled() else []
        if tensors:
            hook = functools.partial(self._pre_backward, group)
            torch.autograd.graph.register_multi_grad_hook(tensors, hook, mode="any")

    # ---------------------------------------------------------------------------- backward

    def _begin_pass(self) -> BackwardPass:
        """The backward pass in progress; the first hook of a pass starts it and queues :meth:`_finalize_backward`
        for its end, the way torch DDP and FSDP do."""
        if self._backward is None:
            torch.autograd.Variable._execution_engine.queue_callback(self._finalize_backward)
            last = True
            if self._step is not None:  # see [Note: microbatch steps]
                self._step.backwards += 1
                last = self._step.backwards == self._step.count
            self._backward = BackwardPass(sync=self.sync_grads and last, reshard=last)
        return self._backward

    def _root_pre_backward(self, grad: torch.Tensor | None = None) -> None:
        self._begin_pass()
        if self.root_group is not None:
            self._pre_backward(self.root_group)

    def _pre_backward(self, group: FSDPParamGroup, grad: torch.Tensor | None = None) -> None:
        backward = self._begin_pass()
        if not group.begin_backward():
            return
        for other in [g for g in backward.unfinished.values() if g is not group]:  # in the order they got gradients
            del backward.unfinished[id(other)]  # see param_group [Note: reducing a unit's gradients]
            if other.reduce_arrived():
                self._reduction_started(other, backward)
            if backward.reshard:
                other.release_unread()
        if self._backward_order is None:
            self._recording.append(group)
        group.unshard()
        group.wait_unshard()
        group.use_unsharded_views()  # a checkpointed submodule of the unit, recomputed in backward, reads them
        if self.backward_prefetch is BackwardPrefetch.BACKWARD_PRE:
            _prefetch_after(self._backward_order, group)

    def _grad_arrived(self, group: FSDPParamGroup, index: int, leaf: torch.Tensor) -> None:
        backward = self._begin_pass()
        if group.grad_arrived(index, sync=backward.sync):
            backward.unfinished.pop(id(group), None)
            self._post_backward(group, backward)
        else:
            backward.unfinished[id(group)] = group

    def _post_backward(self, group: FSDPParamGroup, backward: BackwardPass) -> None:
        if self.backward_prefetch is BackwardPrefetch.BACKWARD_POST:
            _prefetch_after(self._backward_order, group)
        group.reduce_grad(sync=backward.sync)
        if backward.reshard:
            group.reshard()
        self._reduction_started(group, backward)

    def _reduction_started(self, group: FSDPParamGroup, backward: BackwardPass) -> None:
        previous, backward.reducing = backward.reducing, group
        if previous is not None and previous is not group:
            previous.finish_reduce()  # see [Note: one reduce-scatter in flight]

    def _finalize_backward(self) -> None:
        backward, self._backward = self._backward, None
        backward = backward if backward is not None else BackwardPass(sync=self.sync_grads)
        for group in self.groups.values():
            if backward.reshard:
                group.reshard()
            group.finalize_grads(sync=backward.sync)
        self._grad_shards.release()
        if self._backward_order is None:
            self._backward_order, self._recording = self._recording, []


def _prefetch_after(order: list[FSDPParamGroup] | None, group: FSDPParamGroup) -> None:
    """Starts the all-gather of the unit after ``group`` in a recorded order."""
    if order is None or group not in order:
        return
    index = order.index(group)
    if index + 1 < len(order):
        order[index + 1].unshard(async_op=True)


def _grad_tensors(output: Any) -> list[torch.Tensor]:
    """Tensors in a (nested) output that will receive gradients."""
    if isinstance(output, torch.Tensor):
        return [output] if output.requires_grad else []
    if isinstance(output, dict):
        output = list(output.values())
    if isinstance(output, (list, tuple)):
        return [t for item in output for t in _grad_tensors(item)]
    return []
