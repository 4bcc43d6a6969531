"""The reducer: gradient buckets averaged while backward still runs, with no copy of large gradients.

[Note: where gradients live]
Each parameter's gradient has one of two homes, chosen at construction:
- In place: a CPU gradient of at least ``in_place_bytes`` (1 MiB) is all-reduced in the tensor autograd
  made, the ``.grad`` the user sees. The engine stages it through its shared segment chunk by chunk, so
  what it touches stays in cache, and the backward thread copies nothing. After
  ``zero_grad(set_to_none=True)`` the next backward simply makes a fresh tensor, as without DDP.
- Packed: smaller gradients (biases, norms) and every CUDA gradient are views of one flat storage per
  (dtype, device), so that many small gradients make one all-reduce; on CPU that storage comes from
  ``Communicator.alloc_buffer`` and the engine reduces it in shared memory with no copy in or out.
  Autograd accumulates into an existing ``.grad`` in place, so a view survives backward and gradient
  accumulation. After ``.grad = None`` the next backward stores a fresh tensor, which the hook that
  marks the gradient ready copies into its view (torch DDP's ``gradient_as_bucket_view`` does the same).
What the user sees is torch DDP's: ``zero_grad()`` (``set_to_none=True``) leaves every ``.grad`` None,
``zero_grad(set_to_none=False)`` zeroes them in place; after a synchronized backward every used
parameter has its averaged gradient. Packing every gradient, as before, cost the backward thread one
copy of all gradients per step; keeping views across ``set_to_none`` by zeroing them instead costs a
memset plus an add that reads one more gradient-sized buffer than that copy. Both were measured slower
than reducing in place (``benchmarks/RESULTS.md``, hai_ddp section).

[Note: bucket launch order]
Every rank must issue the same collectives in the same order, but the order of gradient hooks can differ
between ranks. As in torch DDP, buckets launch strictly in index order: each as soon as it and every
bucket before it are complete. Buckets follow reverse registration order, so this rarely delays one.

[Note: a gradient accumulated twice]
A parameter used inside a reentrant activation checkpoint and outside it gets its gradient accumulated
twice in one backward (the checkpoint's inner backward is a second pass). If its bucket was launched
after the first accumulation, the second would be added into memory the engine is reducing (and, on
CUDA, overwritten by the copy back). So a launched bucket's parameters get ``.grad = None`` (an in-place
gradient is kept aside until the reduction is done): a late accumulation lands in a fresh tensor, which
the hook sets aside. At the end of backward, the late contributions of every parameter accumulated more
often than expected are averaged in one more all-reduce (zeros where a rank's second accumulation still
made it into the bucket: averaging is linear, so the sum is right either way) and added to the reduced
gradients. Which parameters those are depends only on the graph, so every rank makes the same call. The
counts seen are then expected: from the next backward on, such a parameter is ready only after its last
accumulation, and no extra all-reduce runs.

[Note: end of backward]
The first gradient hook of a synchronized backward queues a callback on the autograd engine (torch DDP
does the same: there is no public "backward finished" hook). The callback deals with parameters that got
no gradient, launches the remaining buckets and waits for every bucket, so ``backward()`` returns with
all gradients averaged. A parameter without a gradient is an error unless
``find_unused_parameters=True``: then its slot (or a zero tensor, for an in-place parameter) contributes
zeros, and a bitmap all-reduce tells whether any rank used it; a parameter no rank used keeps ``.grad =
None`` (as in torch DDP and a single process). Unused parameters are found only at the end of backward,
so buckets after the first one holding an unused parameter do not overlap backward.
"""

from __future__ import annotations

import functools
import logging
import time
import weakref
from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lightning_haiscale.ddp.buckets import Bucket, plan_buckets, storage_sizes
from lightning_haiscale.grad_sync import sync_off
from lightning_haiscale.hfreduce import Communicator, Work

__all__ = ["IN_PLACE_BYTES", "Reducer", "ReducerStats"]

log = logging.getLogger(__name__)

IN_PLACE_BYTES = 1 << 20  # a CPU gradient this large is reduced where autograd put it ([Note: where gradients live])


@dataclass
class ReducerStats:
    """What the reducer did since it was made or last reset, summed over synchronized backwards: where a
    step's communication time goes (``benchmarks/strategy_ddp.py`` prints it per step)."""

    backwards: int = 0
    copied_bytes: int = 0  # fresh gradients copied into their packed views
    copy_seconds: float = 0.0  # spent in those copies, on the backward thread
    in_place_bytes: int = 0  # gradients all-reduced where autograd put them
    overlapped: int = 0  # all-reduces launched while backward still ran
    at_end: int = 0  # all-reduces launched by the end-of-backward callback
    wait_seconds: float = 0.0  # the end-of-backward callback waiting for every all-reduce


