"""Bytes that cross hosts: counted at the ``torch.distributed`` calls of a process, against the ring's theory.

[Note: counting bytes across hosts]
Hosts are simulated (``HFREDUCE_NODE_ID``), so every byte goes through the loopback and no network counter can
tell a byte between hosts from one inside a host. What can be counted is what each rank hands to a collective
over a group whose ranks sit on more than one host: the hfreduce engine's only path between hosts is
``torch.distributed`` over such groups (hfreduce/hierarchical.py), and FSDP2 calls ``torch.distributed`` for
every collective. :class:`CrossHostBytes` wraps the tensor collectives of ``torch.distributed`` and the two that
hfreduce/hierarchical.py bound at import (``all_gather_tensor``, ``reduce_scatter_tensor``), counts the outermost
call only (one collective may call another), and turns each call's payload into the bytes this rank sends by
the ring's cost over the group's ``p`` ranks (for ``p = 2``, the groups here, any algorithm sends as much):

- all-reduce of ``S`` bytes: ``2 (p - 1) / p * S`` (reduce-scatter, then all-gather, around the ring);
- all-gather of an ``n``-byte input: ``(p - 1) * n``;
- reduce-scatter of an ``N``-byte input: ``(p - 1) / p * N``;
- broadcast of ``S`` bytes: ``S`` (a pipelined chain: each rank forwards what it receives once).

int64 tensors are control, counted apart from the payload: the engine's agreement on each call (a few
fingerprint fields, see hierarchical.py [Note: agreement across hosts]) and Lightning's own flags. Every payload
group in the measured runs has one rank per host (the engine's cross-host groups, FSDP2's replicate groups), so
each byte sent in them crosses hosts.
"""

from __future__ import annotations

import functools
import inspect
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["CrossHostBytes", "Tally", "full_shard_theory", "hybrid_theory", "sent_bytes"]

_COLLECTIVES = {  # name in torch.distributed -> the kind of collective
    "all_reduce": "all_reduce",
    "broadcast": "broadcast",
    "all_gather_single": "all_gather",
    "all_gather_into_tensor": "all_gather",
    "reduce_scatter_single": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter",
}
_ENGINE_BINDINGS = {"all_gather_tensor": "all_gather", "reduce_scatter_tensor": "reduce_scatter"}  # hierarchical.py's
_CONTRIBUTION = ("tensor", "input_tensor", "input")  # the argument that holds what this rank hands in, by signature


def sent_bytes(kind: str, payload: int, p: int) -> float:
    """What one rank sends in a ring collective of ``kind`` over ``p`` ranks, given the bytes it hands in
    (see [Note: counting bytes across hosts])."""
    if kind == "all_reduce":
        return 2 * (p - 1) / p * payload
    if kind == "all_gather":
        return (p - 1) * payload
    if kind == "reduce_scatter":
        return (p - 1) / p * payload
    if kind == "broadcast":
        return float(payload)
    raise ValueError(f"kind={kind!r} is not a counted collective; choose one of all_reduce, all_gather, "
                     "reduce_scatter, broadcast")  # fmt: skip


def hybrid_theory(params: int, shard: int, replicate: int, itemsize: int = 4) -> float:
    """Bytes one rank sends across hosts per step under hybrid sharding: one ring all-reduce, over the
    ``replicate`` hosts, of its gradient shard (``params * itemsize / shard`` bytes, padding left out)."""
    return sent_bytes("all_reduce", params * itemsize // shard, replicate)


def full_shard_theory(params: int, world: int, hosts: int, itemsize: int = 4) -> float:
    """Bytes one rank sends across hosts per step under FULL_SHARD over ``hosts`` hosts on the hierarchical
    path: two all-gathers (forward, and backward after the forward resharded) and one reduce-scatter, each
    moving ``(hosts - 1)`` times this rank's shard (``params * itemsize / world``) across hosts."""
    return 3 * (hosts - 1) * params * itemsize / world


@dataclass
class Tally:
    """What one rank handed to collectives across hosts: calls, payload and sent bytes by kind."""

    calls: dict[str, int] = field(default_factory=dict)
    payload: dict[str, int] = field(default_factory=dict)
    sent: dict[str, float] = field(default_factory=dict)
    control_bytes: int = 0  # int64 tensors handed in: the engine's fingerprints, Lightning's flags (not payload)

    def add(self, kind: str, payload: int, p: int) -> None:
        self.calls[kind] = self.calls.get(kind, 0) + 1
        self.payload[kind] = self.payload.get(kind, 0) + payload
        self.sent[kind] = self.sent.get(kind, 0.0) + sent_bytes(kind, payload, p)

    def total_sent(self) -> float:
        return sum(self.sent.values())


class CrossHostBytes:
    """Counts the bytes this rank hands to collectives over groups that span hosts, while :attr:`counting`
    (see [Note: counting bytes across hosts]). ``hosts[r]`` names global rank ``r``'s host. Install before
    the collectives to count run, uninstall after; ``install`` imports the engine's hierarchical module first,
    so that its own bindings are the originals, wrapped once."""

    def __init__(self, hosts: Sequence[str]) -> None:
        self.hosts = list(hosts)
        self.tally = Tally()
        self.counting = False
        self._spans: dict[int, tuple[Any, int | None]] = {}  # id(group) -> (group, its size if it spans hosts)
        self._lock = threading.Lock()
        self._inside = threading.local()
        self._saved: list[tuple[Any, str, Callable[..., Any]]] = []

    def install(self) -> CrossHostBytes:
        from lightning_haiscale.hfreduce import hierarchical

        for name, kind in _COLLECTIVES.items():
            if hasattr(dist, name):
                self._wrap(dist, name, kind)
        for name, kind in _ENGINE_BINDINGS.items():
            self._wrap(hierarchical, name, kind)
        return self

    def uninstall(self) -> None:
        for owner, name, call in reversed(self._saved):
            setattr(owner, name, call)
        self._saved.clear()

    def _wrap(self, owner: Any, name: str, kind: str) -> None:
        call = getattr(owner, name)
        signature = inspect.signature(call)
        argument = next(a for a in _CONTRIBUTION if a in signature.parameters)

        @functools.wraps(call)  # keeps the signature, for another counter's wrapping
        def counted(*args: Any, **kwargs: Any) -> Any:
            if not self.counting or getattr(self._inside, "busy", False):
                return call(*args, **kwargs)
            bound = signature.bind(*args, **kwargs)
            self._count(kind, bound.arguments.get(argument), bound.arguments.get("group"))
            self._inside.busy = True
            try:
                return call(*args, **kwargs)
            finally:
                self._inside.busy = False

        self._saved.append((owner, name, call))
        setattr(owner, name, counted)

    def _count(self, kind: str, tensor: torch.Tensor | None, group: dist.ProcessGroup | None) -> None:
        p = self._spanning_size(group)
        if p is None or tensor is None:
            return
        nbytes = tensor.numel() * tensor.element_size()
        with self._lock:
            if tensor.dtype == torch.int64:
                self.tally.control_bytes += nbytes
            else:
                self.tally.add(kind, nbytes, p)

    def _spanning_size(self, group: dist.ProcessGroup | None) -> int | None:
        """The group's size if its ranks sit on more than one host, else None."""
        group = group if group is not None else dist.group.WORLD
        known = self._spans.get(id(group))
        if known is None or known[0] is not group:
            ranks = dist.get_process_group_ranks(group)
            spans = len({self.hosts[r] for r in ranks}) > 1
            known = (group, len(ranks) if spans else None)
            self._spans[id(group)] = known
        return known[1]
