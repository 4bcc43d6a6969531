"""Bucket planning, without processes."""

import pytest
import torch

from lightning_haiscale.ddp.buckets import plan_buckets, storage_sizes


def _params(*sizes: int, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    return [torch.zeros(n, dtype=dtype) for n in sizes]


def test_reverse_registration_order_and_cap() -> None:
    buckets = plan_buckets(_params(10, 20, 30, 40), cap_bytes=4 * 55)
    assert [b.params for b in buckets] == [(3,), (2, 1), (0,)]  # 40, then 30 + 20 <= 55, then 10
    assert [b.index for b in buckets] == [0, 1, 2]


def test_a_large_parameter_gets_its_own_bucket() -> None:
    buckets = plan_buckets(_params(5, 1000, 5), cap_bytes=4 * 8)
    assert [b.params for b in buckets] == [(2,), (1,), (0,)]


def test_offsets_are_contiguous_aligned_and_disjoint() -> None:
    params = _params(3, 17, 33, 2)
    buckets = plan_buckets(params, cap_bytes=4 * 40)
    covered = set()
    for b in buckets:
        assert b.offset % 16 == 0 and b.numel % 16 == 0  # 64-byte alignment of float32
        assert b.param_offsets[0] == b.offset
        for i, off in zip(b.params, b.param_offsets, strict=True):
            span = set(range(off, off + params[i].numel()))
            assert span <= set(range(b.offset, b.offset + b.numel)) and not span & covered
            covered |= span
    assert storage_sizes(buckets) == {(torch.float32, torch.device("cpu")): sum(b.numel for b in buckets)}


def test_dtypes_never_share_a_bucket() -> None:
    params = [*_params(4, 4), *_params(4, 4, dtype=torch.float64)]
    buckets = plan_buckets(params, cap_bytes=1 << 20)
    assert [b.params for b in buckets] == [(3, 2), (1, 0)]
    assert [b.key[0] for b in buckets] == [torch.float64, torch.float32]
    assert all(b.offset == 0 for b in buckets)  # each dtype has its own storage


def test_cap_must_be_positive() -> None:
    with pytest.raises(ValueError, match="bucket_cap_mb"):
        plan_buckets(_params(4), cap_bytes=0)


def test_in_place_parameters_count_toward_the_cap_but_take_no_storage() -> None:
    params = _params(10, 1000, 20, 30)
    buckets = plan_buckets(params, cap_bytes=4 * 1055, in_place=[False, True, False, False])
    assert [(b.in_place, b.params) for b in buckets] == [((1,), (3, 2)), ((), (0,))]  # 30 + 20 + 1000, then 10
    assert [b.members for b in buckets] == [(1, 3, 2), (0,)]
    assert storage_sizes(buckets) == {(torch.float32, torch.device("cpu")): sum(b.numel for b in buckets)}
    assert sum(b.numel for b in buckets) < 1000
    only = plan_buckets(_params(1000), cap_bytes=4 * 8, in_place=[True])
    assert only[0].numel == 0 and storage_sizes(only) == {}
    with pytest.raises(ValueError, match="in_place has 1 entries for 2 parameters"):
        plan_buckets(_params(4, 4), cap_bytes=64, in_place=[True])
