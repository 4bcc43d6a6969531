"""The backend of several hosts: shared memory within each host, torch's gloo between hosts."""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from lightning_haiscale.hfreduce._native import load_engine
from lightning_haiscale.hfreduce.abort import forget_other_hosts, watch_other_hosts
from lightning_haiscale.hfreduce.at_exit import wait_and_keep
from lightning_haiscale.hfreduce.backend import Backend
from lightning_haiscale.hfreduce.dtypes import engine_dtype
from lightning_haiscale.hfreduce.errors import (
    HFReduceAbortedError,
    HFReduceError,
    HFReduceMismatchError,
    HFReducePeerError,
)
from lightning_haiscale.hfreduce.shm_backend import ShmBackend
from lightning_haiscale.hfreduce.torch_backend import all_gather_tensor, global_rank, reduce_scatter_tensor

_CROSS_POLL_S = 0.0002  # how often a wait on another host checks for an abort (gloo takes >= 1 ms here)


class HierarchicalBackend(Backend):
    """Reduce-scatter within the host in shared memory, all-reduce of each local rank's slice with the ranks
    of the same local index on the other hosts (gloo), all-gather within the host. Collective to build."""

    name: ClassVar[str] = "hierarchical"

    def __init__(self, host: ShmBackend, group: dist.ProcessGroup) -> None:
        self._host = host
        self._group = group
        self.topology = host.topology
        self.rank = host.rank
        self._world_size = len(self.topology.peers)
        self._cross_group, self._cross_order = self._make_cross_groups()
        self._disagreed: str | None = None  # set when hosts called different collectives
        self._peers = [
            global_rank(group, r) for r in self.topology.cross_host_ranks(self.topology.local_rank) if r != self.rank
        ]
        watch_other_hosts(self._peers, host.timeout_s)

    def _make_cross_groups(self) -> tuple[dist.ProcessGroup | None, list[int]]:
        """The group of this rank's local index on every host, and the (local index, host) order of ranks."""
        order: list[int] = []
        mine = None
        for local in range(self.topology.local_size):
            members = sorted(self.topology.cross_host_ranks(local), key=lambda r: global_rank(self._group, r))
            order += members
            if local == self.topology.local_rank:
                # gloo: the slices crossing hosts are in host memory, whatever the tensors' device.
                ranks = [global_rank(self._group, r) for r in members]
                mine = dist.new_group(ranks, backend="gloo", use_local_synchronization=True)
        return mine, order

    # --------------------------------------------------------------------------------- collectives

    def all_reduce(self, tensor: torch.Tensor, divisor: float) -> None:
        flat = tensor.view(-1)
        self._agree_across_hosts(_fingerprint(load_engine().Collective.ALL_REDUCE, flat, flat.numel(), 0, divisor))
        if flat.numel() > 0:
            n, local = flat.numel(), self.topology.local_size
            per_rank = math.ceil(n / local)
            padded = flat if per_rank * local == n else torch.cat([flat, flat.new_zeros(per_rank * local - n)])
            piece = flat.new_empty(per_rank)
            self._host.reduce_scatter(piece, padded, 1.0)
            self._across(dist.all_reduce(piece, group=self._cross_group, async_op=True))
            self._host.all_gather(padded, piece)
            if padded is not flat:
                flat.copy_(padded[:n])
        if divisor != 1.0:
            flat.div_(divisor)

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, divisor: float) -> None:
        n = output.numel()
        self._agree_across_hosts(_fingerprint(load_engine().Collective.REDUCE_SCATTER, input, n, 0, divisor))
        if n > 0:
            order = torch.tensor(self._cross_order)
            by_local = input.view(self._world_size, n).index_select(0, order).contiguous()
            host_pieces = output.new_empty(self.topology.num_hosts * n)
            self._host.reduce_scatter(host_pieces, by_local, 1.0)
            # waited at once, not polled: gloo's asynchronous reduce_scatter_tensor never reported is_completed() here
            with self._naming_peers():
                wait_and_keep(reduce_scatter_tensor(output, host_pieces, group=self._cross_group, async_op=True))
        if divisor != 1.0:
            output.div_(divisor)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor) -> None:
        n = input.numel()
        self._agree_across_hosts(_fingerprint(load_engine().Collective.ALL_GATHER, input, n))
        if n > 0:
            across = input.new_empty(self.topology.num_hosts * n)
            self._across(all_gather_tensor(across, input.contiguous(), group=self._cross_group, async_op=True))
            by_local = input.new_empty(self._world_size * n)
            self._host.all_gather(by_local, across)
            output.view(self._world_size, n).index_copy_(0, torch.tensor(self._cross_order), by_local.view(-1, n))

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        self._agree_across_hosts(_fingerprint(load_engine().Collective.BROADCAST, tensor, tensor.numel(), src))
        src_host = next(h for h, ranks in enumerate(self.topology.hosts) if src in ranks)
        root = self.topology.hosts[src_host].index(src)
        if self.topology.local_rank == root:
            source = global_rank(self._group, src)
            self._across(dist.broadcast(tensor, src=source, group=self._cross_group, async_op=True))
        self._host.broadcast_local(tensor, root)

    def barrier(self) -> None:
        # the exchange of fingerprints is the barrier across hosts
        engine = load_engine()
        self._agree_across_hosts(engine.Fingerprint(engine.Collective.BARRIER, engine.DType.FLOAT32, 0))

    def _across(self, work: Any) -> None:
        """Waits for a cross-host transfer, ending early with :class:`HFReduceAbortedError` when this host's
        engine is aborted: the peer this rank waits for on another host may be the rank that failed (see
        [Note: aborting a job] in abort.py)."""
        while not work.is_completed():
            aborted = self._host.aborted()
            if aborted is not None:
                rank, reason = aborted
                raise HFReduceAbortedError(f"hfreduce: {reason} (this is group rank {self.rank})", [rank])
            time.sleep(_CROSS_POLL_S)
        with self._naming_peers():
            wait_and_keep(work)  # see [Note: the last reference to a gloo work] in at_exit.py

    @contextlib.contextmanager
    def _naming_peers(self) -> Iterator[None]:
        """A failed transfer across hosts (gloo's error names an address) becomes :class:`HFReducePeerError`
        naming the group ranks this rank exchanges with on the other hosts."""
        try:
            yield
        except RuntimeError as error:
            if isinstance(error, HFReduceError):
                raise
            peers = [r for r in self.topology.cross_host_ranks(self.topology.local_rank) if r != self.rank]
            message = (
                f"hfreduce: the transfer across hosts with group ranks {peers} failed (this is group rank "
                f"{self.rank}): {str(error).splitlines()[0] if str(error) else type(error).__name__}"
            )
            raise HFReducePeerError(message, peers) from error

    def alloc_buffer(self, numel: int, dtype: torch.dtype, barrier: Callable[[], None]) -> torch.Tensor:
        return self._host.alloc_buffer(numel, dtype, barrier)

    def close(self) -> None:
        if self._peers:
            forget_other_hosts(self._peers)
            self._peers = []
        self._host.close()

    # ------------------------------------------------------------------------------------ agreement

    def _agree_across_hosts(self, call: Any) -> None:
        """Raises :class:`HFReduceMismatchError` on every rank unless every rank of the group makes ``call``.

        [Note: agreement across hosts] The engine checks that the ranks of one host agree (see [Note:
        agreement check] in csrc/communicator.cpp). Across hosts, the ranks with this local index
        all-gather the call (a fixed-size message, which cannot itself mismatch); then the host's ranks
        agree on it in the engine, each announcing "disagreed elsewhere" instead if another host
        differed. A host whose ranks disagree fails there; every other host then has a local index whose
        cross-host peers differ from it, so its ranks fail too. Every rank raises; none waits on one that did.
        """
        if self._disagreed is not None:  # the engine is in step, but the program is not
            raise HFReduceError(f"hfreduce: communicator unusable after an earlier failure: {self._disagreed}")
        engine = load_engine()
        fields = (int(call.collective), int(call.dtype), call.count, call.arg, int(call.divisor))
        mine = torch.tensor(fields, dtype=torch.int64)
        every = mine.new_empty(self.topology.num_hosts * len(fields))
        self._across(all_gather_tensor(every, mine, group=self._cross_group, async_op=True))
        peers = self.topology.cross_host_ranks(self.topology.local_rank)
        rows = dict(zip(peers, (tuple(r) for r in every.view(self.topology.num_hosts, -1).tolist()), strict=True))
        if all(r == fields for r in rows.values()):
            self._host.agree(call)
            return
        with contextlib.suppress(HFReduceMismatchError):  # a local peer differs too: it fails on its own
            self._host.agree(engine.Fingerprint(engine.Collective.DISAGREED_ELSEWHERE, engine.DType.FLOAT32, 0))
        calls = "; ".join(
            f"group rank {rank} (host {host}) called "
            + engine.Fingerprint(engine.Collective(r[0]), engine.DType(r[1]), *r[2:]).describe()
            for host, (rank, r) in enumerate(rows.items())
        )
        self._disagreed = (
            f"hfreduce: ranks on different hosts called different collectives: {calls}. Is there a distributed "
            "collective mismatch in your code? Every rank must make the same calls, with the same sizes, dtypes, "
            f"ops and roots, in the same order (this is group rank {self.rank})"
        )
        raise HFReduceMismatchError(self._disagreed, [rank for rank, r in rows.items() if r != fields])


def _fingerprint(collective: Any, tensor: torch.Tensor, count: int, arg: int = 0, divisor: float = 1.0) -> Any:
    return load_engine().Fingerprint(collective, engine_dtype(tensor.dtype), count, arg, divisor)
