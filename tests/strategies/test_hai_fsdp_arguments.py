"""``HaiFSDPStrategy`` (Trainer and Fabric) takes what Lightning's ``FSDPStrategy`` takes: the signature, the calls
Lightning's FSDP guides write (built unchanged with ``HaiFSDPStrategy`` in ``FSDPStrategy``'s place), and each
keyword honoured or refused at construction with its reason; one process fits what only a fit shows.
"""

from __future__ import annotations

import inspect
import sys
import warnings
from functools import partial
from typing import Any

import lightning as L
import pytest
import torch
from lightning.fabric import Fabric
from lightning.fabric.strategies import FSDPStrategy as FabricFSDPStrategy
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.strategies import FSDPStrategy as TrainerFSDPStrategy
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointWrapper,
    apply_activation_checkpointing,
)
from torch.distributed.fsdp import BackwardPrefetch as TorchBackwardPrefetch
from torch.distributed.fsdp import CPUOffload, ShardingStrategy
from torch.distributed.fsdp import MixedPrecision as TorchMixedPrecision
from torch.distributed.fsdp.wrap import ModuleWrapPolicy, size_based_auto_wrap_policy

import lightning_haiscale
from lightning_haiscale import fabric
from lightning_haiscale.fsdp import BackwardPrefetch, MixedPrecision
from lightning_haiscale.strategies import HaiFSDPStrategy
from lightning_haiscale.testing.parity import BATCH, Classifier, data
from tests.distributed import run_distributed
from tests.strategies.helpers import quiet_fit
from tests.strategies.test_cli import _Data, _Model

OURS = ("backward_prefetch", "reshard_after_forward", "param_init_fn")
HONOURED = ("limit_all_gathers", "forward_prefetch", "use_orig_params", "sync_module_states", "ignored_modules")
CLASSES = [
    (HaiFSDPStrategy, TrainerFSDPStrategy, OURS),
    (fabric.HaiFSDPStrategy, FabricFSDPStrategy, (*OURS, "checkpoint_io")),  # as Fabric's DDPStrategy
]
BOTH = pytest.mark.parametrize("cls", [HaiFSDPStrategy, fabric.HaiFSDPStrategy], ids=["trainer", "fabric"])


@pytest.mark.parametrize(("ours", "lightnings", "own"), CLASSES, ids=["trainer", "fabric"])
def test_signature_is_lightnings_after_our_own(ours: type, lightnings: type, own: tuple[str, ...]) -> None:
    """Every parameter of Lightning 2.6's ``FSDPStrategy.__init__``, in its order and kind, after ours; torch FSDP's
    keywords we honour are named (keyword-only, before ``**kwargs``), so that LightningCLI shows them."""
    theirs = list(inspect.signature(lightnings.__init__).parameters.values())[1:]
    mine = list(inspect.signature(ours.__init__).parameters.values())[1:]
    assert [p.name for p in mine[: len(own)]] == list(own)
    named = [p for p in mine if p.kind is inspect.Parameter.KEYWORD_ONLY]  # torch's **kwargs we honour, by name
    assert [p.name for p in named] == list(HONOURED) and all(p.default is None for p in named)
    rest = [(p.name, p.kind) for p in mine[len(own) :] if p not in named]
    assert rest == [(p.name, p.kind) for p in theirs]
    for p in theirs:  # the same defaults, but the Fabric checkpoint format (see the class docstring)
        if p.name != "state_dict_type":
            assert mine[[q.name for q in mine].index(p.name)].default == p.default, p.name


