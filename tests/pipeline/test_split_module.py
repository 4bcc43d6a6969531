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
from lightning_haiscale.pipeline.split import call_order, find_blocks, plan_split, trace_module
from lightning_haiscale.pipeline.stand_in import is_stand_in, stand_in
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
    h = [f"transformer.h.{i}" for i in range(8)]
    assert plan.stage_blocks == (tuple(h[:1]), tuple(h[1:5]), tuple(h[5:]))
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
        activations = out if isinstance(out, tuple) else ()
    assert torch.equal(out.loss, expected)
    last = copies[-1]
    assert is_stand_in(last.get_submodule(find_blocks(model).rpartition(".")[0] or "").get_submodule(
        "embed_tokens" if make is llama else "wte"))  # fmt: skip
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


class _MixerBlock(nn.Module):
    """Mamba's block layout: takes and returns ``(hidden, residual)``; the first block also computes a position
    bias once (T5's relative bias), which the others take as a keyword."""

    def __init__(self, first: bool) -> None:
        super().__init__()
        self.norm, self.mix = nn.LayerNorm(8), nn.Linear(8, 8)
        self.bias_table = nn.Parameter(torch.randn(6, 8)) if first else None

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, position_bias: torch.Tensor | None = None):
        residual = hidden if residual is None else hidden + residual
        if position_bias is None:
            position_bias = self.bias_table.tanh()
        return self.mix(self.norm(residual)) + position_bias, residual, position_bias


class _ResidualStreamModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.layers = nn.ModuleList(_MixerBlock(i == 0) for i in range(4))
        self.head = nn.Linear(8, 16)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        hidden, residual, bias = self.embed(idx), None, None
        for layer in self.layers:
            hidden, residual, bias = layer(hidden, residual, position_bias=bias)
        return self.head(hidden + residual)


def _stages_match_the_unsplit_model(model: nn.Module, x: torch.Tensor, stages: int) -> list[nn.Module]:
    """Splits copies of ``model`` into ``stages`` run in turn on ``x``: the loss's gradients must be the unsplit
    model's (float64); returns the copies, each holding one stage."""
    reference = copy.deepcopy(model)
    reference(x).square().mean().backward()
    copies = [copy.deepcopy(model) for _ in range(stages)]
    parts = [partition(copies[r], r, stages, example_inputs=(x,)) for r in range(stages)]
    activations: tuple[torch.Tensor, ...] = ()
    for part in parts:
        out = part(*activations, call=((x,), {}))
        activations = out if isinstance(out, tuple) else ()
    out.square().mean().backward()
    grads = {n: p.grad for c in copies for n, p in c.named_parameters() if p.grad is not None}
    for name, p in reference.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-10, atol=1e-12, msg=name)  # float64
    return copies


@pytest.mark.parametrize("stages", [2, 4])
def test_several_tensors_between_blocks_cross_stages_without_being_named(stages: int) -> None:
    """The residual beside the hidden state and the bias the first block computed reach the next stages (the
    bias's gradient comes back to the first block): loss and gradients as the unsplit model's."""
    torch.manual_seed(0)
    model, x = _ResidualStreamModel().double(), torch.randint(0, 16, (2, 6))
    _stages_match_the_unsplit_model(model, x, stages)


def test_a_stand_in_is_the_module_without_its_compute() -> None:
    """What a model reads of a module another stage holds (attributes, its class, a weight's dtype) works; its
    tensors follow the model's conversion to float64, stay out of parameters and state dict, and its output
    has the real structure."""
    from transformers.models.vit_mae.modeling_vit_mae import ViTMAEEmbeddings

    from tests.strategies.model_families import build

    embeddings = build("vit_mae").vit.embeddings
    holder = nn.Module()
    holder.embeddings = stand_in(embeddings, "vit.embeddings")
    assert isinstance(holder.embeddings, ViTMAEEmbeddings) and is_stand_in(holder.embeddings)
    assert holder.embeddings.patch_embeddings.projection.weight.is_meta
    assert holder.embeddings.config.hidden_size == 16
    assert not list(holder.parameters()) and not holder.state_dict()
    holder.double()
    x, noise = torch.randn(2, 3, 8, 8, dtype=torch.float64), torch.rand(2, 16, dtype=torch.float64)
    hidden, mask, ids_restore = holder.embeddings(x, noise=noise)
    assert holder.embeddings.patch_embeddings.projection.weight.dtype == torch.float64
    assert hidden.shape == (2, 9, 16) and hidden.dtype == torch.float64 and hidden.device.type == "cpu"
    assert mask.shape == (2, 16) and ids_restore.dtype == torch.int64


@pytest.mark.parametrize("stages", [2, 4])
def test_parameters_beside_the_blocks_go_to_the_stage_using_them(stages: int) -> None:
    """timm's ``VisionTransformer`` holds ``cls_token`` and ``pos_embed`` beside its blocks: the first stage,
    whose code uses them, holds them; the others keep a zero buffer of their name, in no state dict."""
    from tests.strategies.model_families import TimmStyleViT

    torch.manual_seed(0)
    model, x = TimmStyleViT().double(), torch.randn(2, 3, 8, 8, dtype=torch.float64)
    copies = _stages_match_the_unsplit_model(model, x, stages)
    assert {"cls_token", "pos_embed"} <= set(copies[0].state_dict())
    assert not {"cls_token", "pos_embed"} & {n for c in copies[1:] for n in c.state_dict()}
    assert copies[-1].cls_token.shape == (1, 1, 16) and "cls_token" in dict(copies[-1].named_buffers())
    held = {n for c in copies for n in c.state_dict()}
    assert held == set(model.state_dict())


