"""One sharded unit: a flat, padded 1/world shard of its parameters and the transitions around it.

[Note: flat layout]
A unit's parameters, flattened and concatenated in module order, form ``N`` elements, padded to
``S * world`` with ``S = ceil(N / world)``. Rank ``r`` keeps elements ``[r*S, (r+1)*S)`` in
``flat_shard``. Each original parameter's intersection with that range is a *piece* (possibly empty):
an ``nn.Parameter`` viewing ``flat_shard``; the optimizer sees only pieces, so its state is sharded too.

[Note: unsharded views and storage]
``full`` is one persistent leaf tensor (``requires_grad``) of ``S * world`` elements. Unsharding fills its
storage by an all-gather; resharding resizes the storage to zero bytes. Forward sets the module
attributes to views from one ``torch.split(full)``, so autograd has one ``SplitBackward`` node per
unit and accumulates the unit's whole gradient into ``full.grad`` at once: its post-accumulate-grad
hook is the unit's "backward done" signal. Tensors saved for backward are views of ``full``'s storage;
the pre-backward unshard refills the same storage before they are read. The engine writes through
``_comm_full``, an alias of the storage with its own version counter, so refilling never looks like an
in-place change to autograd.
"""

from __future__ import annotations

import enum
import math

import torch
from torch import nn

from lightning_haiscale.fsdp.api import MixedPrecision
from lightning_haiscale.fsdp.collectives import all_gather_shards, gather_unit, reduce_scatter_grads
from lightning_haiscale.fsdp.layout import ParamSlice, UnitLayout
from lightning_haiscale.fsdp.wrap import ParamRef
from lightning_haiscale.hfreduce import Communicator, Work

__all__ = ["FSDPParamGroup", "ShardState"]


class ShardState(enum.Enum):
    """Where a unit's parameters live."""

    SHARDED = enum.auto()
    """Only the local flat shard exists; the modules hold the piece parameters."""
    UNSHARDING = enum.auto()
    """An all-gather into ``full`` is in flight (a prefetch); wait before computing."""
    UNSHARDED = enum.auto()
    """``full`` holds every rank's shard; forward set the modules' attributes to views of it."""


def _free(tensor: torch.Tensor) -> None:
    tensor.untyped_storage().resize_(0)


def _alloc(tensor: torch.Tensor) -> None:
    nbytes = tensor.numel() * tensor.element_size()
    if tensor.untyped_storage().nbytes() != nbytes:
        tensor.untyped_storage().resize_(nbytes)


