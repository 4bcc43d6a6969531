import functools

import pytest
import torch
from torch import nn
from torch.distributed.fsdp.wrap import ModuleWrapPolicy, size_based_auto_wrap_policy, transformer_auto_wrap_policy

from examples.gpt.model import GPT, MLP, Block, Embeddings, LMHead, config
from lightning_haiscale.fsdp import BackwardPrefetch, FullyShardedDataParallel
from lightning_haiscale.fsdp.wrap import assign_params, unit_modules, unit_scopes


def _gpt() -> GPT:
    return GPT(config("tiny", n_layer=2))


def test_set_of_classes_and_module_wrap_policy_agree() -> None:
    model = _gpt()
    by_set = unit_modules(model, {Block, MLP})
    by_policy = unit_modules(model, ModuleWrapPolicy({Block, MLP}))
    assert by_set == by_policy
    assert by_set == [model, model[1], model[1].mlp, model[2], model[2].mlp]  # root, then pre-order


def test_transformer_and_size_policies() -> None:
    model = _gpt()
    transformer = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})
    assert unit_modules(model, transformer) == [model, model[1], model[2]]
    size = functools.partial(size_based_auto_wrap_policy, min_num_params=150_000)
    units = unit_modules(model, size)
    assert units == [model, model[1], model[2]]  # a block has ~198k parameters, its MLP ~131k, embeddings ~66k
    assert unit_modules(model, None) == [model]


def test_tied_weight_belongs_to_the_common_unit() -> None:
    model = _gpt()
    units = unit_modules(model, {Block, Embeddings, LMHead})
    owned = assign_params(model, units)
    root_names = [ref.fqns for ref in owned[model]]
    assert root_names == [["0.wte.weight", "3.lm_head.weight"]]
    assert [ref.fqns for ref in owned[model[0]]] == [["0.wpe.weight"]]
    assert owned[model[3]][0].fqns == ["3.ln_f.weight"]
    scopes = unit_scopes(model, units)
    assert model[1].attn in scopes[model[1]] and model[1] not in scopes[model]


def test_bad_arguments_fail_before_any_collective() -> None:
    with pytest.raises(TypeError, match="backward_prefetch"):
        FullyShardedDataParallel(nn.Linear(2, 2), backward_prefetch="pre")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="auto_wrap_policy"):
        unit_modules(nn.Linear(2, 2), {"Block"})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="not already wrapped"):
        FullyShardedDataParallel(torch.zeros(2))  # type: ignore[arg-type]
    assert BackwardPrefetch.BACKWARD_POST is not BackwardPrefetch.BACKWARD_PRE
