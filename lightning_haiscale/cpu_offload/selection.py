"""Which saved tensors to offload: pure logic over byte sizes, no tensors.

[Note: the selection rule]
The target is ``offload_ratio * bytes_saved``, where ``bytes_saved`` counts every saved activation of
the region (small ones included; parameters excluded). Candidates are the activations large enough to
copy, in the order they were saved. Walking them in that order, a candidate is taken when taking it
brings the offloaded total closer to the target than leaving it (``offloaded + size / 2 < target``).
The first-saved tensors are preferred because they wait longest for backward, which gives their
host-to-device copies the most time. Every taken candidate ends below ``target + size / 2`` and every
skipped one means the total was already above ``target - size / 2``, so the result is within half the
largest candidate of the target whenever the candidates can reach it.

A region runs this rule on a plan measured on its previous entry (``plan_offload``). When no
measurement exists or the region saves a different sequence of sizes, ``StreamingSelector`` applies
the same rule online, against the bytes saved so far.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence

__all__ = ["StreamingSelector", "check_ratio", "plan_offload"]


def check_ratio(offload_ratio: float) -> float:
    """``offload_ratio`` as a float; ``TypeError`` unless it is a real number (a string or a bool is not, though
    ``float()`` would take them), ``ValueError`` when it is outside [0, 1]."""
    if type(offload_ratio) is float and 0.0 <= offload_ratio <= 1.0:  # the common case, without the ABC check
        return offload_ratio
    if isinstance(offload_ratio, bool) or not isinstance(offload_ratio, numbers.Real):
        raise TypeError(
            f"offload_ratio={offload_ratio!r} ({type(offload_ratio).__name__}) must be a number between 0 and 1, "
            "such as 0.3"
        )
    ratio = float(offload_ratio)
    if not 0.0 <= ratio <= 1.0:
        raise ValueError(f"offload_ratio={offload_ratio!r} is outside [0, 1]; pass a fraction such as 0.3")
    return ratio


def plan_offload(candidate_sizes: Sequence[int], bytes_saved: int, offload_ratio: float) -> list[bool]:
    """Per candidate (in save order): offload it or not, so the total is closest to the target."""
    target = offload_ratio * bytes_saved
    plan = []
    offloaded = 0
    for size in candidate_sizes:
        take = offloaded + size / 2 < target
        plan.append(take)
        offloaded += size if take else 0
    return plan


class StreamingSelector:
    """The selection rule applied online, when the region's total is not known in advance."""

    def __init__(self, offload_ratio: float) -> None:
        self.offload_ratio = offload_ratio
        self.offloaded = 0

    def take(self, size: int, bytes_saved_so_far: int) -> bool:
        """Whether to offload a candidate of ``size``; ``bytes_saved_so_far`` includes it."""
        take = self.offloaded + size / 2 < self.offload_ratio * bytes_saved_so_far
        self.offloaded += size if take else 0
        return take
