"""What the strategies share (issue #14, move 4): registration, ``block_backward_sync``, the DDP wrapper's
``close()``, and the one ``no_sync`` mechanism of the plain layer.

Pure checks run in this process; the ``close()`` and teardown checks wrap a real model on 2 gloo processes.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from lightning.fabric.accelerators import CPUAccelerator as FabricCPUAccelerator
from lightning.fabric.plugins.environments import LightningEnvironment
from lightning.fabric.strategies import STRATEGY_REGISTRY
from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.pytorch.accelerators import CPUAccelerator
from lightning.pytorch.strategies import StrategyRegistry
from torch import nn

import lightning_haiscale
from lightning_haiscale import fabric
from lightning_haiscale.adapter.registry import register_once
from lightning_haiscale.grad_sync import sync_off
from lightning_haiscale.strategies import (
    GPipeStrategy,
    HaiDDPStrategy,
    HaiFSDPStrategy,
    Interleaved1F1BStrategy,
    PipeDreamStrategy,
)
from lightning_haiscale.strategies.parallel import no_sync_of
from tests.distributed import run_distributed

# name -> (class, init_params), as users rely on them (docs/configuring.md)
TRAINER_NAMES = {
    "hai_ddp": (HaiDDPStrategy, {}),
    "hai_ddp_find_unused_parameters_true": (HaiDDPStrategy, {"find_unused_parameters": True}),
    "hai_ddp_spawn": (HaiDDPStrategy, {"start_method": "spawn"}),
    "hai_fsdp": (HaiFSDPStrategy, {}),
    "hai_gpipe": (GPipeStrategy, {}),
    "hai_pipedream": (PipeDreamStrategy, {}),
    "hai_interleaved_1f1b": (Interleaved1F1BStrategy, {}),
}
FABRIC_NAMES = {
    "hai_ddp": (fabric.HaiDDPStrategy, {}),
    "hai_ddp_find_unused_parameters_true": (fabric.HaiDDPStrategy, {"find_unused_parameters": True}),
    "hai_ddp_spawn": (fabric.HaiDDPStrategy, {"start_method": "spawn"}),
    "hai_fsdp": (fabric.HaiFSDPStrategy, {}),
}
MODULES = (
    "lightning_haiscale.strategies.ddp",
    "lightning_haiscale.strategies.fsdp",
    "lightning_haiscale.strategies.pipeline",
    "lightning_haiscale.fabric.ddp",
    "lightning_haiscale.fabric.fsdp",
)


def _entries(registry: _StrategyRegistry, names: dict[str, Any]) -> dict[str, tuple[type, dict[str, Any]]]:
    return {name: (registry[name]["strategy"], registry[name]["init_params"]) for name in names}


@pytest.mark.parametrize(("registry", "names"), [(StrategyRegistry, TRAINER_NAMES), (STRATEGY_REGISTRY, FABRIC_NAMES)])
def test_importing_the_package_registers_every_name(registry: _StrategyRegistry, names: dict[str, Any]) -> None:
    assert lightning_haiscale.__all__  # imported above: that alone registered the names
    assert _entries(registry, names) == names


@pytest.mark.parametrize(
    "cls",
    sorted({c for c, _ in (*TRAINER_NAMES.values(), *FABRIC_NAMES.values())}, key=str),
    ids=lambda cls: f"{cls.__module__.split('.')[1]}.{cls.__name__}",
)
def test_each_class_names_itself_in_register_strategies(cls: type) -> None:
    """Lightning's style: the class's ``register_strategies`` registers exactly its own names (not, inherited
    from Lightning's ``DDPStrategy``, ``"ddp"`` and its variants)."""
    fresh = _StrategyRegistry()
    cls.register_strategies(fresh)
    names = FABRIC_NAMES if cls.__module__.startswith("lightning_haiscale.fabric") else TRAINER_NAMES
    expected = {n: v for n, v in names.items() if v[0] is cls}
    assert _entries(fresh, expected) == expected
    assert set(fresh) == set(expected)


def test_importing_again_registers_nothing_twice() -> None:
    before = {name: dict(StrategyRegistry[name]) for name in TRAINER_NAMES}
    fabric_before = {name: dict(STRATEGY_REGISTRY[name]) for name in FABRIC_NAMES}
    for name in MODULES:  # a second import (a reload runs the module again): Lightning's registry would raise
        importlib.reload(importlib.import_module(name))
    assert {name: dict(StrategyRegistry[name]) for name in TRAINER_NAMES} == before
    assert {name: dict(STRATEGY_REGISTRY[name]) for name in FABRIC_NAMES} == fabric_before
    fresh = _StrategyRegistry()
    register_once(PipeDreamStrategy, fresh)
    register_once(PipeDreamStrategy, fresh)
    assert list(fresh) == ["hai_pipedream"]


class _Synced(nn.Module):
    """A wrapper with ``no_sync()``, recording whether a block is inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.inside = False

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        with sync_off(self, "sync"):
            self.inside = True
            try:
                yield
            finally:
                self.inside = False

    sync = True


def _pipeline_strategy(synced: _Synced) -> PipeDreamStrategy:
    strategy = PipeDreamStrategy()
    strategy._pipeline = synced  # what setup builds
    return strategy


@pytest.mark.parametrize(
    "make",
    [
        lambda synced: _with_model(HaiDDPStrategy(), synced),
        lambda synced: _with_model(HaiFSDPStrategy(), synced),
        _pipeline_strategy,
    ],
    ids=["hai_ddp", "hai_fsdp", "hai_pipedream"],
)
def test_block_backward_sync_enters_the_wrappers_no_sync(make: Any) -> None:
    synced = _Synced()
    strategy = make(synced)
    with strategy.block_backward_sync():
        assert synced.inside and not synced.sync
    assert not synced.inside and synced.sync


def _with_model(strategy: Any, model: nn.Module) -> Any:
    strategy.model = model
    return strategy


def test_block_backward_sync_before_setup_blocks_nothing() -> None:
    for strategy in (_with_model(HaiFSDPStrategy(), nn.Linear(1, 1)), PipeDreamStrategy(), HaiDDPStrategy()):
        with strategy.block_backward_sync():
            pass
    assert isinstance(no_sync_of(None), type(no_sync_of(nn.Linear(1, 1))))


def test_sync_off_nests_and_restores_after_an_error() -> None:
    owner = _Synced()
    with sync_off(owner, "sync"):
        with sync_off(owner, "sync"):
            assert owner.sync is False
        assert owner.sync is False  # the outer block still holds
    assert owner.sync is True
    with pytest.raises(ZeroDivisionError), sync_off(owner, "sync"):
        _ = 1 / 0
    assert owner.sync is True


def _close_and_teardown(rank: int, world: int) -> list[bool]:
    """``close()`` twice, then ``reducer.stop()``; each strategy's teardown closes its wrappers."""
    from lightning_haiscale.ddp import DistributedDataParallel

    seen: list[bool] = []
    model = DistributedDataParallel(nn.Linear(4, 2))
    model(torch.ones(1, 4)).sum().backward()
    with model.no_sync(), model.no_sync():  # the wrapper's no_sync is the reducer's, on sync_off: it nests
        pass
    seen.append(model.require_backward_grad_sync)
    model.close()
    seen.append(model.reducer.stopped)
    model.close()  # idempotent
    model.reducer.stop()  # haiscale's spelling still works after it
    seen.append(model.reducer.stopped)
    haiscale = DistributedDataParallel(nn.Linear(4, 2))
    haiscale.reducer.stop()
    haiscale.close()  # and close() after reducer.stop()
    seen.append(haiscale.reducer.stopped)

    closed: list[DistributedDataParallel] = []
    original = DistributedDataParallel.close

    def recording(self: DistributedDataParallel) -> None:
        closed.append(self)
        original(self)

    DistributedDataParallel.close = recording  # type: ignore[method-assign]
    try:
        trainer_ddp = HaiDDPStrategy(accelerator=CPUAccelerator(), **_placed(world))
        trainer_ddp.model = wrapped = DistributedDataParallel(nn.Linear(4, 2))
        trainer_ddp.teardown()
        seen.append(closed == [wrapped] and wrapped.reducer.stopped)
        fabric_ddp = fabric.HaiDDPStrategy(accelerator=FabricCPUAccelerator(), **_placed(world))
        a, b = fabric_ddp.setup_module(nn.Linear(4, 2)), fabric_ddp.setup_module(nn.Linear(2, 2))
        fabric_ddp.teardown()
        seen.append(closed[1:] == [a, b] and a.reducer.stopped and b.reducer.stopped)
        pipeline = PipeDreamStrategy(accelerator=CPUAccelerator(), **_placed(world))
        stage = DistributedDataParallel(nn.Linear(4, 2))
        pipeline_closed: list[bool] = []
        pipeline._pipeline = type(
            "Pipeline", (), {"stages": [stage, nn.Linear(2, 2)], "close": lambda self: pipeline_closed.append(True)}
        )()
        pipeline.teardown()
        seen.append(closed[3:] == [stage] and stage.reducer.stopped and pipeline_closed == [True])
    finally:
        DistributedDataParallel.close = original  # type: ignore[method-assign]
    return seen


def _placed(world: int) -> dict[str, Any]:
    """What the Trainer or Fabric gives a strategy besides its accelerator."""
    return {"cluster_environment": LightningEnvironment(), "parallel_devices": [torch.device("cpu")] * world}


def test_close_is_idempotent_and_every_teardown_calls_it() -> None:
    for seen in run_distributed(_close_and_teardown, 2):
        assert seen == [True] * 7
