"""The host buffer pool: reuse across steps, the pinned cap and its pageable fallback."""

import pytest
import torch

from lightning_haiscale.cpu_offload import PinnedBufferPool
from lightning_haiscale.cpu_offload.pool import size_class


def test_size_classes_round_up():
    assert size_class(1) == 4096
    assert size_class(5000) == 8192
    assert size_class((1 << 20) + 1) == 2 << 20
    with pytest.raises(ValueError, match="nbytes"):
        size_class(0)


def test_released_buffers_are_reused():
    pool = PinnedBufferPool(limit_bytes=0)
    first = pool.acquire(3000, pin=False)
    assert first.tensor.numel() == 3000 and first.capacity == 4096
    pool.release(first)
    again = pool.acquire(2500, pin=False)
    assert again.block.data_ptr() == first.block.data_ptr()
    assert pool.idle_bytes == 0


def test_pinned_requests_past_the_cap_fall_back_to_pageable():
    pool = PinnedBufferPool(limit_bytes=0)
    buf = pool.acquire(1 << 20, pin=True)
    assert not buf.pinned and not buf.block.is_pinned()
    assert pool.pageable_fallbacks == 1 and pool.pinned_bytes == 0


def test_negative_limit_is_rejected():
    with pytest.raises(ValueError, match="limit_bytes"):
        PinnedBufferPool(limit_bytes=-1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA for pinned memory")
def test_cap_evicts_idle_buffers_of_other_sizes():
    pool = PinnedBufferPool(limit_bytes=4 << 20)
    small = pool.acquire(1 << 20, pin=True)
    assert small.pinned and small.block.is_pinned()
    pool.release(small)
    big = pool.acquire(3 << 20, pin=True)  # a 4 MiB class: fits only once the idle 1 MiB buffer is dropped
    assert big.pinned and pool.pinned_bytes == 4 << 20 and pool.idle_bytes == 0
    assert not pool.acquire(1 << 20, pin=True).pinned and pool.pageable_fallbacks == 1
