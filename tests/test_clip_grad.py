"""``clip_grad_norm_`` over parts of one model held by different ranks, against torch's on the whole model.

In float64 (``_model_with_grads``), at ``FLOAT64_TOLERANCES``, which another summation order of the norm cannot
reach ([Note: parity tolerances] in lightning_haiscale/testing/parity.py). Was: the norm was rounded to float32,
so a float64 model was clipped by a coefficient 1e-8 off torch's (found by the float64 pipeline parity test).
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from lightning_haiscale.clip_grad import clip_grad_norm_
from lightning_haiscale.testing.parity import FLOAT64_RTOL, FLOAT64_TOLERANCES, default_dtype
from tests.distributed import run_distributed

MAX_NORM = 0.5  # below the gradient norm of the model below, so clipping acts


@default_dtype(torch.float64)
def _model_with_grads() -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 2))
    model(torch.randn(32, 8)).pow(2).sum().backward()
    return model


def _clip_halves(rank: int, world: int, norm_type: float) -> tuple[float, list[list[float]]]:
    """Rank r clips the parameters r, r + world, ...: its part of the model."""
    params = list(_model_with_grads().parameters())[rank::world]
    total = clip_grad_norm_(params, MAX_NORM, norm_type)
    assert total.dtype == torch.float64, "a float64 model's norm keeps its precision, as torch's"
    return float(total), [p.grad.flatten().tolist() for p in params]


@pytest.mark.parametrize("norm_type", [2.0, math.inf])
def test_matches_torch_on_the_whole_model(norm_type: float) -> None:
    reference = _model_with_grads()
    expected_total = float(torch.nn.utils.clip_grad_norm_(reference.parameters(), MAX_NORM, norm_type))
    assert expected_total > MAX_NORM
    expected = [p.grad for p in reference.parameters()]
    results = run_distributed(_clip_halves, 2, norm_type)
    for rank, (total, grads) in enumerate(results):
        assert total == pytest.approx(expected_total, rel=FLOAT64_RTOL)
        for got, want in zip(grads, expected[rank::2], strict=True):
            torch.testing.assert_close(torch.tensor(got, dtype=want.dtype), want.flatten(), **FLOAT64_TOLERANCES)


@default_dtype(torch.float64)  # rank 1 (no gradients) reports in the default dtype
def _clip_on_rank_0_only(rank: int, world: int) -> float:
    """Rank 1 holds no parameters (a pipeline stage of activations only): it contributes nothing, and waits."""
    params = list(_model_with_grads().parameters()) if rank == 0 else []
    return float(clip_grad_norm_(params, MAX_NORM))


def test_a_rank_without_parameters_takes_part() -> None:
    expected = float(torch.nn.utils.clip_grad_norm_(_model_with_grads().parameters(), MAX_NORM))
    assert run_distributed(_clip_on_rank_0_only, 2) == pytest.approx([expected, expected], rel=FLOAT64_RTOL)
