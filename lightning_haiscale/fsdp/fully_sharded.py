"""``FullyShardedDataParallel``: ZeRO-3 sharding of a module over the hfreduce engine (ZeRO-2, replicated and
hybrid sharding are the same machine with other groups, see sharding [Note: one machine for every strategy]).

The wrapper builds the units (``param_group``) and their engines, and holds the public methods; its
:class:`~lightning_haiscale.fsdp.scheduler.StepScheduler` runs each step's gathers, reshards and reductions
from the hooks (scheduler [Note: schedule]); the checkpoint methods hand the work to ``state_dict`` and
``optim_state`` with the public :class:`~lightning_haiscale.fsdp.layout.ShardLayout`.
"""

from __future__ import annotations

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
from lightning_haiscale.fsdp.param_group import FSDPParamGroup, ShardState
from lightning_haiscale.fsdp.scheduler import StepScheduler
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
            replicate_group)`` pair for hybrid sharding.
        auto_wrap_policy: which submodules become units of their own (see ``wrap.AutoWrapPolicy``);
            ``None``: one unit for the whole model.
        backward_prefetch: when backward prefetches the next unit (``None``: no backward prefetch).
        reshard_after_forward: ``False`` keeps each unit's gathered parameters from its forward to its backward:
            the same setting as ``sharding_strategy="SHARD_GRAD_OP"`` (``HYBRID_SHARD`` becomes
            ``_HYBRID_SHARD_ZERO2``; see sharding [Note: one machine for every strategy]). ``None`` (the
            default) frees them after each forward (FULL_SHARD, HYBRID_SHARD) but inside a
            :meth:`microbatch_step`, which keeps them until the step ends; ``True`` frees them there too.
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
        timeout: the deadline of every wait on a peer in the engines it builds, one per group its
            ``sharding_strategy`` uses (default 5 minutes).
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
        reshard_after_forward: bool | None = None,
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
        self.sharding_strategy = resolve_strategy(
            sharding_strategy, True if reshard_after_forward is None else reshard_after_forward
        )
        """The strategy in effect (``reshard_after_forward=False`` made FULL_SHARD into SHARD_GRAD_OP)."""
        self.reshard_after_forward = self.sharding_strategy.reshard_after_forward
        self._microbatch_reshard = reshard_after_forward is True  # see microbatch_step
        self.device = _resolve_device(device_id, module)
        check_cpu_offload(cpu_offload, self.device)
        self._ignored_modules, self._ignored_params = ignored(module, ignored_modules)
        self.module = module
        self.backward_prefetch = backward_prefetch
        self.mixed_precision = mixed_precision
        self.comm, self.replicate_comm, self.process_group = self._communicators(process_group, device_mesh, timeout)
        self._closed = False
        units = [u for u in unit_modules(module, auto_wrap_policy) if id(u) not in self._ignored_modules]
        self._groups = self._build_groups(units, param_init_fn, sync_module_states)
        self._root_group = self._groups.get(module)
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
        self._scheduler = StepScheduler(module, self._groups, backward_prefetch, self.reshard_after_forward)
        self._state_dict_type = StateDictType.FULL
        self._holds_full: bool | None = None  # inside summon_full_params: whether this rank holds them
        self._arrival = ArrivalCheck(self.process_group, arrival_timeout)

    # ------------------------------------------------------------------------ construction

    def _communicators(
        self, process_group: Any, device_mesh: Any, timeout: timedelta | None
    ) -> tuple[Communicator, Communicator | None, dist.ProcessGroup]:
        """The engines over the shard and replicate groups (only those the strategy uses), and the group of
        every rank of the model."""
        timeout = timeout if timeout is not None else timedelta(minutes=5)
        shard, replicate, whole = strategy_groups(self.sharding_strategy, process_group, device_mesh)
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

    # ----------------------------------------------------------------------------- forward

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self._open()
        if self.mixed_precision is not None and self.mixed_precision.cast_forward_inputs:
            args, kwargs = _cast_floats((args, kwargs), self.mixed_precision.param_dtype)
        return self._scheduler.forward(lambda: self.module(*args, **kwargs))

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

    def microbatch_step(
        self, count: int, *, reshard_after_forward: bool | None = None
    ) -> AbstractContextManager[None]:
        """Runs the forwards and backwards inside as one step of ``count`` microbatches: each unit is gathered
        once, at its first use, and stays gathered until the block ends; the gradients accumulate unsharded
        over the microbatches, and the ``count``-th backward reduce-scatters each unit once (see scheduler
        [Note: microbatch steps]). The pipelines enter it around every step of a stage that has it; around a
        microbatch loop of your own::

            with model.microbatch_step(len(microbatches)):
                for x, y in microbatches:
                    (loss_fn(model(x), y) / len(microbatches)).backward()
            optimizer.step()

        Call it on every rank of the model, around the same forwards and backwards; ``no_sync()`` around it (or
        around its last backward) keeps the gradients unreduced as usual.

        Args:
            count: the microbatches of the step: one forward each, and one backward each when training (a
                step with some backwards but not ``count`` raises at its end: none reduced the gradients).
            reshard_after_forward: free each unit after every forward and gather it again for its backward
                (less memory, one more all-gather per microbatch); default: the wrapper's
                ``reshard_after_forward=True`` when given so, else keep them.
        """
        reshard = self._microbatch_reshard if reshard_after_forward is None else reshard_after_forward
        return self._scheduler.microbatch_step(count, reshard_after_forward=reshard)

    def no_sync(self) -> AbstractContextManager[None]:
        """Backward passes inside accumulate unsharded gradients locally; the first one outside reduces them."""
        return sync_off(self._scheduler, "sync_grads")

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
                    views = group.layout.full_views(full)
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
