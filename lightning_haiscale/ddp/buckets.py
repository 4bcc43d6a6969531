"""Gradient buckets: which parameters share one all-reduce, and where each gradient lives in flat storage.

Pure bookkeeping, no processes: :func:`plan_buckets` is tested on its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["Bucket", "plan_buckets", "storage_sizes"]

_ALIGN_BYTES = 64  # every bucket starts on a cache line of its flat storage


@dataclass(frozen=True)
class Bucket:
    """Parameters whose gradients are reduced together, launched as one unit.

    The packed parameters' gradients live in a contiguous slice ``[offset, offset + numel)`` of the flat
    storage of its key and make one all-reduce; each in-place parameter's gradient is all-reduced where
    autograd put it (see ``lightning_haiscale.ddp.reducer`` [Note: where gradients live]).

    Attributes:
        index: launch order; buckets are reduced in this order on every rank.
        params: indices of the packed parameters, in the order their gradients are laid out.
        key: (dtype, device) of its gradients: the flat storage it lives in.
        offset: first element of the bucket in that storage.
        numel: elements, including alignment padding at the end (0 when nothing is packed).
        param_offsets: first element of each packed parameter's gradient in the storage.
        in_place: indices of the parameters reduced in place, in launch order (before the packed slice).
    """

    index: int
    params: tuple[int, ...]
    key: tuple[torch.dtype, torch.device]
    offset: int
    numel: int
    param_offsets: tuple[int, ...]
    in_place: tuple[int, ...] = ()

    @property
    def members(self) -> tuple[int, ...]:
        """Every parameter of the bucket: in place, then packed."""
        return self.in_place + self.params


def plan_buckets(params: Sequence[torch.Tensor], cap_bytes: int, in_place: Sequence[bool] = ()) -> list[Bucket]:
    """Groups ``params`` into buckets of at most ``cap_bytes`` (a larger parameter gets a bucket of its own).

    Parameters are taken in reverse registration order, the order backward usually produces their
    gradients, so the first buckets fill up first and their all-reduce overlaps the rest of backward.
    Only parameters of one dtype and device share a bucket. ``in_place[i]`` (default False) marks a
    parameter whose gradient is reduced where it is: it counts toward the cap but takes no storage.
    """
    if cap_bytes <= 0:
        raise ValueError(f"bucket cap {cap_bytes} bytes must be positive; pass bucket_cap_mb > 0")
    groups: list[tuple[tuple[torch.dtype, torch.device], list[int]]] = []
    open_group: dict[tuple[torch.dtype, torch.device], int] = {}  # key -> index in groups of its open bucket
    filled: dict[int, int] = {}  # group index -> bytes so far
    for i in reversed(range(len(params))):
        p = params[i]
        key, size = (p.dtype, p.device), p.numel() * p.element_size()
        g = open_group.get(key)
        if g is None or (filled[g] > 0 and filled[g] + size > cap_bytes):
            g = len(groups)
            groups.append((key, []))
            open_group[key], filled[g] = g, 0
        groups[g][1].append(i)
        filled[g] += size
    flags = list(in_place) or [False] * len(params)
    if len(flags) != len(params):
        raise ValueError(f"in_place has {len(flags)} entries for {len(params)} parameters")
    return _lay_out(params, groups, flags)


def _lay_out(
    params: Sequence[torch.Tensor],
    groups: list[tuple[tuple[torch.dtype, torch.device], list[int]]],
    in_place: Sequence[bool],
) -> list[Bucket]:
    """Assigns offsets to the packed parameters: per key, buckets follow each other in launch order, each aligned."""
    next_offset: dict[tuple[torch.dtype, torch.device], int] = {}
    buckets = []
    for index, (key, members) in enumerate(groups):
        packed = [i for i in members if not in_place[i]]
        start = next_offset.get(key, 0)
        offsets, cursor = [], start
        for i in packed:
            offsets.append(cursor)
            cursor += params[i].numel()
        align = max(1, _ALIGN_BYTES // params[members[0]].element_size())
        numel = -(-(cursor - start) // align) * align
        next_offset[key] = start + numel
        own = tuple(i for i in members if in_place[i])
        buckets.append(Bucket(index, tuple(packed), key, start, numel, tuple(offsets), own))
    return buckets


def storage_sizes(buckets: Sequence[Bucket]) -> dict[tuple[torch.dtype, torch.device], int]:
    """Elements of flat storage each key needs, keys in order of first use (identical on every rank); a key
    whose parameters are all reduced in place needs none and is left out."""
    sizes: dict[tuple[torch.dtype, torch.device], int] = {}
    for b in buckets:
        if b.numel:
            sizes[b.key] = max(sizes.get(b.key, 0), b.offset + b.numel)
    return sizes
