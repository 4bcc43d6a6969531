"""``FullyShardedDataParallel``: ZeRO-3 sharding of a module over the hfreduce engine (ZeRO-2, replicated and
hybrid sharding are the same machine with other groups, see sharding [Note: one machine for every strategy]).

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
A callback queued on the
autograd engine by the root's pre-backward hook waits for the last reductions once the whole backward is
done, and gives the pieces their ``.grad``.
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
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_haiscale.clip_grad import clip_grad_norm_
from lightning_haiscale.fsdp.api import BackwardPrefetch, MixedPrecision, StateDictType
from lightning_haiscale.fsdp.arrival import ArrivalCheck
from lightning_haiscale.fsdp.collectives import broadcast_from_first
from lightning_haiscale.fsdp.deferred_init import materialize_unit
from lightning_haiscale.fsdp.layout import ShardLayout
from lightning_haiscale.fsdp.mesh import strategy_groups
from lightning_haiscale.fsdp.names import buffers_by_key, keys_of, state_dict_names
from lightning_haiscale.fsdp.optim_state import (
    gather_full_optim_state,
    load_full_optim_state,
    load_local_optim_states,
    local_optim_state,
)
from lightning_haiscale.fsdp.options import check_cpu_offload, check_flags, ignored
from lightning_haiscale.fsdp.param_group import FSDPParamGroup, GradShards, ShardState, TrainingState
from lightning_haiscale.fsdp.sharding import ShardingStrategy, resolve_strategy
from lightning_haiscale.fsdp.state_dict import (
    gather_full_state,
    load_full_state,
    load_local_states,
    local_state,
    summoned_state_dict,
)
from lightning_haiscale.fsdp.wrap import AutoWrapPolicy, assign_params, unit_modules, unit_scopes
from lightning_haiscale.grad_sync import sync_off
from lightning_haiscale.hfreduce import Communicator

__all__ = ["FullyShardedDataParallel"]


class FullyShardedDataParallel(nn.Module):
    """Shards ``module``'s parameters, gradients and optimizer state over the ranks of ``process_group`` (or,
    per ``sharding_strategy``, over each host or a mesh dimension, replicated across the others: see sharding
    [Note: one machine for every strategy]).

    Build the optimizer after wrapping, from ``model.parameters()``: it sees only this rank's pieces.

    [Note: what the optimizer sees]
    Each original parameter is replaced by its *piece*: a 1-D ``nn.Parameter`` holding the elements of the
    flattened parameter that lie in this rank's shard (possibly none), under the original name. What that
    costs a user:

    - A rule by shape (nanoGPT's "decay tensors with ``p.dim() >= 2``") sees 1-D pieces and goes wrong.
      Select by name (``named_parameters()`` keeps the original names, so the same rule gives the same
      groups under every strategy) or, where the shape is really needed, by ``model.layout`` (each
      parameter's name, shape and slice). ``examples/gpt/lightning_module.py`` shows the by-name mask.
    - Parameter groups may split a unit's parameters as they like (each piece is its own parameter), but a
      piece can be empty, and per-element state is kept only for pieces: optimizers whose state is not
      elementwise (Shampoo, Adafactor's factored moments, LARS's per-tensor norm) compute it per piece, not
      per parameter; use them with one unit per parameter or not at all.
    - All the parameters of one unit share one dtype (one flat shard): parameters of another dtype go into a
      unit of their own (``auto_wrap_policy``).
    - Optimizer state dicts are keyed by parameter name (see ``optim_state``), not by position.

    Checkpoints: one method per operation, collective ones checked for every rank's arrival (see [Note: why
    an arrival check]): :meth:`full_state_dict`, :meth:`sharded_state_dict`, :meth:`load_full_state_dict`,
    :meth:`load_sharded_state_dict`, the same four for an optimizer (:meth:`full_optim_state_dict`, ...), and
    ``state_dict()`` / ``load_state_dict()`` per :meth:`state_dict_type`. ``fsdp.dcp`` writes and reads the
    sharded forms as a ``torch.distributed.checkpoint`` folder.

    Args:
        module: the model; parameters may be on the meta device (materialized unit by unit, see
            ``param_init_fn``), so the whole model never exists on one rank.
        process_group: ranks of the model (default: the world), or torch FSDP1's ``(shard_group,
            replicate_group)`` pair for hybrid sharding. Ignored when ``communicator`` is given.
        auto_wrap_policy: which submodules become units of their own (see ``wrap.AutoWrapPolicy``);
            ``None``: one unit for the whole model.
        backward_prefetch: when backward prefetches the next unit (``None``: no backward prefetch).
        reshard_after_forward: ``False`` keeps each unit's gathered parameters from its forward to its backward:
            the same setting as ``sharding_strategy="SHARD_GRAD_OP"`` (``HYBRID_SHARD`` becomes
            ``_HYBRID_SHARD_ZERO2``; see sharding [Note: one machine for every strategy]).
        mixed_precision: dtypes of the gathered parameters and of gradient reduction.
        device_id: device of the shards (an index means a CUDA device); default the parameters' device.
        sharding_strategy: torch FSDP's ``ShardingStrategy`` (member or name): ``FULL_SHARD``,
            ``SHARD_GRAD_OP``, ``NO_SHARD``, ``HYBRID_SHARD`` or ``_HYBRID_SHARD_ZERO2``.
        device_mesh: for hybrid sharding, a 2-D torch ``DeviceMesh`` (dims: replicate, shard) or a ``(replicate,
            shard)`` tuple; default: shard within each host, replicate across hosts (see mesh [Note: hybrid
            groups by default]).
        cpu_offload, ignored_modules, sync_module_states, limit_all_gathers, forward_prefetch, use_orig_params:
            torch FSDP's, with the meanings of options [Note: torch's keywords, honoured].
        param_init_fn: ``fn(module)`` initializing a module's meta-device parameters in place;
            default ``module.reset_parameters()``.
        communicator: an existing engine over the model's ranks to use (its group replaces ``process_group``;
            :meth:`close` stops it); hybrid sharding builds its two engines over that group instead, with its
            timeout, and stops it.
        timeout: the deadline of every wait on a peer in the engines it builds (default 5 minutes; with
            ``communicator``, that engine's own).
        arrival_timeout: how long a collective call (``state_dict()`` outside ``summon_full_params``,
            ``summon_full_params()``) waits for every rank to make it before raising
            :class:`~lightning_haiscale.fsdp.arrival.CollectiveMisuseError` (see [Note: why an arrival check]).
    """

    def __init__(
        self,
        module: nn.Module,
        process_group: dist.ProcessGroup | tuple[dist.ProcessGroup, dist.ProcessGroup] | None = None,
        auto_wrap_policy: AutoWrapPolicy | None = None,
        backward_prefetch: BackwardPrefetch | None = BackwardPrefetch.BACKWARD_PRE,
        reshard_after_forward: bool = True,
        mixed_precision: MixedPrecision | None = None,
        device_id: int | torch.device | None = None,
        *,
        sharding_strategy: ShardingStrategy | str | Any = "FULL_SHARD",
        device_mesh: DeviceMesh | tuple[int, int] | None = None,
        cpu_offload: Any = None,
        ignored_modules: Iterable[nn.Module] | None = None,
        sync_module_states: bool = False,
        limit_all_gathers: bool = True,
        forward_prefetch: bool = False,
        use_orig_params: bool = True,
        param_init_fn: Callable[[nn.Module], None] | None = None,
        communicator: Communicator | None = None,
        arrival_timeout: timedelta = timedelta(seconds=30),
        timeout: timedelta | None = None,
    ) -> None:
        super().__init__()
        _check_args(module, backward_prefetch, mixed_precision)
        check_flags(
            sync_module_states=sync_module_states,
            limit_all_gathers=limit_all_gathers,
            forward_prefetch=forward_prefetch,
            use_orig_params=use_orig_params,
        )
        self.sharding_strategy = resolve_strategy(sharding_strategy, reshard_after_forward)
        """The strategy in effect (``reshard_after_forward=False`` made FULL_SHARD into SHARD_GRAD_OP)."""
        self.reshard_after_forward = self.sharding_strategy.reshard_after_forward
        self.device = _resolve_device(device_id, module)
        check_cpu_offload(cpu_offload, self.device)
        self._ignored_modules, self._ignored_params = ignored(module, ignored_modules)
        self.module = module
        self.backward_prefetch = backward_prefetch
        self.mixed_precision = mixed_precision
        self.comm, self.replicate_comm, self.process_group = self._communicators(
            process_group, device_mesh, communicator, timeout
        )
        self._closed = False
        units = [u for u in unit_modules(module, auto_wrap_policy) if id(u) not in self._ignored_modules]
        self._groups = self._build_groups(units, param_init_fn, sync_module_states)
        self._root_group = self._groups.get(module)
        self._grad_shards = GradShards(list(self._groups.values()))
        for group in self._groups.values():
            group.grad_space = functools.partial(self._grad_shards.take, group)
        self._named_pieces = list(module.named_parameters(remove_duplicate=False))
        self.layout = ShardLayout(
            units=tuple(group.layout for group in self._groups.values()),
            rank=self.comm.rank,
            world_size=self.comm.world_size,
            keys=tuple(module.state_dict(keep_vars=True).keys()),
        )
        """This rank's sharding: the units and, per unit, each parameter's names, shape and slice."""
        _move_buffers(module, self.device)
        if sync_module_states:
            broadcast_from_first(list(module.buffers()), self.process_group)
        self._register_hooks()
        self._sync_grads = True
        self._forward_order: list[FSDPParamGroup] | None = None
        self._backward_order: list[FSDPParamGroup] | None = None
        self._recording: list[FSDPParamGroup] = []
        self._training_state = TrainingState.IDLE  # PRE_BACKWARD from the first backward hook to _finalize_backward
        self._reducing: FSDPParamGroup | None = None  # the unit whose reduce-scatter started last
        self._unfinished: dict[int, FSDPParamGroup] = {}  # units holding gradients, their backward not done
        self._state_dict_type = StateDictType.FULL
        self._holds_full: bool | None = None  # inside summon_full_params: whether this rank holds them
        self._arrival = ArrivalCheck(self.process_group, arrival_timeout)

    # ------------------------------------------------------------------------ construction

    def _communicators(
        self, process_group: Any, device_mesh: Any, communicator: Communicator | None, timeout: timedelta | None
    ) -> tuple[Communicator, Communicator | None, dist.ProcessGroup]:
        """The engines over the shard and replicate groups, and the group of every rank of the model. A given
        ``communicator`` over the whole group is the shard engine (FULL_SHARD, SHARD_GRAD_OP) or the replicate
        one (NO_SHARD); hybrid sharding needs two others over its group (with its timeout) and stops it."""
        strategy = self.sharding_strategy
        if communicator is not None:
            timeout = communicator.timeout
        timeout = timeout if timeout is not None else timedelta(minutes=5)
        if communicator is not None:
            if not strategy.hybrid and strategy is not ShardingStrategy.NO_SHARD:
                return communicator, None, communicator.group
            process_group = communicator.group
        shard, replicate, whole = strategy_groups(strategy, process_group, device_mesh)
        if communicator is not None and strategy is ShardingStrategy.NO_SHARD and replicate is not None:
            return Communicator(shard, timeout=timeout), communicator, whole
        if communicator is not None:  # unused: hybrid groups, or NO_SHARD on one rank (nothing to replicate)
            communicator.close()
        replicate_comm = Communicator(replicate, timeout=timeout) if replicate is not None else None
        return Communicator(shard, timeout=timeout), replicate_comm, whole

    def _build_groups(
        self, units: list[nn.Module], param_init_fn: Callable[[nn.Module], None] | None, sync: bool
    ) -> dict[nn.Module, FSDPParamGroup]:
        """Materializes (and with ``sync``, broadcasts from the first rank) and shards the units innermost first,
        so one unit at a time is whole."""
        owned = assign_params(self.module, units)
        names = state_dict_names(self.module)  # see names [Note: state-dict keys are not parameter names]
        for refs in owned.values():
            refs[:] = [ref for ref in refs if id(ref.param) not in self._ignored_params]
            for ref in refs:
                ref.fqns = keys_of(ref.fqns, names)
        scopes = unit_scopes(self.module, units)
        shapes: dict[int, torch.Size] = {}
        groups: dict[nn.Module, FSDPParamGroup] = {}
        for unit in reversed(units):
            refs = owned[unit]
            materialize_unit(refs, scopes[unit], self.device, param_init_fn, shapes, root=self.module)
            if not refs:
                continue
            if sync:
                broadcast_from_first([ref.param for ref in refs], self.process_group)
            group = FSDPParamGroup(refs, self.comm, self.device, self.mixed_precision, self.replicate_comm)
            refs.clear()  # drop the last references to the whole parameters
            shapes.update((id(piece), info.shape) for piece, info in zip(group.pieces, group.infos, strict=True))
            groups[unit] = group
        return dict(reversed(groups.items()))

    def _register_hooks(self) -> None:
        for unit, group in self._groups.items():
            for index, leaf in enumerate(group.leaves):
                if leaf.requires_grad:
                    leaf.register_post_accumulate_grad_hook(functools.partial(self._grad_arrived, group, index))
            if unit is not self.module:
                unit.register_forward_pre_hook(functools.partial(self._unit_pre_forward, group))
                unit.register_forward_hook(functools.partial(self._unit_post_forward, group))
            for holder in group.holder_modules():  # see release [Note: releasing gathered parameters early]
                holder.register_forward_pre_hook(lambda module, args, group=group: group.holder_pre_forward())

    # ----------------------------------------------------------------------------- forward

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self._open()
        if self._training_state is not TrainingState.IDLE:  # the last backward never ended (an exception)
            self._training_state = TrainingState.IDLE
            for group in self._groups.values():
                group.forget_backward()
        if self._root_group is not None:
            self._pre_forward(self._root_group)
        if self.mixed_precision is not None and self.mixed_precision.cast_forward_inputs:
            args, kwargs = _cast_floats((args, kwargs), self.mixed_precision.param_dtype)
        output = self.module(*args, **kwargs)
        if self._forward_order is None:
            self._forward_order, self._recording = self._recording, []
        tensors = _grad_tensors(output) if torch.is_grad_enabled() else []
        if tensors:
            torch.autograd.graph.register_multi_grad_hook(tensors, self._root_pre_backward, mode="any")
        else:  # no backward will follow
            for group in self._groups.values():
                group.reshard()
        return output

    def _pre_forward(self, group: FSDPParamGroup) -> None:
        if self._forward_order is None and group not in self._recording:
            self._recording.append(group)
        group.unshard()
        group.wait_unshard()
        _prefetch_after(self._forward_order, group)
        group.use_unsharded_views()

    def _unit_pre_forward(self, group: FSDPParamGroup, module: nn.Module, args: Any) -> None:
        if self._training_state is TrainingState.PRE_BACKWARD:  # a recomputation: prefetch nothing (see [Note: ...])
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

    def _queue_finalize(self) -> None:
        """Runs :meth:`_finalize_backward` once the whole backward is done (queued once per backward, from
        whichever hook fires first), the way torch DDP and FSDP do."""
        if self._training_state is TrainingState.IDLE:
            torch.autograd.Variable._execution_engine.queue_callback(self._finalize_backward)
            self._training_state = TrainingState.PRE_BACKWARD

    def _root_pre_backward(self, grad: torch.Tensor | None = None) -> None:
        self._queue_finalize()
        if self._root_group is not None:
            self._pre_backward(self._root_group)

    def _pre_backward(self, group: FSDPParamGroup, grad: torch.Tensor | None = None) -> None:
        self._queue_finalize()
        if not group.begin_backward():
            return
        for other in [g for g in self._unfinished.values() if g is not group]:  # in the order they got gradients
            del self._unfinished[id(other)]  # see param_group [Note: reducing a unit's gradients]
            if other.reduce_arrived():
                self._reduction_started(other)
            other.release_unread()
        if self._backward_order is None:
            self._recording.append(group)
        group.unshard()
        group.wait_unshard()
        group.use_unsharded_views()  # a checkpointed submodule of the unit, recomputed in backward, reads them
        if self.backward_prefetch is BackwardPrefetch.BACKWARD_PRE:
            _prefetch_after(self._backward_order, group)

    def _grad_arrived(self, group: FSDPParamGroup, index: int, leaf: torch.Tensor) -> None:
        self._queue_finalize()
        if group.grad_arrived(index, sync=self._sync_grads):
            self._unfinished.pop(id(group), None)
            self._post_backward(group)
        else:
            self._unfinished[id(group)] = group

    def _post_backward(self, group: FSDPParamGroup) -> None:
        if self.backward_prefetch is BackwardPrefetch.BACKWARD_POST:
            _prefetch_after(self._backward_order, group)
        group.reduce_grad(sync=self._sync_grads)
        self._reduction_started(group)

    def _reduction_started(self, group: FSDPParamGroup) -> None:
        previous, self._reducing = self._reducing, group
        if previous is not None and previous is not group:
            previous.finish_reduce()  # see [Note: one reduce-scatter in flight]

    def _finalize_backward(self) -> None:
        for group in self._groups.values():
            group.finalize_grads(sync=self._sync_grads)
        self._grad_shards.release()
        if self._backward_order is None:
            self._backward_order, self._recording = self._recording, []
        self._unfinished.clear()
        self._training_state = TrainingState.IDLE
        self._reducing = None

    # ------------------------------------------------------------------------- public API

    def named_parameters(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, nn.Parameter]]:
        """This rank's pieces under the original parameter names (no ``module.`` prefix)."""
        seen: set[int] = set()
        for name, piece in self._named_pieces:
            if remove_duplicate and id(piece) in seen:
                continue
            seen.add(id(piece))
            yield (f"{prefix}.{name}" if prefix else name), piece

    def no_sync(self) -> AbstractContextManager[None]:
        """Backward passes inside accumulate unsharded gradients locally; the first one outside reduces them."""
        return sync_off(self, "_sync_grads")

    def close(self) -> None:
        """Stops the communication engine (its thread and shared memory) when training is over. Idempotent.

        The shards stay: the next forward, ``summon_full_params()`` or collective checkpoint call starts a new
        engine over the same group (collectively, as construction did) and closes it again only on request.
        """
        self.comm.close()
        if self.replicate_comm is not None:
            self.replicate_comm.close()
        self._closed = True

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` stopped the engine and no call has needed a new one since."""
        return self._closed

    def _open(self) -> None:
        """Before a collective: a new engine if :meth:`close` stopped the last one (see :meth:`close`)."""
        if not self._closed:
            return
        self.comm = Communicator(self.comm.group, timeout=self.comm.timeout)
        if self.replicate_comm is not None:
            self.replicate_comm = Communicator(self.replicate_comm.group, timeout=self.replicate_comm.timeout)
        for group in self._groups.values():
            group.comm, group.replicate = self.comm, self.replicate_comm
        self._closed = False

    @contextmanager
    def summon_full_params(self, writeback: bool = True, rank0_only: bool = False) -> Iterator[None]:
        """Inside, the wrapped module holds its whole parameters (on rank 0 only with ``rank0_only``).

        Entering is collective (every rank, between steps); inside, ``state_dict()`` is local: haiscale's
        ``with model.summon_full_params(): if rank == 0: torch.save(model.state_dict(), path)`` works.

        Args:
            writeback: copy changes made inside back into the shards on exit.
            rank0_only: only rank 0 keeps the whole parameters (then ``writeback`` must be False).
        """
        if rank0_only and writeback:
            raise ValueError(
                "summon_full_params(writeback=True, rank0_only=True) is not supported; pass writeback=False"
            )
        if any(g.state is not ShardState.SHARDED for g in self._groups.values()):
            raise RuntimeError("summon_full_params() cannot run inside forward or backward; call it between steps")
        if self._holds_full is not None:
            raise RuntimeError("summon_full_params() is already active on this model; do not nest it")
        self.expect_every_rank("summon_full_params()")
        self._open()
        summoned: list[tuple[FSDPParamGroup, torch.Tensor]] = []
        self._holds_full = not rank0_only or self._first_rank
        try:
            for group in self._groups.values():
                full = group.gather_full()
                if not rank0_only or self._first_rank:
                    views = group.full_views(full)
                    group.set_params(
                        [
                            nn.Parameter(v, requires_grad=p.requires_grad)
                            for v, p in zip(views, group.pieces, strict=True)
                        ]
                    )
                    summoned.append((group, full))
            yield
        finally:
            self._holds_full = None
            for group, full in summoned:
                if writeback:
                    group.write_back(full)
                group.use_pieces()

    def expect_every_rank(self, call: str, hint: str = "") -> None:
        """Before a collective ``call``: raises :class:`~lightning_haiscale.fsdp.arrival.CollectiveMisuseError`
        unless every rank makes it within ``arrival_timeout`` (see [Note: why an arrival check])."""
        self._arrival(call, hint)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Scales the gradients so that their norm over all ranks is at most ``max_norm``; returns that norm."""
        return clip_grad_norm_(self.parameters(), max_norm, norm_type, self.comm.group)

    @contextmanager
    def state_dict_type(self, kind: StateDictType | str) -> Iterator[None]:
        """``state_dict()`` and ``load_state_dict()`` use ``kind`` inside (default ``FULL``)."""
        previous, self._state_dict_type = self._state_dict_type, StateDictType(kind)
        try:
            yield
        finally:
            self._state_dict_type = previous

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:  # type: ignore[override]
        """Full (bare-module keys, CPU) or sharded, per :meth:`state_dict_type`.

        Full: inside :meth:`summon_full_params` it is local (no communication) and whole on every rank that
        holds the parameters (rank 0 only with ``rank0_only=True``; ``{}`` elsewhere); outside, it is
        collective (call it on every rank; a call on a subset raises, see [Note: why an arrival check]) and
        whole on rank 0, ``{}`` elsewhere. Sharded: this rank's pieces, local.
        """
        if self._state_dict_type is not StateDictType.FULL:
            return self.sharded_state_dict()
        if self._holds_full is not None:
            return summoned_state_dict(self.module) if self._holds_full else {}
        self.expect_every_rank("state_dict()", " outside summon_full_params")
        return self._gather_full_state(rank0_only=True)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:  # type: ignore[override]
        """Loads a full state dict (on every rank) or this world's sharded ones, per :meth:`state_dict_type`.

        The values are copied into this rank's shards; ``assign=True`` (replace the tensors) cannot apply to
        a sharded model and raises.
        """
        if assign:
            raise ValueError(
                "FullyShardedDataParallel.load_state_dict(assign=True) is not supported: parameters live in "
                "flat shards, so values are copied into them. Call it with assign=False."
            )
        if self._state_dict_type is StateDictType.FULL:
            return self.load_full_state_dict(state_dict, strict=strict)
        return self.load_sharded_state_dict([state_dict], strict=strict)

    # -------------------------------------------------------------------------- checkpoints

    def full_state_dict(self, rank0_only: bool = True) -> dict[str, torch.Tensor]:
        """Every parameter whole, on the CPU, keyed as the bare module's ``state_dict()``; with ``rank0_only``
        the other ranks get ``{}``. Collective (a call on a subset of ranks raises); one unit at a time."""
        self.expect_every_rank("full_state_dict()")
        return self._gather_full_state(rank0_only)

    def sharded_state_dict(self) -> dict[str, Any]:
        """This rank's pieces and their layout (see ``state_dict`` [Note: sharded format]). No collectives."""
        return local_state(self.layout, self._flat_shards(), self._buffers_by_name())

    def load_full_state_dict(
        self, state_dict: Mapping[str, torch.Tensor], strict: bool = True
    ) -> tuple[list[str], list[str]]:
        """Copies this rank's pieces out of a full state dict given on every rank (memory-map it when loading
        from a file, so the ranks share one copy). No collectives. Returns (missing, unexpected) keys."""
        return load_full_state(self.layout, self._flat_shards(), self._buffers_by_name(), state_dict, strict)

    def load_sharded_state_dict(
        self, shards: Iterable[Mapping[str, Any]], strict: bool = True
    ) -> tuple[list[str], list[str]]:
        """Fills this rank's pieces from sharded state dicts saved at any world size (each read once, in any
        order). No collectives. Returns (missing, unexpected) parameter names."""
        return load_local_states(self.layout, self._flat_shards(), self._buffers_by_name(), shards, strict)

    def full_optim_state_dict(self, optimizer: torch.optim.Optimizer, rank0_only: bool = True) -> dict[str, Any]:
        """``optimizer``'s whole state by parameter name, on the CPU of rank 0 (``{}`` elsewhere, unless not
        ``rank0_only``). Collective: a call on a subset of ranks raises ``CollectiveMisuseError``."""
        self.expect_every_rank("full_optim_state_dict()")
        self._open()
        keep = not rank0_only or self._first_rank
        return gather_full_optim_state(self.layout, self._pieces(), optimizer, self.comm, keep)

    def sharded_optim_state_dict(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """This rank's part of ``optimizer``'s state by parameter name, with its layout. No collectives."""
        return local_optim_state(self.layout, self._pieces(), optimizer)

    def load_full_optim_state_dict(self, optimizer: torch.optim.Optimizer, full: Mapping[str, Any]) -> None:
        """Loads this rank's pieces of a full optimizer state dict given on every rank: keyed by parameter name
        (hai_fsdp's) or by position (``optimizer.state_dict()`` of ddp or one device). No collectives."""
        load_full_optim_state(self.layout, self._pieces(), optimizer, full)

    def load_sharded_optim_state_dict(
        self, optimizer: torch.optim.Optimizer, shards: Iterable[Mapping[str, Any]]
    ) -> None:
        """Loads this rank's pieces from sharded optimizer states saved at any world size. No collectives."""
        load_local_optim_states(self.layout, self._pieces(), optimizer, shards)

    def _gather_full_state(self, rank0_only: bool) -> dict[str, torch.Tensor]:
        self._open()
        keep = not rank0_only or self._first_rank
        return gather_full_state(self.layout, self._flat_shards(), self._buffers_by_name(), self.comm, keep)

    def _flat_shards(self) -> list[torch.Tensor]:
        return [group.flat_shard for group in self._groups.values()]

    def _pieces(self) -> list[list[nn.Parameter]]:
        return [group.pieces for group in self._groups.values()]

    @property
    def _first_rank(self) -> bool:
        """Whether this is the first rank of the model's whole group (where ``rank0_only`` results go)."""
        return dist.get_rank(self.process_group) == 0

    def _buffers_by_name(self) -> dict[str, torch.Tensor]:
        """Buffers and the parameters of ``ignored_modules``, by state-dict key: saved whole, as they are."""
        return buffers_by_key(self.module, self._ignored_params)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(super().__getattr__("module"), name)


def _check_args(module: nn.Module, prefetch: Any, mixed_precision: Any) -> None:
    if not isinstance(module, nn.Module) or isinstance(module, FullyShardedDataParallel):
        raise TypeError(f"module must be an nn.Module not already wrapped, got {type(module).__name__}")
    if prefetch is not None and not isinstance(prefetch, BackwardPrefetch):
        raise TypeError(f"backward_prefetch={prefetch!r} must be a BackwardPrefetch member or None")
    if mixed_precision is not None and not isinstance(mixed_precision, MixedPrecision):
        raise TypeError(f"mixed_precision={mixed_precision!r} must be a lightning_haiscale.fsdp.MixedPrecision")


def _resolve_device(device_id: int | torch.device | None, module: nn.Module) -> torch.device:
    if isinstance(device_id, int):
        return torch.device("cuda", device_id)
    if device_id is not None:
        return torch.device(device_id)
    devices = {p.device for p in module.parameters() if not p.is_meta}
    return next(iter(devices)) if len(devices) == 1 else torch.device("cpu")


def _move_buffers(module: nn.Module, device: torch.device) -> None:
    for sub in module.modules():
        for name, buffer in sub._buffers.items():
            if buffer is not None and buffer.device != device:
                sub._buffers[name] = buffer.to(device)


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


def _cast_floats(value: Any, dtype: torch.dtype | None) -> Any:
    if dtype is None:
        return value
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, dict):
        return {k: _cast_floats(v, dtype) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_cast_floats(v, dtype) for v in value)
    return value
