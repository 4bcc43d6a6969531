"""The selection rule and ratio checks: pure logic, no tensors."""

import math

import pytest

from lightning_haiscale.cpu_offload import check_ratio, plan_offload
from lightning_haiscale.cpu_offload.selection import StreamingSelector

SIZES = [300, 40, 1000, 1000, 70, 500, 500, 20, 2000, 64]


@pytest.mark.parametrize("ratio", [0.0, 0.1, 0.25, 0.3, 0.5, 0.77, 1.0])
def test_plan_is_within_half_the_largest_tensor_of_the_target(ratio):
    total = sum(SIZES) + 100  # 100 bytes of tensors too small to be candidates
    plan = plan_offload(SIZES, total, ratio)
    offloaded = sum(s for s, take in zip(SIZES, plan, strict=True) if take)
    target = ratio * total
    if target <= sum(SIZES):
        assert abs(offloaded - target) <= max(SIZES) / 2
    else:
        assert all(plan)


def test_plan_favors_tensors_saved_first():
    assert plan_offload([10] * 10, 100, 0.3) == [True] * 3 + [False] * 7


def test_plan_extremes():
    assert plan_offload(SIZES, sum(SIZES), 0.0) == [False] * len(SIZES)
    assert plan_offload(SIZES, sum(SIZES), 1.0) == [True] * len(SIZES)


def test_streaming_rule_tracks_the_ratio_online():
    selector = StreamingSelector(0.5)
    saved = 0
    for size in [100] * 20:
        saved += size
        selector.take(size, saved)
    assert selector.offloaded == 1000


@pytest.mark.parametrize("bad", [-0.1, 1.01, math.nan])
def test_bad_ratio_names_the_parameter(bad):
    with pytest.raises(ValueError, match="offload_ratio"):
        check_ratio(bad)


@pytest.mark.parametrize("bad", ["half", "0.5", True, None])
def test_a_ratio_that_is_not_a_number_is_a_type_error(bad):
    with pytest.raises(TypeError, match="offload_ratio"):
        check_ratio(bad)