class _SharedBetweenBlocks(nn.Module):
    """A projection with parameters called between the blocks (no stage could hold it)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(4))
        self.mix = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, block in enumerate(self.blocks):
            x = block(x) if i != 2 else self.mix(block(x))
        return x


def test_a_module_with_parameters_between_the_blocks_is_refused_at_setup() -> None:
    with pytest.raises(
        ValueError, match=r"_SharedBetweenBlocks: \['mix'\] run between the blocks of 'blocks'.*hai_ddp"
    ):
        partition(_SharedBetweenBlocks(), 0, 2, example_inputs=(torch.zeros(1, 4),))


def test_an_encoder_decoders_block_lists_are_cut_as_one_sequence() -> None:
    """T5 runs its encoder's blocks, then its decoder's: one sequence of stages, the encoder's final norm and
    the decoder's embedding on the stage that runs them (between the two lists)."""
    from tests.strategies.model_families import MODELS
    from tests.strategies.model_families import build as build_family

    model = build_family("t5").double()
    rows = MODELS["t5"][1](2)
    trace = trace_module(model, "decoder.block", (), {k: torch.stack([r[k] for r in rows]) for k in rows[0]})
    assert trace.lists == ["encoder.block", "decoder.block"]
    plan = plan_split(model, 4, trace=trace, balance=[2, 1, 1, 2])
    assert plan.stage_blocks[0] == ("encoder.block.0", "encoder.block.1") and plan.stage_blocks[1] == (
        "decoder.block.0",)  # fmt: skip
    assert dict(plan.placed) == {"encoder.final_layer_norm": 0, "decoder.embed_tokens": 0}
    assert plan.first == ("encoder.embed_tokens",) and plan.last == ("shared", "decoder.final_layer_norm", "lm_head")


@pytest.mark.parametrize("name", ["t5", "bart"])
@pytest.mark.parametrize("cut", ["balanced", "encoder", "decoder"])
def test_an_encoder_decoder_model_is_cut_anywhere_in_its_sequence(name: str, cut: str) -> None:
    """Balanced over both lists, or at a split point in the encoder or in the decoder: chained stages (2 and 4,
    and 2 ranks of 2 chunks) give the model's loss."""
    from tests.strategies.model_families import MODELS
    from tests.strategies.model_families import build as build_family

    model = build_family(name).double()
    rows = MODELS[name][1](2)
    call = {k: torch.stack([r[k] for r in rows]) for k in rows[0]}
    expected = model(**call).loss
    lists = {"t5": ("encoder.block", "decoder.block"), "bart": ("model.encoder.layers", "model.decoder.layers")}
    points = {"balanced": None, "encoder": [f"{lists[name][0]}.1"], "decoder": [f"{lists[name][1]}.2"]}[cut]
    for ranks, chunks in [(2, 1), (2, 2), (4, 1)] if points is None else [(2, 1)]:
        copies = [copy.deepcopy(model) for _ in range(ranks)]
        parts = {}
        for r, c in enumerate(copies):
            got = partition(c, r, ranks, num_model_chunks=chunks, split_points=points, example_kwargs=call)
            parts.update({r + i * ranks: p for i, p in enumerate(got if isinstance(got, list) else [got])})
        activations: tuple[torch.Tensor, ...] = ()
        for s in range(ranks * chunks):
            out = parts[s](*activations, call=((), call))
            activations = out if isinstance(out, tuple) else ()
        assert torch.equal(out.loss, expected), (ranks, chunks)


def test_a_masked_autoencoders_decoder_blocks_continue_the_sequence() -> None:
    """ViTMAE runs its encoder's blocks, then its decoder's (beside which the decoder holds ``mask_token``):
    both lists are cut as one sequence, the mask token held by the stage that runs the decoder's start."""
    from tests.strategies.model_families import MODELS
    from tests.strategies.model_families import build as build_family

    model = build_family("vit_mae").double()
    with torch.no_grad():
        model.decoder.mask_token.normal_()  # zeros as built: a zero stand-in would pass unseen
    rows = MODELS["vit_mae"][1](2)
    call = {k: torch.stack([r[k] for r in rows]) for k in rows[0]}
    expected = model(**call).loss
    trace = trace_module(model, "vit.layers", (), call)
    assert trace.lists == ["vit.layers", "decoder.decoder_layers"]
    plan = plan_split(model, 3, trace=trace, balance=[2, 3, 1])
    assert dict(plan.placed_params) == {"decoder.mask_token": 1, "decoder.decoder_pos_embed": 1}
    assert dict(plan.placed) == {"vit.layernorm": 1, "decoder.decoder_embed": 1}
    copies = [copy.deepcopy(model) for _ in range(3)]
    parts = [partition(c, r, 3, balance=[2, 3, 1], example_kwargs=call) for r, c in enumerate(copies)]
    activations: tuple[torch.Tensor, ...] = ()
    for part in parts:
        out = part(*activations, call=((), call))
        activations = out if isinstance(out, tuple) else ()
    assert torch.equal(out.loss, expected)
    assert "decoder.mask_token" in copies[1].state_dict() and "decoder.mask_token" not in copies[2].state_dict()


class _ReadsValues(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x) * float(self.proj.weight.detach().abs().max())  # reads a value: impossible on meta


def test_a_stand_in_that_cannot_run_on_meta_names_the_module_and_the_fix() -> None:
    stand = stand_in(_ReadsValues(), "model.embed")
    with pytest.raises(RuntimeError, match=r"model.embed \(_ReadsValues\) is held by another pipeline stage.*hai_ddp"):
        stand(torch.zeros(2, 4))