def _documented_calls(policy: set[type[nn.Module]]) -> list[dict[str, Any]]:
    """Every ``FSDPStrategy(...)`` call of Lightning's FSDP guides (Trainer and Fabric,
    docs/source-*/advanced/model_parallel/fsdp.rst), litgpt's pretrain.py / finetune/full.py ones, and issue 24's."""
    return [
        {},
        {"auto_wrap_policy": policy},
        {"auto_wrap_policy": partial(size_based_auto_wrap_policy, min_num_params=10000)},
        {"sharding_strategy": "FULL_SHARD"},
        {"sharding_strategy": "SHARD_GRAD_OP"},
        {"sharding_strategy": "NO_SHARD"},
        {"activation_checkpointing_policy": policy},
        {"cpu_offload": True},
        {"state_dict_type": "full"},
        {"state_dict_type": "sharded"},
        {"limit_all_gathers": False},
        {"limit_all_gathers": True},
        {"sharding_strategy": "HYBRID_SHARD"},  # Fabric's guide
        {"auto_wrap_policy": policy, "state_dict_type": "full", "sharding_strategy": "FULL_SHARD"},  # litgpt, 1 node
        {"auto_wrap_policy": policy, "state_dict_type": "full", "sharding_strategy": "HYBRID_SHARD"},  # litgpt, nodes
        {
            "auto_wrap_policy": policy,
            "activation_checkpointing_policy": policy,
            "sharding_strategy": "HYBRID_SHARD",
            "cpu_offload": True,
            "mixed_precision": TorchMixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
            "state_dict_type": "sharded",
            "device_mesh": (2, 4),
        },  # issue 24's example
        {
            "auto_wrap_policy": policy,
            "activation_checkpointing_policy": policy,
            "state_dict_type": "full",
            "limit_all_gathers": True,
            "cpu_offload": False,
        },  # litgpt finetune/full.py
    ]


@BOTH
def test_documented_calls_build(cls: type) -> None:
    policy = {nn.TransformerEncoderLayer, nn.TransformerDecoderLayer}
    for call in _documented_calls(policy):
        strategy = cls(**call)
        assert strategy.state_dict_type == call.get("state_dict_type", "full")
        assert strategy.sharding_strategy == ShardingStrategy[call.get("sharding_strategy", "FULL_SHARD")]


@BOTH
def test_hybrid_keywords(cls: type) -> None:
    for value in ("HYBRID_SHARD", "_hybrid_shard_zero2", ShardingStrategy.HYBRID_SHARD):
        assert "HYBRID" in cls(sharding_strategy=value).sharding_strategy.name
    assert cls(sharding_strategy="HYBRID_SHARD", device_mesh=[2, 4])._fsdp_options.wrapper["device_mesh"] == (2, 4)
    with pytest.raises(ValueError, match=r"device_mesh=\(2, 4\) describes hybrid sharding .* sharding_strategy='FULL"):
        cls(device_mesh=(2, 4))
    for bad in ((2,), (2, 0), (2, True), "2x4"):
        with pytest.raises(TypeError, match=r"must be a \(replicate, shard\) tuple of two positive ints or a 2-D"):
            cls(sharding_strategy="HYBRID_SHARD", device_mesh=bad)


@BOTH
def test_lightnings_public_attributes(cls: type) -> None:
    """What Lightning's FSDP tests read: torch's objects (``tests_pytorch/strategies/test_fsdp.py``:
    ``strategy.sharding_strategy == ShardingStrategy.X``, ``strategy.cpu_offload.offload_params``,
    ``strategy.mixed_precision_config``)."""
    plain = cls()
    assert plain.sharding_strategy == ShardingStrategy.FULL_SHARD
    assert isinstance(plain.cpu_offload, CPUOffload) and not plain.cpu_offload.offload_params
    assert cls(cpu_offload=True).cpu_offload.offload_params
    mixed = TorchMixedPrecision(param_dtype=torch.float16, reduce_dtype=torch.float32)
    config = cls(mixed_precision=mixed).mixed_precision_config
    assert isinstance(config, TorchMixedPrecision)
    assert (config.param_dtype, config.reduce_dtype) == (torch.float16, torch.float32)
    # test_custom_mixed_precision: the user's object comes back equal (was: cast_forward_inputs True != False)
    assert cls(mixed_precision=TorchMixedPrecision()).mixed_precision_config == TorchMixedPrecision()


@BOTH
def test_sharding_strategy_spellings(cls: type) -> None:
    # torch's enum, as Lightning's FSDPStrategy exposes it (a string compared with the enum was silently unequal)
    assert cls(sharding_strategy=ShardingStrategy.SHARD_GRAD_OP).sharding_strategy == ShardingStrategy.SHARD_GRAD_OP
    assert cls(sharding_strategy="no_shard").sharding_strategy == ShardingStrategy.NO_SHARD
    with pytest.raises(ValueError, match="sharding_strategy='ZERO3' must be one of 'FULL_SHARD', 'SHARD_GRAD_OP'"):
        cls(sharding_strategy="ZERO3")
    with pytest.raises(TypeError, match="sharding_strategy=3"):
        cls(sharding_strategy=3)


