"""One sharded unit: a flat, padded 1/world shard of its parameters and the transitions around it.

[Note: flat layout]
A unit's parameters, flattened and concatenated in module order, form ``N`` elements, padded to
``S * world`` with ``S = ceil(N / world)``. Rank ``r`` keeps elements ``[r*S, (r+1)*S)`` in
``flat_shard``. Each original parameter's intersection with that range is a *piece* (possibly empty):
an ``nn.Parameter`` viewing ``flat_shard``; the optimizer sees only pieces, so its state is sharded too.

[Note: unsharded views and storage]
``full`` is one persistent tensor of ``S * world`` elements. Unsharding fills its storage by an all-gather;
resharding resizes the storage to zero bytes. Each parameter is a persistent autograd leaf of its own
(``leaves``) viewing ``full``'s storage in its original shape, with its own version counter, so refilling
the storage never looks like an in-place change to autograd. Forward gives the modules the leaves, so
autograd accumulates each parameter's gradient into that leaf's ``.grad`` as soon as its last use is
done; nothing concatenates a unit's gradients before the unit decides how to reduce them (see
[Note: reducing a unit's gradients]). Tensors saved for backward are views of ``full``'s storage; the
pre-backward unshard refills the same storage before they are read.

[Note: reducing a unit's gradients]
When every parameter of the unit that needs a gradient has one (the unit's backward is done), the
gradients are copied into one flat buffer in the reduce dtype (zeros for parameters that got none) and
reduce-scattered into this rank's shard: one collective per unit. A unit whose backward is interrupted
by another unit's (the root: its head's gradient is complete at the first backward op, its embedding's
at the last) would keep the gradients it has across the other units' backward and then need a second,
flat copy of all of them: 1.2 GiB at GPT-2 Medium's end of backward. So when backward enters another
unit, the gradients this unit already has are reduced at once, each all-reduced on its own in place, and
only this rank's piece of each is kept, in the unit's reduced shard (zeros until then); the rest of that
unit's gradients follow the same way. An all-reduce moves twice the bytes of a reduce-scatter, on these
parameters only; in exchange no unsharded gradient outlives its reduction, and there is no flat copy.

[Note: replicated shards]
Under hybrid sharding and NO_SHARD, the ranks of ``replicate`` hold the same shard (see sharding [Note: one
machine for every strategy]). Once a unit's gradients are all reduced within the shard group (its backward is
done and its reductions waited for, which the next unit's reduction does, see scheduler [Note: one
reduce-scatter in flight]), the reduced shard is averaged over ``replicate`` asynchronously, so that all-reduce
(the only traffic that crosses hosts under HYBRID_SHARD) runs while backward goes on; the end of backward
waits for it before the shard becomes the pieces' ``.grad``. Every rank starts it at the same point of the
same backward, so the replicas issue their all-reduces in one order.

[Note: one buffer for the reduced gradients]
Each unit's reduced shard becomes its pieces' ``.grad`` and lives until the optimizer's ``zero_grad``:
24 shards of 25 MiB per GPT-2 Medium step, allocated among the backward's short-lived tensors. On the
CPU, glibc serves such sizes from its heap, so the shards freed by ``zero_grad`` left holes that the heap
kept (136-583 MiB of free heap at GPT-2 Medium's peak, measured with ``mallinfo2``). So the wrapper's
:class:`GradShards` carves every unit's shard out of one buffer per backward: one allocation, mapped on
its own and returned whole when the last piece's ``.grad`` is dropped; its pages are touched only as the
reductions write them, so it costs no more memory than the separate shards.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from lightning_haiscale.fsdp.api import MixedPrecision
from lightning_haiscale.fsdp.collectives import all_gather_shards, all_reduce_grad, gather_unit, reduce_scatter_grads
from lightning_haiscale.fsdp.layout import ParamSlice, UnitLayout
from lightning_haiscale.fsdp.release import Released, give_back, unread
from lightning_haiscale.fsdp.wrap import ParamRef
from lightning_haiscale.hfreduce import Communicator, Work
from lightning_haiscale.use_counts import storage_use_count

__all__ = ["FSDPParamGroup", "GradShards", "PendingReduce", "ShardState", "TrainingState"]


class ShardState(enum.Enum):
    """Where a unit's parameters live."""

    SHARDED = enum.auto()
    """Only the local flat shard exists; the modules hold the piece parameters."""
    UNSHARDING = enum.auto()
    """An all-gather into ``full`` is in flight (a prefetch); wait before computing."""
    UNSHARDED = enum.auto()
    """``full`` holds every rank's shard; forward set the modules' attributes to views of it."""
    PARTLY_RELEASED = enum.auto()
    """Gathered, but backward moved on to another unit and may have given back the pages nothing reads any more
    (release [Note: releasing gathered parameters early]): a forward of a module holding them gathers again.
    Every rank enters it at the same point, whatever each released."""