class FSDPParamGroup:
    """The parameters one unit owns, sharded over ``comm`` (see [Note: flat layout])."""

    def __init__(
        self, refs: list[ParamRef], comm: Communicator, device: torch.device, mixed_precision: MixedPrecision | None
    ) -> None:
        dtypes = {ref.param.dtype for ref in refs}
        if len(dtypes) != 1:
            names = [ref.fqns[0] for ref in refs]
            raise ValueError(
                f"a sharded unit needs one parameter dtype, got {sorted(map(str, dtypes))} for {names}; wrap "
                "parameters of different dtypes in separate units (auto_wrap_policy) or cast the module"
            )
        self.comm = comm
        self.dtype = next(iter(dtypes))
        self.device = device
        total = sum(ref.param.numel() for ref in refs)
        self.shard_numel = max(1, math.ceil(total / comm.world_size))
        self.padded_numel = self.shard_numel * comm.world_size
        self.flat_shard = torch.zeros(self.shard_numel, dtype=self.dtype, device=device)
        self.infos = self._shard(refs)
        self._holders = [tuple(ref.holders) for ref in refs]  # (module, attribute) pairs holding each parameter
        self.layout = UnitLayout(params=self.infos, shard_numel=self.shard_numel, world_size=comm.world_size)
        """The public face of this unit's sharding (names, shapes, this rank's slices)."""
        self.pieces = [
            nn.Parameter(self.piece(info), requires_grad=ref.param.requires_grad)
            for info, ref in zip(self.infos, refs, strict=True)
        ]
        mp = mixed_precision or MixedPrecision()
        self.param_dtype = mp.param_dtype or self.dtype
        self.reduce_dtype = mp.reduce_dtype or self.param_dtype
        self.full = torch.empty(self.padded_numel, dtype=self.param_dtype, device=device)
        self._comm_full = torch.empty(0, dtype=self.param_dtype, device=device).set_(
            self.full.untyped_storage(), 0, (self.padded_numel,)
        )
        _free(self.full)
        self.requires_grad = any(p.requires_grad for p in self.pieces)
        self.full.requires_grad_(self.requires_grad)
        pad = self.padded_numel - total
        self._split_sizes = [info.numel for info in self.infos] + ([pad] if pad else [])
        self.state = ShardState.SHARDED
        self._unshard_work: Work | None = None
        self._reduce_work: Work | None = None
        self._reduced: torch.Tensor | None = None
        self.use_pieces()

    def _shard(self, refs: list[ParamRef]) -> tuple[ParamSlice, ...]:
        """Copies this rank's slice of every parameter into ``flat_shard``."""
        lo = self.comm.rank * self.shard_numel
        hi = lo + self.shard_numel
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

    def piece(self, info: ParamSlice, flat: torch.Tensor | None = None) -> torch.Tensor:
        """This rank's piece of ``info``'s parameter as a view of ``flat`` (default: ``flat_shard``)."""
        flat = self.flat_shard if flat is None else flat
        return flat[info.shard_offset : info.shard_offset + info.end - info.start]

    def full_views(self, full: torch.Tensor) -> list[torch.Tensor]:
        """Every parameter as a view of an unsharded flat buffer ``full``, in original shapes."""
        views = torch.split(full, self._split_sizes)
        return [view.view(info.shape) for view, info in zip(views, self.infos, strict=False)]

    def set_params(self, tensors: list[torch.Tensor]) -> None:
        """The modules hold ``tensors`` (one per parameter, in ``infos`` order) in the parameters' places."""
        for holders, tensor in zip(self._holders, tensors, strict=True):
            for module, attr in holders:
                module._parameters[attr] = tensor

    def use_pieces(self) -> None:
        """The modules hold the piece parameters (what ``parameters()`` and the optimizer see)."""
        self.set_params(self.pieces)

    def use_unsharded_views(self) -> None:
        """The modules hold views of ``full`` that autograd routes to ``full.grad``."""
        self.set_params(self.full_views(self.full))

    # ----------------------------------------------------------------------- transitions

    def unshard(self, async_op: bool = False) -> None:
        """SHARDED -> UNSHARDING (-> UNSHARDED unless ``async_op``): all-gather into ``full``."""
        if self.state is not ShardState.SHARDED:
            return
        _alloc(self.full)
        shard = self.flat_shard if self.param_dtype == self.dtype else self.flat_shard.to(self.param_dtype)
        self._unshard_work = all_gather_shards(self.comm, self._comm_full, shard, async_op=True)
        self.state = ShardState.UNSHARDING
        if not async_op:
            self.wait_unshard()

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
        self.state = ShardState.SHARDED
        self.use_pieces()

    # ------------------------------------------------------------------------- gradients

    def reduce_grad(self, sync: bool) -> None:
        """After the unit's backward: start reduce-scattering ``full.grad`` (unless ``sync`` is False, when
        it keeps accumulating for a later backward, as under ``no_sync()``), then reshard."""
        grad = self.full.grad
        if grad is not None and sync:
            grad = grad if grad.dtype == self.reduce_dtype else grad.to(self.reduce_dtype)
            reduced = torch.empty(self.shard_numel, dtype=self.reduce_dtype, device=self.device)
            if self._reduce_work is not None:  # a second backward before finalize: keep the first result
                self.finish_reduce()
            self._reduce_work = reduce_scatter_grads(self.comm, reduced, grad)
            self._reduced = reduced
            self.full.grad = None
        self.reshard()

    def finish_reduce(self) -> None:
        """Waits for the reduce-scatter in flight (if any) and adds its result to the pieces' ``.grad``; the
        engine then lets go of the unsharded gradient it read, which is freed."""
        if self._reduce_work is None or self._reduced is None:
            return
        self._reduce_work.wait()
        reduced = self._reduced if self._reduced.dtype == self.dtype else self._reduced.to(self.dtype)
        for info, piece in zip(self.infos, self.pieces, strict=True):
            if piece.requires_grad:
                grad = self.piece(info, reduced)
                piece.grad = grad if piece.grad is None else piece.grad.add_(grad)
        self._reduce_work = None
        self._reduced = None

    def finalize_grads(self) -> None:
        """End of backward: wait for the reduce-scatter and add the result to the pieces' ``.grad``."""
        self.reshard()
        self.finish_reduce()

    # --------------------------------------------------------------------- whole copies

    def gather_full(self, flat_shard: torch.Tensor | None = None) -> torch.Tensor:
        """A fresh unsharded flat buffer of ``flat_shard`` (default: the parameters) in the shard's dtype."""
        return gather_unit(self.comm, self.layout, self.flat_shard if flat_shard is None else flat_shard)

    def write_back(self, full: torch.Tensor) -> None:
        """Copies this rank's range of an unsharded flat buffer into the shard."""
        lo = self.comm.rank * self.shard_numel
        with torch.no_grad():
            self.flat_shard.copy_(full[lo : lo + self.shard_numel])