@BOTH
def test_torch_fsdp_kwargs_honoured_or_refused(cls: type) -> None:
    honoured = {"limit_all_gathers": True, "forward_prefetch": True, "use_orig_params": True}
    strategy = cls(sync_module_states=True, ignored_modules=[nn.Linear(1, 1)], **honoured)
    assert strategy._fsdp_options.wrapper.items() >= honoured.items()
    assert strategy._fsdp_options.wrapper["sync_module_states"] is True
    refused = [("process_group", "Trainer's world"), ("device_id", "own device"), ("ignored_states", "ignored_modules")]
    for name, reason in refused:
        with pytest.raises(ValueError, match=rf"HaiFSDPStrategy\({name}=\.\.\.\) is not supported: .*{reason}"):
            cls(**{name: None})
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'bucket_cap_mb'.*FSDPStrategy"):
        cls(bucket_cap_mb=25)
    with pytest.raises(TypeError, match="limit_all_gathers='yes'"):
        cls(limit_all_gathers="yes")
    with pytest.raises(TypeError, match="ignored_modules"):
        cls(ignored_modules=["lm_head"])


@BOTH
def test_torch_enums_and_policies(cls: type) -> None:
    strategy = cls(backward_prefetch=TorchBackwardPrefetch.BACKWARD_POST)
    assert strategy._fsdp_options.wrapper["backward_prefetch"] is BackwardPrefetch.BACKWARD_POST
    assert cls(backward_prefetch=None)._fsdp_options.wrapper["backward_prefetch"] is None
    assert cls(cpu_offload=CPUOffload(offload_params=True))._fsdp_options.cpu_offload
    assert not cls(cpu_offload=CPUOffload(offload_params=False))._fsdp_options.cpu_offload
    with pytest.raises(TypeError, match="cpu_offload='all'"):
        cls(cpu_offload="all")
    policy = ModuleWrapPolicy({nn.Linear})
    assert cls(activation_checkpointing_policy=policy)._fsdp_options.activation_checkpointing is policy
    with pytest.raises(TypeError, match="activation_checkpointing_policy must be"):
        cls(activation_checkpointing_policy={"Block"})


@BOTH
def test_mixed_precision(cls: type) -> None:
    torch_mp = TorchMixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    assert cls(mixed_precision=torch_mp)._fsdp_options.mixed_precision == MixedPrecision(
        param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cast_forward_inputs=True
    )
    ours = MixedPrecision(param_dtype=torch.float16)
    assert cls(mixed_precision=ours)._fsdp_options.mixed_precision is ours
    with pytest.raises(ValueError, match="keep_low_precision_grads=True"):
        cls(mixed_precision=TorchMixedPrecision(param_dtype=torch.bfloat16, keep_low_precision_grads=True))
    with pytest.raises(TypeError, match="mixed_precision='bf16'"):
        cls(mixed_precision="bf16")


@BOTH
def test_activation_checkpointing_spellings(cls: type) -> None:
    with pytest.deprecated_call(match="activation_checkpointing_policy="):
        strategy = cls(activation_checkpointing=nn.Linear)
    assert strategy._fsdp_options.activation_checkpointing == {nn.Linear}
    with pytest.deprecated_call():
        assert cls(activation_checkpointing=[nn.Linear, nn.ReLU])._fsdp_options.activation_checkpointing == {
            nn.Linear,
            nn.ReLU,
        }
    with pytest.raises(ValueError, match="cannot set both"):
        cls(activation_checkpointing=nn.Linear, activation_checkpointing_policy={nn.Linear})