class Reducer:
    """Owns the gradient buckets of ``params`` and their all-reduce over ``comm``.

    Construction is collective (the CPU buckets are allocated in the engine's shared memory).

    Args:
        params: the parameters to synchronize, in registration order; identical on every rank.
        comm: the communicator; the reducer closes it in :meth:`stop`.
        names: a name per parameter, for error messages.
        bucket_cap_bytes: the most bytes of gradients in one bucket.
        find_unused_parameters: allow parameters that get no gradient in a backward.
        in_place_bytes: CPU gradients at least this large are reduced where autograd put them, smaller ones
            and CUDA ones are packed into buckets (see [Note: where gradients live]); default
            ``IN_PLACE_BYTES``, read at construction.
    """

    def __init__(
        self,
        params: Sequence[nn.Parameter],
        comm: Communicator,
        names: Sequence[str],
        bucket_cap_bytes: int,
        find_unused_parameters: bool = False,
        in_place_bytes: int | None = None,
    ) -> None:
        in_place_bytes = IN_PLACE_BYTES if in_place_bytes is None else in_place_bytes
        self.params = list(params)
        self.names = list(names)
        self.comm = comm
        self.find_unused_parameters = find_unused_parameters
        self.require_backward_grad_sync = True
        self.stats = ReducerStats()
        self.in_place = [p.device.type == "cpu" and p.numel() * p.element_size() >= in_place_bytes for p in self.params]
        self.buckets: list[Bucket] = plan_buckets(self.params, bucket_cap_bytes, self.in_place)
        self.storage = {key: self._allocate(numel, *key) for key, numel in storage_sizes(self.buckets).items()}
        self.grad_views: list[torch.Tensor | None] = [None] * len(self.params)  # packed parameters' homes
        self.bucket_views: list[torch.Tensor | None] = []  # None where a bucket packs nothing
        self._bucket_of = [0] * len(self.params)
        self._expected = [1] * len(self.params)  # accumulations per backward (see [Note: a gradient ...])
        for b in self.buckets:
            flat = self.storage.get(b.key)
            self.bucket_views.append(flat[b.offset : b.offset + b.numel] if flat is not None and b.params else None)
            for i, offset in zip(b.params, b.param_offsets, strict=True):
                self.grad_views[i] = flat[offset : offset + self.params[i].numel()].view_as(self.params[i])
            for i in b.members:
                self._bucket_of[i] = b.index
        self._reset()
        handles = self._register_hooks()
        self._finalizer = weakref.finalize(self, _release, handles, comm)
        log.debug(
            "hai_ddp: %d parameters in %d buckets, %d reduced in place",
            len(self.params),
            len(self.buckets),
            sum(self.in_place),
        )

    def _allocate(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        if device.type == "cpu":
            return self.comm.alloc_buffer(numel, dtype)
        return torch.zeros(numel, dtype=dtype, device=device)

    def _register_hooks(self) -> list[Any]:
        me = weakref.ref(self)  # the hooks must not keep the reducer (and its communicator) alive
        handles = []
        for i, p in enumerate(self.params):
            handles.append(p.register_post_accumulate_grad_hook(functools.partial(_after_accumulate, me, i)))
        return handles

    def _reset(self) -> None:
        self._ready = [False] * len(self.params)
        self._pending = [len(b.members) for b in self.buckets]
        self._next_bucket = 0
        self._works: list[Work] = []
        self._callback_queued = False
        self._finishing = False
        self._count = [0] * len(self.params)
        self._late: dict[int, torch.Tensor] = {}
        self._in_flight: dict[int, torch.Tensor] = {}  # in-place gradients being reduced

    # ------------------------------------------------------------------------------ public

    def no_sync(self) -> AbstractContextManager[None]:
        """Backwards inside accumulate gradients locally (in the buckets) without communication."""
        return sync_off(self, "require_backward_grad_sync")

    def stop(self) -> None:
        """Removes the gradient hooks and stops the communication engine. Idempotent."""
        self._finalizer()

    @property
    def stopped(self) -> bool:
        return not self._finalizer.alive

    # ------------------------------------------------------------------------------- hooks

    def attach_grad(self, i: int) -> None:
        """Makes a packed ``params[i].grad`` its bucket view, with the same value (see [Note: where gradients
        live]); an in-place parameter's gradient stays where it is."""
        p, view = self.params[i], self.grad_views[i]
        grad = p.grad
        if view is None:
            return
        if grad is None:
            view.zero_()
        elif grad.data_ptr() == view.data_ptr() and grad.shape == view.shape:
            return
        else:
            start = time.perf_counter()
            view.copy_(grad)
            self.stats.copy_seconds += time.perf_counter() - start
            self.stats.copied_bytes += grad.numel() * grad.element_size()
        p.grad = view

    def mark_ready(self, i: int) -> None:
        """Called once ``params[i]``'s gradient is accumulated; launches the buckets that became complete."""
        if not self.require_backward_grad_sync or self.stopped:
            self.attach_grad(i)
            return
        if not self._callback_queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
            self._callback_queued = True
        self._count[i] += 1
        if self._bucket_of[i] < self._next_bucket:  # launched: set this contribution aside
            p = self.params[i]
            self._late[i] = p.grad if i not in self._late else self._late[i] + p.grad
            p.grad = None
            return
        self.attach_grad(i)
        if self._ready[i] or self._count[i] < self._expected[i]:
            return
        self._ready[i] = True
        self._pending[self._bucket_of[i]] -= 1
        self._launch_complete_buckets()

    def _launch_complete_buckets(self) -> None:
        while self._next_bucket < len(self.buckets) and self._pending[self._next_bucket] == 0:
            bucket = self.buckets[self._next_bucket]
            for i in bucket.in_place:
                self._launch_in_place(i)
            view = self.bucket_views[bucket.index]
            if view is not None:
                for i in bucket.params:  # a later accumulation must not touch memory being reduced
                    self.params[i].grad = None
                self._launch(view)
            self._next_bucket += 1

    def _launch_in_place(self, i: int) -> None:
        """All-reduces ``params[i]``'s gradient where it is (zeros if it has none: see [Note: end of backward])."""
        p = self.params[i]
        grad = p.grad if p.grad is not None else torch.zeros_like(p)
        if not grad.is_contiguous():  # the engine reads flat memory
            grad = grad.contiguous()
        self._in_flight[i] = grad
        p.grad = None  # a later accumulation must not touch memory being reduced
        self.stats.in_place_bytes += grad.numel() * grad.element_size()
        self._launch(grad)

    def _launch(self, tensor: torch.Tensor) -> None:
        self._works.append(self.comm.all_reduce(tensor, op="avg", async_op=True))
        if self._finishing:
            self.stats.at_end += 1
        else:
            self.stats.overlapped += 1

    def _reduced(self, i: int) -> torch.Tensor:
        """Where ``params[i]``'s averaged gradient is once this backward's all-reduces are done."""
        view = self.grad_views[i]
        return view if view is not None else self._in_flight[i]

    def _finish_backward(self) -> None:
        self._finishing = True
        try:
            missing = [i for i, ready in enumerate(self._ready) if not ready]
            unused = [i for i in missing if self._count[i] == 0]
            if unused and not self.find_unused_parameters:
                raise RuntimeError(
                    f"hai_ddp: parameters {[self.names[i] for i in unused[:8]]} (and {max(0, len(unused) - 8)} "
                    "more) got no gradient in this backward. Pass find_unused_parameters=True to "
                    "DistributedDataParallel (or HaiDDPStrategy), or make every parameter take part in the loss."
                )
            had_grad = [self.params[i].grad is not None for i in missing]
            for i in missing:
                self.attach_grad(i)  # a packed slot without a gradient is zeroed
                self._ready[i] = True
                self._pending[self._bucket_of[i]] -= 1
            self._launch_complete_buckets()
            used = self._globally_used(missing, had_grad) if self.find_unused_parameters else None
            late = self._reduce_late_contributions()
            start = time.perf_counter()
            for work in self._works:
                work.wait()
            self.stats.wait_seconds += time.perf_counter() - start
            self.stats.backwards += 1
            nobody_used = {i for k, i in enumerate(missing) if not had_grad[k] and used is not None and not used[k]}
            for i, p in enumerate(self.params):
                if i not in nobody_used:
                    p.grad = self._reduced(i)
            for i, contribution in late.items():
                self._reduced(i).add_(contribution)
        finally:
            self._reset()

    def _reduce_late_contributions(self) -> dict[int, torch.Tensor]:
        """Averages what parameters accumulated beyond the expected count (see [Note: a gradient ...])."""
        extra = [i for i, count in enumerate(self._count) if count > self._expected[i]]
        for i, count in enumerate(self._count):
            if count > 0:
                self._expected[i] = count
        if not extra:
            return {}
        parts = [self._late.get(i, torch.zeros_like(self.params[i])).reshape(-1) for i in extra]
        flat = torch.cat(parts)
        self.comm.all_reduce(flat, op="avg")
        pieces = flat.split([part.numel() for part in parts])
        return {i: piece.view_as(self.params[i]) for i, piece in zip(extra, pieces, strict=True)}

    def _globally_used(self, missing: list[int], had_grad: list[bool]) -> list[bool]:
        """Whether any rank has a gradient for each parameter (one small all-reduce, on every rank)."""
        flags = torch.ones(len(self.params), dtype=torch.int32)
        for i, has in zip(missing, had_grad, strict=True):
            flags[i] = int(has)
        self.comm.all_reduce(flags, op="sum")
        return [bool(flags[i] > 0) for i in missing]


def _after_accumulate(reducer: weakref.ref[Reducer], i: int, param: torch.Tensor) -> None:
    r = reducer()
    if r is not None:
        r.mark_ready(i)


def _release(handles: list[Any], comm: Communicator) -> None:
    for handle in handles:
        handle.remove()
    comm.close()