class TrainingState(enum.Enum):
    """Where a unit is in the step's backward (FSDP2's ``TrainingState``): the one state of a unit's backward,
    changed only by :meth:`FSDPParamGroup._enter`, which checks each change against ``_TRANSITIONS``.

    | from                      | event                                           | to           | method          |
    |---------------------------|-------------------------------------------------|--------------|-----------------|
    | IDLE                      | its pre-backward hook (gathers it)              | PRE_BACKWARD | begin_backward  |
    | IDLE, PRE_. or ACCUMULATED | every gradient arrived, not synchronizing       | ACCUMULATED  | reduce_grad     |
    | IDLE, PRE_. or REDUCED    | every gradient arrived, synchronizing           | REDUCED      | reduce_grad     |
    | any                       | the end of the whole backward                   | IDLE         | finalize_grads  |
    | any                       | a forward after a backward that never ended     | IDLE         | forget_backward |

    A unit reduced twice in one backward (its parameters' hooks fired again, as under reentrant checkpointing)
    stays where it is; a unit whose pre-backward hook did not fire (its outputs were not used) goes from IDLE.
    """

    IDLE = enum.auto()
    """Forward, or between steps: no backward of the unit has begun."""
    PRE_BACKWARD = enum.auto()
    """Its backward has begun and its gradients are arriving: a forward of it now is a recomputation."""
    ACCUMULATED = enum.auto()
    """Its backward is done; the gradients stay unreduced on the leaves for a later backward (``no_sync()``)."""
    REDUCED = enum.auto()
    """Its backward is done and every gradient's reduction has started: the shard may be replicated."""


_TRANSITIONS: dict[TrainingState, frozenset[TrainingState]] = {
    TrainingState.IDLE: frozenset(TrainingState),
    TrainingState.PRE_BACKWARD: frozenset({TrainingState.ACCUMULATED, TrainingState.REDUCED, TrainingState.IDLE}),
    TrainingState.ACCUMULATED: frozenset({TrainingState.ACCUMULATED, TrainingState.IDLE}),
    TrainingState.REDUCED: frozenset({TrainingState.REDUCED, TrainingState.IDLE}),
}
"""Every change of a unit's :class:`TrainingState` allowed (the table above)."""


@dataclass
class PendingReduce:
    """A unit's gradient reduction in one backward, from its first collective until the result is handed to the
    pieces' ``.grad`` (see [Note: reducing a unit's gradients] and [Note: replicated shards]).

    Attributes:
        shard: this rank's reduced gradient shard, in the reduce dtype, which the collectives write.
        in_parts: the unit's backward was interrupted, so its gradients are all-reduced parameter by parameter.
        works: the collectives in flight, each with what ends it (keeps this rank's part of its result).
        replication: the all-reduce of ``shard`` over the replicas, once started.
    """

    shard: torch.Tensor
    in_parts: bool
    works: list[tuple[Work, Callable[[], None]]] = field(default_factory=list)
    replication: Work | None = None

    def wait(self) -> None:
        """Waits for the collectives in flight and keeps this rank's part of each; the engine then lets go of
        the unsharded gradients it read."""
        for work, done in self.works:
            work.wait()
            done()
        self.works.clear()

    def replicate(self, replicas: Communicator | None) -> None:
        """Starts averaging ``shard`` over ``replicas`` (hybrid sharding, NO_SHARD), once; after :meth:`wait`."""
        if replicas is not None and self.replication is None:
            self.replication = all_reduce_grad(replicas, self.shard)

    def result(self, replicas: Communicator | None) -> torch.Tensor:
        """The reduced shard, averaged over ``replicas`` too: waits for everything still in flight."""
        self.wait()
        self.replicate(replicas)
        if self.replication is not None:
            self.replication.wait()
            self.replication = None
        return self.shard