def test_trainer_and_fabric_classes_name_each_other() -> None:
    """Each layer's class given to the other layer: Lightning's error names the class to use instead."""
    pairs = [
        (lightning_haiscale.HaiFSDPStrategy(), "lightning_haiscale.fabric.HaiFSDPStrategy"),
        (lightning_haiscale.HaiDDPStrategy(), "lightning_haiscale.fabric.HaiDDPStrategy"),
    ]
    for strategy, right in pairs:
        with pytest.raises(ValueError, match=rf"invalid strategy.*Fabric takes {right}"):
            Fabric(accelerator="cpu", strategy=strategy)
    for strategy, right in [(fabric.HaiFSDPStrategy(), "HaiFSDPStrategy"), (fabric.HaiDDPStrategy(), "HaiDDPStrategy")]:
        with pytest.raises(ValueError, match=rf"invalid strategy.*the Trainer takes lightning_haiscale.{right}"):
            L.Trainer(accelerator="cpu", strategy=strategy)


class _Checkpointed(Classifier):
    """The pipeline tests' classifier with its layers checkpointed by hand."""

    def configure_model(self) -> None:
        apply_activation_checkpointing(self.net, check_fn=lambda m: isinstance(m, nn.Linear))


def _fits(rank: int, world: int) -> None:
    """What only a fit shows: the CPU's word on cpu_offload, torch's MixedPrecision over the Trainer's precision
    (and under Fabric), each documented call training, checkpointing configured on a model already checkpointed by
    hand."""
    rows = data(BATCH * world)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        quiet_fit(Classifier(), HaiFSDPStrategy(cpu_offload=True), 1, rows, BATCH)
    said = [w for w in seen if "cpu_offload=True) has no effect on CPU" in str(w.message)]
    assert len(said) == 1, [str(w.message) for w in seen]

    policy = TorchMixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    trainer = quiet_fit(Classifier(), HaiFSDPStrategy(mixed_precision=policy), 1, rows, BATCH, precision="32-true")
    wrapper = trainer.strategy.model
    assert wrapper.mixed_precision == MixedPrecision(torch.bfloat16, torch.float32, cast_forward_inputs=True)
    runner = Fabric(accelerator="cpu", devices=world, strategy=fabric.HaiFSDPStrategy(mixed_precision=policy))
    runner.launch()
    assert runner.strategy.setup_module(nn.Linear(4, 4)).mixed_precision.param_dtype == torch.bfloat16

    for call in _documented_calls({nn.Sequential}):  # each documented call trains (a mesh of 8 needs 8 ranks)
        if "device_mesh" in call:
            continue
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "HaiFSDPStrategy.cpu_offload=True. has no effect on CPU")
            trainer = quiet_fit(Classifier(), HaiFSDPStrategy(**call), 1, rows, BATCH)
        assert trainer.global_step == 1, call

    module = _Checkpointed()
    # Lightning's words (tests_fabric test_fsdp_integration.py::test_manual_activation_checkpointing)
    with pytest.warns(UserWarning, match="is configured, but the model already contains checkpointed"):
        quiet_fit(module, HaiFSDPStrategy(activation_checkpointing_policy={nn.Linear}), 1, rows, BATCH)
    wrappers = [m for m in module.modules() if isinstance(m, CheckpointWrapper)]  # once each, not twice
    assert len(wrappers) == sum(isinstance(m, nn.Linear) for m in module.modules()) == 8


def test_options_in_a_fit() -> None:
    run_distributed(_fits, 1, timeout=180)


def test_lightning_cli_parses_the_keywords(monkeypatch: pytest.MonkeyPatch) -> None:
    """On the command line, as a user moving from ``--trainer.strategy=FSDPStrategy`` writes them."""
    monkeypatch.setattr(sys, "argv", ["train.py"])
    args = ["--trainer.accelerator=cpu", "--trainer.logger=false"]
    args += ["--trainer.strategy=lightning_haiscale.HaiFSDPStrategy"]
    given = ("sharding_strategy=SHARD_GRAD_OP", "cpu_offload=true", "limit_all_gathers=false")
    args += [f"--trainer.strategy.{k}" for k in (*given, "activation_checkpointing_policy=[torch.nn.Linear]")]
    strategy = LightningCLI(_Model, _Data, args=args, run=False, save_config_callback=None).trainer.strategy
    options = strategy._fsdp_options
    assert strategy.sharding_strategy == ShardingStrategy.SHARD_GRAD_OP and options.cpu_offload
    assert strategy.cpu_offload == CPUOffload(offload_params=True)
    assert list(options.activation_checkpointing) == [nn.Linear] and options.wrapper["limit_all_gathers"] is False
