"""Cutting modules that are not a Sequential (``pipeline.split``, ``pipeline.module_stage``), without processes.

Stages are built from copies of one model (each rank builds the whole model and keeps its part); chained by
hand, they must give the unsplit model's loss exactly, and a one-rank pipeline of a split module must give
its gradients.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from lightning_haiscale.pipeline import PipeDream, partition
from lightning_haiscale.pipeline.module_stage import Elsewhere
from lightning_haiscale.pipeline.split import call_order, find_blocks, plan_split
from tests.strategies.real_models import LitGPTStyle, build, gpt2, llama, tokens


def test_find_blocks_finds_each_models_block_list() -> None:
    assert find_blocks(build(gpt2)) == "transformer.h"
    assert find_blocks(build(llama)) == "model.layers"
    assert find_blocks(build(LitGPTStyle)) == "transformer.h"
    with pytest.raises(ValueError, match=r"no ModuleList or Sequential of two or more blocks.*split_points="):
        find_blocks(nn.Linear(2, 2))


def test_split_points_name_where_stages_begin() -> None:
    model = build(gpt2)
    plan = plan_split(model, 3, split_points=["transformer.h.1", "transformer.h.5"])
    assert plan.stage_blocks == (("0",), ("1", "2", "3", "4"), ("5", "6", "7"))
    assert plan.first == ("transformer.wte", "transformer.wpe") and plan.last == ("transformer.ln_f", "lm_head")
    (tie,) = plan.ties(model)
    assert tie.stages == (0, 2) and tie.names == ("transformer.wte.weight", "lm_head.weight")
    for points, message in [
        (["transformer.h.1"], r"must name 2 blocks"),
        (["transformer.h.1", "lm_head.2"], r"must all be blocks of one ModuleList"),
        (["transformer.h.1", "transformer.h.9"], r"'transformer.h.9' is not a block of 'transformer.h'"),
        (["transformer.h.5", "transformer.h.1"], r"must be increasing blocks after the first"),
    ]:
        with pytest.raises(ValueError, match=message):
            plan_split(model, 3, split_points=points)


def test_a_traced_call_places_a_head_registered_before_the_blocks_on_the_last_stage() -> None:
    model = build(LitGPTStyle)  # lm_head is registered first, as in litgpt, but runs last
    assert plan_split(model, 2).first == ("lm_head", "transformer.wte")  # by registration: wrong
    before = call_order(model, "transformer.h", (tokens()[:2],), {})
    assert before == {"transformer.wte"}
    plan = plan_split(model, 2, before=before)
    assert plan.first == ("transformer.wte",) and plan.last == ("lm_head", "transformer.ln_f")


@pytest.mark.parametrize("make", [gpt2, llama])
@pytest.mark.parametrize("stages", [2, 4])
def test_chained_stages_give_the_models_loss(make: object, stages: int) -> None:
    model, x = build(make), tokens()[:2]
    expected = model(input_ids=x, labels=x).loss
    copies = [copy.deepcopy(model) for _ in range(stages)]
    parts = [partition(copies[r], r, stages) for r in range(stages)]
    activations: tuple[torch.Tensor, ...] = ()
    for part in parts:
        out = part(*activations, call=((), {"input_ids": x, "labels": x}))
        activations = (out,) if torch.is_tensor(out) else ()
    assert torch.equal(out.loss, expected)
    last = copies[-1]
    assert isinstance(last.get_submodule(find_blocks(model).rpartition(".")[0] or "").get_submodule(
        "embed_tokens" if make is llama else "wte"), Elsewhere)  # fmt: skip
    held = {n for c in copies for n in c.state_dict()}
    assert held == set(model.state_dict())  # every entry held by some stage, under the model's own name


def test_a_one_rank_pipeline_of_a_split_module_takes_keyword_inputs() -> None:
    model, x = build(gpt2), tokens()[:4]
    reference = copy.deepcopy(model)
    reference(input_ids=x, labels=x).loss.backward()
    pipe = PipeDream(partition(model, 0, 1), chunks=2)
    losses, _ = pipe.forward_backward(kwargs={"input_ids": x, "labels": x}, criterion=lambda out: out.loss / 2)
    assert losses.shape == (2,)
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-12, msg=name)  # float64
    with pytest.raises(TypeError, match=r"keyword inputs .* need a split module.s stages"):
        PipeDream(partition(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), 0, 1), 1).forward_backward(
            kwargs={"x": torch.zeros(1, 2)}, criterion=lambda out: out.sum()
        )