def _free(tensor: torch.Tensor) -> None:
    tensor.untyped_storage().resize_(0)


def _alloc(tensor: torch.Tensor) -> None:
    nbytes = tensor.numel() * tensor.element_size()
    if tensor.untyped_storage().nbytes() != nbytes:
        tensor.untyped_storage().resize_(nbytes)


class FSDPParamGroup:
    """The parameters one unit owns, sharded over ``comm`` and, with ``replicate``, replicated over its ranks
    (see [Note: flat layout] and [Note: replicated shards])."""

    def __init__(
        self,
        refs: list[ParamRef],
        comm: Communicator,
        device: torch.device,
        mixed_precision: MixedPrecision | None,
        replicate: Communicator | None = None,
    ) -> None:
        dtypes = {ref.param.dtype for ref in refs}
        if len(dtypes) != 1:
            names = [ref.fqns[0] for ref in refs]
            raise ValueError(
                f"a sharded unit needs one parameter dtype, got {sorted(map(str, dtypes))} for {names}; wrap "
                "parameters of different dtypes in separate units (auto_wrap_policy) or cast the module"
            )
        self.comm = comm
        self.replicate = replicate
        """The engine over the ranks holding the same shard (hybrid sharding, NO_SHARD), or None."""
        self.dtype = next(iter(dtypes))
        self.device = device
        shard_numel = max(1, math.ceil(sum(ref.param.numel() for ref in refs) / comm.world_size))
        self.flat_shard = torch.zeros(shard_numel, dtype=self.dtype, device=device)
        self.layout = UnitLayout(params=self._shard(refs), shard_numel=shard_numel, world_size=comm.world_size)
        """The public face of this unit's sharding (names, shapes, this rank's slices): the one place its sizes
        and each piece's place in a flat shard are computed."""
        self._holders = [tuple(ref.holders) for ref in refs]  # (module, attribute) pairs holding each parameter
        self.pieces = [
            nn.Parameter(self.layout.piece(info, self.flat_shard), requires_grad=ref.param.requires_grad)
            for info, ref in zip(self.infos, refs, strict=True)
        ]
        mp = mixed_precision or MixedPrecision()
        self.param_dtype = mp.param_dtype or self.dtype
        self.reduce_dtype = mp.reduce_dtype or self.param_dtype
        self.full = torch.empty(self.layout.padded_numel, dtype=self.param_dtype, device=device)
        self.leaves = self._make_leaves()
        """Each parameter as an autograd leaf viewing ``full``'s storage (see [Note: unsharded views and storage])."""
        self._own_views = storage_use_count(self.full)  # ``full`` and the leaves: see release [Note: ...]
        _free(self.full)
        self._needs_grad = sum(p.requires_grad for p in self.pieces)
        self.state = ShardState.SHARDED
        self._unshard_work: Work | None = None
        self._arrived: set[int] = set()  # parameters whose gradient of this backward is complete
        self._waiting: list[int] = []  # ... of those, the ones not yet reduced
        self._pending: PendingReduce | None = None  # this backward's reduction, until finalize_grads
        self.training_state = TrainingState.IDLE
        """Where the unit is in the step's backward; changed only by :meth:`_enter`."""
        self._released: set[int] = set()  # leaves whose pages went back to the OS while unsharded
        self.grad_space: Callable[[], torch.Tensor] = self.fresh_shard
        """Where a reduced shard goes (see [Note: one buffer for the reduced gradients])."""
        self.use_pieces()

    def _make_leaves(self) -> list[torch.Tensor]:
        """One leaf per parameter over ``full``'s storage (allocated: ``set_`` checks the bounds)."""
        leaves, offset = [], 0
        storage = self.full.untyped_storage()
        for info, piece in zip(self.infos, self.pieces, strict=True):
            leaf = torch.empty(0, dtype=self.param_dtype, device=self.device).set_(storage, offset, info.shape)
            leaves.append(leaf.requires_grad_(piece.requires_grad))
            offset += info.numel
        return leaves

    @property
    def infos(self) -> tuple[ParamSlice, ...]:
        """Each parameter's names, shape and piece, in flat order (``layout.params``)."""
        return self.layout.params

    @property
    def shard_numel(self) -> int:
        """Elements of this rank's flat shard (``layout.shard_numel``)."""
        return self.layout.shard_numel

    def fresh_shard(self) -> torch.Tensor:
        """An uninitialized tensor the size of this rank's shard, in the reduce dtype."""
        return torch.empty(self.shard_numel, dtype=self.reduce_dtype, device=self.device)

    def _shard(self, refs: list[ParamRef]) -> tuple[ParamSlice, ...]:
        """Copies this rank's slice of every parameter into ``flat_shard``."""
        lo = self.comm.rank * self.flat_shard.numel()
        hi = lo + self.flat_shard.numel()
        infos, offset = [], 0
        for ref in refs:
            n = ref.param.numel()
            start, end = min(max(offset, lo), hi), min(max(offset + n, lo), hi)
            if end > start:
                flat = ref.param.detach().reshape(-1)[start - offset : end - offset]
                self.flat_shard[start - lo : end - lo].copy_(flat)
            infos.append(
                ParamSlice(
                    names=tuple(ref.fqns),
                    shape=ref.param.shape,
                    start=start - offset,
                    end=end - offset,
                    shard_offset=start - lo,
                )
            )
            offset += n
        return tuple(infos)

    # ----------------------------------------------------------------------------- views

    def holder_modules(self) -> list[nn.Module]:
        """Every module that holds one of this unit's parameters, once each."""
        return list({id(m): m for holders in self._holders for m, _ in holders}.values())

    def set_params(self, tensors: list[torch.Tensor]) -> None:
        """The modules hold ``tensors`` (one per parameter, in ``infos`` order) in the parameters' places."""
        for holders, tensor in zip(self._holders, tensors, strict=True):
            for module, attr in holders:
                module._parameters[attr] = tensor

    def use_pieces(self) -> None:
        """The modules hold the piece parameters (what ``parameters()`` and the optimizer see)."""
        self.set_params(self.pieces)

    def use_unsharded_views(self) -> None:
        """The modules hold the leaves viewing ``full`` (autograd fills each one's ``.grad``), but for those
        released (:meth:`release_unread`), which a forward of their module gathers again first."""
        self.set_params([Released(leaf) if i in self._released else leaf for i, leaf in enumerate(self.leaves)])

    # ----------------------------------------------------------------------- transitions

    def unshard(self, async_op: bool = False) -> None:
        """SHARDED -> UNSHARDING (-> UNSHARDED unless ``async_op``): all-gather into ``full``."""
        if self.state is not ShardState.SHARDED:
            return
        _alloc(self.full)
        self._unshard_work = all_gather_shards(self.comm, self.full, self._gather_input(), async_op=True)
        self.state = ShardState.UNSHARDING
        if not async_op:
            self.wait_unshard()

    def _gather_input(self) -> torch.Tensor:
        return self.flat_shard if self.param_dtype == self.dtype else self.flat_shard.to(self.param_dtype)

    def release_unread(self) -> int:
        """Backward entered another unit while this one stays unsharded: gives the OS back the pages of the
        gathered parameters that nothing reads any more (see release [Note: releasing gathered parameters
        early]). Returns the bytes released."""
        if self.state not in (ShardState.UNSHARDED, ShardState.PARTLY_RELEASED):
            return 0
        self.state = ShardState.PARTLY_RELEASED  # on every rank alike, whatever each releases
        if self._own_views is None or storage_use_count(self.full) != self._own_views:
            return 0  # another tensor views the storage: a saved view or an alias may read any leaf
        released = 0
        for index, leaf in enumerate(self.leaves):
            if index in self._released:
                continue
            given = give_back(leaf) if unread(leaf) else 0
            if given:
                released += given
                self._released.add(index)
                for module, attr in self._holders[index]:
                    module._parameters[attr] = Released(leaf)
        return released

    def holder_pre_forward(self) -> None:
        """Before a forward of a module holding some of this unit's parameters (activation recomputation):
        PARTLY_RELEASED -> UNSHARDED: gathers the unit again (on every rank alike)."""
        if self.state is ShardState.PARTLY_RELEASED:
            self.state = ShardState.UNSHARDED
            self._released.clear()
            self.set_params(self.leaves)
            all_gather_shards(self.comm, self.full, self._gather_input(), async_op=False)

    def wait_unshard(self) -> None:
        """UNSHARDING -> UNSHARDED."""
        if self.state is ShardState.UNSHARDING and self._unshard_work is not None:
            self._unshard_work.wait()
            self._unshard_work = None
        if self.state is ShardState.UNSHARDING:
            self.state = ShardState.UNSHARDED

    def reshard(self) -> None:
        """-> SHARDED: frees ``full``'s storage and gives the modules their pieces back."""
        if self.state is ShardState.SHARDED:
            return
        self.wait_unshard()
        _free(self.full)
        self._released.clear()
        self.state = ShardState.SHARDED
        self.use_pieces()

    # ------------------------------------------------------------------------- gradients

    def _enter(self, state: TrainingState) -> None:
        """The one place the unit's :class:`TrainingState` changes; ``RuntimeError`` for a change the table of
        :class:`TrainingState` does not allow (the hooks ran in an order the schedule cannot follow)."""
        if state not in _TRANSITIONS[self.training_state]:
            names = [info.name for info in self.infos[:3]]
            raise RuntimeError(
                f"sharded unit holding {names}: its backward went from {self.training_state.name} to {state.name}; "
                "every rank must run the same units' forward and backward in the same order"
            )
        self.training_state = state

    def begin_backward(self) -> bool:
        """IDLE -> PRE_BACKWARD, from the unit's pre-backward hook; False if its backward had begun already."""
        if self.training_state is not TrainingState.IDLE:
            return False
        self._enter(TrainingState.PRE_BACKWARD)
        return True

    def forget_backward(self) -> None:
        """-> IDLE without finishing: a forward after a backward that never ended (an exception inside it)."""
        self._enter(TrainingState.IDLE)

    def grad_arrived(self, index: int, sync: bool) -> bool:
        """Parameter ``index``'s gradient of this backward is complete on its leaf; True once every parameter
        of the unit that needs one has it (the unit's backward is done)."""
        self._arrived.add(index)
        if sync:
            self._waiting.append(index)
        return len(self._arrived) == self._needs_grad

    def reduce_arrived(self) -> bool:
        """Backward moved on to another unit: starts all-reducing the gradients that arrived and are not
        reduced yet (see [Note: reducing a unit's gradients]); True if there were any."""
        waiting = [i for i in self._waiting if self.leaves[i].grad is not None]
        self._waiting.clear()
        for index in waiting:
            self._all_reduce(index)
        return bool(waiting)

    def reduce_grad(self, sync: bool) -> None:
        """After the unit's backward: starts reducing its gradients (unless ``sync`` is False, when they keep
        accumulating on the leaves for a later backward, as under ``no_sync()``): -> REDUCED or ACCUMULATED.
        Whether the unit reshards now is the scheduler's choice."""
        self._waiting.clear()
        grads = [i for i, leaf in enumerate(self.leaves) if leaf.grad is not None]
        self._enter(TrainingState.REDUCED if sync else TrainingState.ACCUMULATED)
        if not (sync and grads):
            return
        if self._pending is not None and self._pending.in_parts:
            for index in grads:
                self._all_reduce(index)
        else:
            self._reduce_scatter()

    def _reduce_scatter(self) -> None:
        if self._pending is not None:  # a second reduction in one backward: keep the first result
            self._hand_over()
        flat = torch.empty(self.layout.padded_numel, dtype=self.reduce_dtype, device=self.device)
        flat[sum(info.numel for info in self.infos) :].zero_()  # the padding
        for view, leaf in zip(self.layout.full_views(flat), self.leaves, strict=True):
            if leaf.grad is None:
                view.zero_()
            else:
                view.copy_(leaf.grad)
                leaf.grad = None
        self._pending = PendingReduce(self.grad_space(), in_parts=False)
        self._pending.works.append((reduce_scatter_grads(self.comm, self._pending.shard, flat), lambda: None))

    def _all_reduce(self, index: int) -> None:
        leaf, info = self.leaves[index], self.infos[index]
        grad = leaf.grad.reshape(-1).to(self.reduce_dtype)
        leaf.grad = None
        if self._pending is None:
            self._pending = PendingReduce(self.grad_space().zero_(), in_parts=True)
        self._pending.in_parts = True
        piece = self.layout.piece(info, self._pending.shard)
        self._pending.works.append((all_reduce_grad(self.comm, grad), lambda: piece.add_(grad[info.start : info.end])))

    def finish_reduce(self) -> None:
        """Waits for this unit's reductions in flight (if any) and keeps this rank's part of each; the engine
        then lets go of the unsharded gradients it read, which are freed. A REDUCED unit then starts averaging
        its shard over the replicas (see [Note: replicated shards])."""
        if self._pending is None:
            return
        self._pending.wait()
        if self.training_state is TrainingState.REDUCED:
            self._pending.replicate(self.replicate)

    def _hand_over(self) -> None:
        """Adds the reduced shard to the pieces' ``.grad``."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        reduced = pending.result(self.replicate)
        reduced = reduced if reduced.dtype == self.dtype else reduced.to(self.dtype)
        for info, piece in zip(self.infos, self.pieces, strict=True):
            if piece.requires_grad:
                grad = self.layout.piece(info, reduced)
                piece.grad = grad if piece.grad is None else piece.grad.add_(grad)

    def finalize_grads(self, sync: bool) -> None:
        """End of backward: reduces the gradients of a unit whose backward never completed (some parameters
        got none), waits for the reductions and adds the result to the pieces' ``.grad``: -> IDLE."""
        if self._waiting:
            self.reduce_grad(sync)
        self._hand_over()
        self._arrived.clear()
        self._enter(TrainingState.IDLE)

    # --------------------------------------------------------------------- whole copies

    def gather_full(self, flat_shard: torch.Tensor | None = None) -> torch.Tensor:
        """A fresh unsharded flat buffer of ``flat_shard`` (default: the parameters) in the shard's dtype."""
        return gather_unit(self.comm, self.layout, self.flat_shard if flat_shard is None else flat_shard)

    def write_back(self, full: torch.Tensor) -> None:
        """Copies this rank's range of an unsharded flat buffer into the shard."""
        lo = self.comm.rank * self.shard_numel
        with torch.no_grad():
            self.flat_shard.copy_(full[lo : lo + self.shard_numel])


