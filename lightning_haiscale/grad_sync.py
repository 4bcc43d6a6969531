"""``sync_off``: the one mechanism behind the plain-layer wrappers' ``no_sync()``.

Each wrapper keeps a flag, "the next backward synchronizes the gradients", which its backward path reads:
the DDP reducer's ``require_backward_grad_sync``, the ``sync_grads`` of ``FullyShardedDataParallel``'s
scheduler and the pipelines' ``_sync_grads``. ``no_sync()`` turns that flag off for a block and restores the
value it had, so blocks nest (as torch DDP's ``no_sync`` does). The four ``no_sync()`` agree on this meaning:
inside, backwards accumulate gradients locally and communicate nothing; the first backward outside synchronizes
what accumulated. They differ only in what reads the flag: the reducer skips its bucket all-reduces (the DDP
wrapper delegates to it, and skips the buffer broadcast of the next forward too), FSDP keeps each unit's
unsharded gradient instead of reduce-scattering it, and a pipeline runs every microbatch's backward inside each
stage's own ``no_sync()``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["sync_off"]


@contextmanager
def sync_off(owner: object, flag: str) -> Iterator[None]:
    """Sets the boolean attribute ``owner.<flag>`` to False inside the block, then restores its value."""
    previous = getattr(owner, flag)
    setattr(owner, flag, False)
    try:
        yield
    finally:
        setattr(owner, flag, previous)
