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
forward. FSDP2 skips its hooks the same way (its ``PRE_BACKWARD`` state).

[Note: one reduce-scatter in flight]
A reduce-scatter reads the unit's whole unsharded gradient, which the engine keeps alive until the
collective is waited on. Waiting for all of them only at the end of backward kept every unit's unsharded
gradient alive at once: the size of the whole model in fp32 (1.5 GiB of GPT-2 Medium's 406M parameters),
the largest part of hai_fsdp's peak memory. So each unit's post-backward hook, after starting its own
reduce-scatter, waits for the previous unit's: the engine runs collectives in order and that one had the
current unit's whole backward to finish, so the wait is short, and at most two units' unsharded gradients
live at once, as in FSDP2 (an interrupted unit's parts count as one of them).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lightning_haiscale.fsdp.api import BackwardPrefetch
from lightning_haiscale.fsdp.param_group import FSDPParamGroup, GradShards, TrainingState

__all__ = ["BackwardPass", "StepScheduler"]


@dataclass
class BackwardPass:
    """One backward pass over the model (one ``backward()`` call reaching it), from its first hook to the
    callback that ends it: what the hooks of its units share.

    Attributes:
        sync: whether it reduces the gradients (False inside ``no_sync()``).
        unfinished: units holding gradients of this pass whose backward is not done, in the order they got them.
        reducing: the unit whose reduction started last (see [Note: one reduce-scatter in flight]).
    """

    sync: bool
    unfinished: dict[int, FSDPParamGroup] = field(default_factory=dict)
    reducing: FSDPParamGroup | None = None


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

    # ----------------------------------------------------------------------------- forward

    def forward(self, run: Callable[[], Any]) -> Any:
        """The root's forward: ``run()`` (the wrapped module's call) between the root unit's gather and the
        registration of the backward's first hook on its output."""
        if self._backward is not None:  # the last backward never ended (an exception inside it)
            self._backward = None
            for group in self.groups.values():
                group.forget_backward()
        if self.root_group is not None:
            self._pre_forward(self.root_group)
        output = run()
        if self._forward_order is None:
            self._forward_order, self._recording = self._recording, []
        tensors = _grad_tensors(output) if torch.is_grad_enabled() else []
        if tensors:
            torch.autograd.graph.register_multi_grad_hook(tensors, self._root_pre_backward, mode="any")
        else:  # no backward will follow
            self.reshard_all()
        return output

    def _pre_forward(self, group: FSDPParamGroup) -> None:
        if self._forward_order is None and group not in self._recording:
            self._recording.append(group)
        group.unshard()
        group.wait_unshard()
        _prefetch_after(self._forward_order, group)
        group.use_unsharded_views()

    def _unit_pre_forward(self, group: FSDPParamGroup, module: nn.Module, args: Any) -> None:
        if self._backward is not None:  # a recomputation: prefetch nothing (see [Note: recomputation])
            group.unshard()
            group.wait_unshard()
            group.use_unsharded_views()
            return
        self._pre_forward(group)

    def _unit_post_forward(self, group: FSDPParamGroup, module: nn.Module, args: Any, output: Any) -> None:
        if group.training_state is not TrainingState.IDLE:
            return  # a recomputation inside the unit's own backward, which reads the gathered parameters next
        if self.reshard_after_forward:
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
            self._backward = BackwardPass(sync=self.sync_grads)
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
        group.reshard()
        self._reduction_started(group, backward)

    def _reduction_started(self, group: FSDPParamGroup, backward: BackwardPass) -> None:
        previous, backward.reducing = backward.reducing, group
        if previous is not None and previous is not group:
            previous.finish_reduce()  # see [Note: one reduce-scatter in flight]

    def _finalize_backward(self) -> None:
        backward, self._backward = self._backward, None
        sync = backward.sync if backward is not None else self.sync_grads
        for group in self.groups.values():
            group.reshard()
            group.finalize_grads(sync=sync)
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
