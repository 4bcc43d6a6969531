"""A check that every rank entered a collective call, before any engine collective of that call starts.

[Note: why an arrival check]
haiscale's save snippet calls ``state_dict()`` on rank 0 alone inside ``summon_full_params`` (there it is
local). Outside that context ``state_dict()`` gathers every unit, so a call on a subset of ranks would wait
on the engine until its 5-minute deadline (peers alive elsewhere) or report a dead peer without saying why.
So a collective entry point first passes a ``monitored_barrier`` on a gloo group used for nothing else (so
it cannot pair with another kind of collective): a few milliseconds when every rank comes, an error naming
the call and the missing ranks when one does not (at once for a peer that exited, after ``timeout`` for one
busy elsewhere), before the engine is touched.

[Note: one gloo group per process group]
Every wrapper over the same process group shares one such gloo group (a gloo group costs a rendezvous and a
connection per pair of ranks). Each check on it carries its wrapper's number (wrappers are built
collectively, so every rank numbers them alike): after the barrier the ranks exchange the numbers, and a
call made on different models on different ranks raises, as it did when each wrapper had a group of its own.
"""

from __future__ import annotations

import itertools
from datetime import timedelta

import torch
import torch.distributed as dist

from lightning_haiscale.hfreduce import kept_collectives

__all__ = ["ArrivalCheck", "CollectiveMisuseError"]


class CollectiveMisuseError(RuntimeError):
    """A collective call was made on a subset of its group's ranks."""


class _SharedGroup:
    """The gloo group of one process group's ranks, and the numbering of the checks that use it."""

    def __init__(self, ranks: list[int]) -> None:
        self.group = dist.new_group(ranks, backend="gloo", use_local_synchronization=True)
        self.numbers = itertools.count()


_SHARED: dict[dist.ProcessGroup, _SharedGroup] = {}  # holds the process groups: no id is reused while listed


def _shared_group(group: dist.ProcessGroup) -> _SharedGroup:
    if group not in _SHARED:
        _SHARED[group] = _SharedGroup(dist.get_process_group_ranks(group))
    return _SHARED[group]


class ArrivalCheck:
    """Checks that every rank of ``group`` reaches the same collective call (see [Note: why an arrival check]).

    The first check built over ``group`` in a process creates the gloo group of its ranks, collectively; later
    ones share it (see [Note: one gloo group per process group]).
    """

    def __init__(self, group: dist.ProcessGroup, timeout: timedelta) -> None:
        self.timeout = timeout
        self._shared = _shared_group(group) if dist.get_world_size(group) > 1 else None
        self._number = next(self._shared.numbers) if self._shared is not None else 0

    def __call__(self, call: str, hint: str = "") -> None:
        """Raises :class:`CollectiveMisuseError` unless every rank makes ``call`` on this model within
        ``timeout``."""
        if self._shared is None:
            return
        group = self._shared.group
        try:
            dist.monitored_barrier(group, timeout=self.timeout, wait_all_ranks=True)
        except RuntimeError as error:
            raise CollectiveMisuseError(
                f"{call} is collective{hint}: call it on every rank (not every rank came within "
                f"{self.timeout.total_seconds():g} s: {error})"
            ) from error
        numbers = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size(group))]
        kept_collectives.all_gather(numbers, torch.tensor([self._number]), group)
        if any(int(n) != self._number for n in numbers):
            raise CollectiveMisuseError(
                f"{call} is collective{hint}: the ranks called it on different models (models number "
                f"{[int(n) for n in numbers]} by rank, in the order each rank built them); call it on the same "
                "model on every rank"
            )