class GradShards:
    """Every unit's reduced gradient shard of one backward as a slice of one buffer per (dtype, device) (see
    [Note: one buffer for the reduced gradients])."""

    def __init__(self, groups: list[FSDPParamGroup]) -> None:
        self._slots: dict[int, tuple[tuple[torch.dtype, torch.device], int]] = {}
        self._totals: dict[tuple[torch.dtype, torch.device], int] = {}
        for group in groups:
            key = (group.reduce_dtype, group.device)
            self._slots[id(group)] = (key, self._totals.get(key, 0))
            self._totals[key] = self._totals.get(key, 0) + group.shard_numel
        self._buffers: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}
        self._taken: set[int] = set()

    def take(self, group: FSDPParamGroup) -> torch.Tensor:
        """``group``'s slice of this backward's buffer (a fresh tensor if it took its slice already)."""
        if id(group) in self._taken:
            return group.fresh_shard()
        self._taken.add(id(group))
        key, offset = self._slots[id(group)]
        if key not in self._buffers:
            self._buffers[key] = torch.empty(self._totals[key], dtype=key[0], device=key[1])
        return self._buffers[key][offset : offset + group.shard_numel]

    def release(self) -> None:
        """End of backward: the buffers live on only in the pieces' ``.grad`` that view them."""
        self._buffers.clear()
        self._taken.clear()
