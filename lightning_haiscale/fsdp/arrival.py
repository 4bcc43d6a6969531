"""A check that every rank entered a collective call, before any engine collective of that call starts.

[Note: why an arrival check] haiscale's save snippet calls ``state_dict()`` on rank 0 alone inside
``summon_full_params`` (there it is local). Outside that context ``state_dict()`` gathers every unit, so a
call on a subset of ranks would wait on the engine until its 5-minute deadline (peers alive elsewhere) or
report a dead peer without saying why. So a collective entry point first passes a ``monitored_barrier`` on
a gloo group of its own (used for nothing else, so it cannot pair with another collective): a few
milliseconds when every rank comes, an error naming the call and the missing ranks when one does not
(at once for a peer that exited, after ``timeout`` for one busy elsewhere), before the engine is touched.
"""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

__all__ = ["ArrivalCheck", "CollectiveMisuseError"]


class CollectiveMisuseError(RuntimeError):
    """A collective call was made on a subset of its group's ranks."""


class ArrivalCheck:
    """Checks that every rank of ``group`` reaches the same collective call (see [Note: why an arrival check]).

    Construction is collective over ``group`` (it creates a gloo group of the same ranks).
    """

    def __init__(self, group: dist.ProcessGroup, timeout: timedelta) -> None:
        self.timeout = timeout
        ranks = dist.get_process_group_ranks(group)
        self._group = dist.new_group(ranks, backend="gloo", use_local_synchronization=True) if len(ranks) > 1 else None

    def __call__(self, call: str, hint: str = "") -> None:
        """Raises :class:`CollectiveMisuseError` unless every rank makes ``call`` within ``timeout``."""
        if self._group is None:
            return
        try:
            dist.monitored_barrier(self._group, timeout=self.timeout, wait_all_ranks=True)
        except RuntimeError as error:
            raise CollectiveMisuseError(
                f"{call} is collective{hint}: call it on every rank (not every rank came within "
                f"{self.timeout.total_seconds():g} s: {error})"
            ) from error
