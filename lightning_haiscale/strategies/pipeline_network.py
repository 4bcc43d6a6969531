"""Finding the network a LightningModule trains and cutting it into this rank's stages (the stage surgery).

[Note: two kinds of network] A module's one ``nn.Sequential`` attribute (or ``module_name=`` naming one) is
cut between its layers, and a ``StageProxy`` of this rank's layers takes its place (the fastest path: the
stages call the layers in turn). Any other network (a ``GPT2LMHeadModel``, a litgpt ``GPT``) is cut between
the blocks of its largest block list, or at ``split_points`` (named from the LightningModule, as
``"model.transformer.h.6"``), into ``ModuleStage``\\ s that run its own forward (see ``pipeline.split``); the
attribute stays the user's object, and only its ``forward`` is shadowed by a ``ForwardStandIn`` in step code.
Which of its modules run before the blocks is traced once on the first training batch when fitting.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import CombinedLoader
from torch import nn

from lightning_haiscale.pipeline import partition
from lightning_haiscale.pipeline.module_stage import split_module
from lightning_haiscale.pipeline.pipelines import split_batch
from lightning_haiscale.pipeline.split import find_blocks, plan_split, trace_module
from lightning_haiscale.strategies.pipeline_step import ForwardStandIn, StageProxy, capture_inputs, shadowed

__all__ = ["Network", "find_network", "split_network"]


@dataclass
class Network:
    """The split network: its attribute, this rank's stage modules, and what stands in for it in step code."""

    name: str
    stages: list[nn.Module]
    proxy: StageProxy | ForwardStandIn
    shadows: contextlib.ExitStack


def find_network(module: pl.LightningModule, module_name: str | None, split_points: Sequence[str] | None) -> str:
    """The attribute holding the network: ``module_name``, the split points' first name, the one Sequential,
    or the attribute holding the largest block list."""
    if split_points:
        names = {point.split(".")[0] for point in split_points}
        if len(names) != 1 or (module_name is not None and names != {module_name}):
            raise ValueError(f"split_points={list(split_points)} must name blocks of one attribute, e.g. 'model.h.2'")
        return names.pop()
    if module_name is not None:
        return module_name
    sequentials = [n for n, child in module.named_children() if isinstance(child, nn.Sequential)]
    if len(sequentials) == 1:
        return sequentials[0]
    if len(sequentials) > 1:
        raise ValueError(
            f"{type(module).__name__} has {len(sequentials)} nn.Sequential attributes ({sequentials}); name the "
            "network with module_name= or its cuts with split_points="
        )
    return find_blocks(module).split(".")[0]


def split_network(
    strategy: Any, name: str, split_points: Sequence[str] | None, example_inputs: tuple[Any, ...] | None
) -> Network:
    """Cuts ``strategy.lightning_module.<name>`` into this rank's stages (every rank computes every cut)."""
    module = strategy.lightning_module
    network = getattr(module, name)
    ranks, rank, chunks = strategy.stages_per_pipeline, strategy.pp_rank, strategy.num_model_chunks
    if isinstance(network, nn.Sequential) and not split_points:
        parts = partition(
            network, rank, ranks, strategy.balance, chunks, example_inputs=example_inputs,
            process_group=strategy.pp_group,
        )  # fmt: skip
        stages = parts if isinstance(parts, list) else [parts]
        proxy = StageProxy(OrderedDict(item for stage in stages for item in stage._modules.items()))
        setattr(module, name, proxy)
        return Network(name, stages, proxy, contextlib.ExitStack())
    if strategy.balance == "time":
        raise ValueError(f"balance='time' times the layers of an nn.Sequential; {name} is split at its blocks: "
                         "pass balance=[blocks per stage] or split_points=")  # fmt: skip
    points = [p.partition(".")[2] for p in split_points] if split_points else None
    blocks = points[0].rpartition(".")[0] if points else find_blocks(network)
    call = _first_call(strategy, network)
    trace = None
    if call is not None:
        with strategy.precision_plugin.train_step_context():  # as the model runs in training (autocast)
            trace = trace_module(network, blocks, *call)
    plan = plan_split(network, ranks * chunks, blocks=blocks, split_points=points, balance=strategy.balance,
                      trace=trace)  # fmt: skip
    stages = split_module(network, plan, list(range(rank, ranks * chunks, ranks)))
    proxy, shadows = ForwardStandIn(), contextlib.ExitStack()
    shadows.enter_context(shadowed(network, "forward", proxy))
    return Network(name, list(stages), proxy, shadows)


def _first_call(strategy: Any, network: nn.Module) -> tuple[tuple, dict] | None:
    """The network's call in ``training_step`` on the first microbatch of the first training batch, the same
    on every rank; ``None`` when not fitting (the order of registration decides then)."""
    trainer = strategy.lightning_module.trainer
    batch = _first_training_batch(trainer) if trainer.state.fn == TrainerFn.FITTING else None
    if batch is None:
        return None
    batch = split_batch(batch, strategy.chunks, even=False)[0]  # on the CPU, as the network still is
    return _call_in_training_step(strategy.lightning_module, network, batch)


def first_batch_inputs(strategy: Any, name: str, network: nn.Sequential) -> tuple[Any, ...]:
    """``balance="time"`` without ``example_inputs``: the network's inputs for the first training batch,
    found by running ``training_step`` up to the network call (as every step is captured)."""
    trainer = strategy.lightning_module.trainer
    if trainer.state.fn != TrainerFn.FITTING:
        raise ValueError(
            f"balance='time' profiles the layers on the first training batch; to {trainer.state.fn} a module "
            "never partitioned by this strategy, pass example_inputs=(a batch's network inputs,)"
        )
    batch = _first_training_batch(trainer)
    if batch is None:
        raise ValueError("balance='time' needs example_inputs=(a batch's network inputs,) or a training dataloader")
    call = _call_in_training_step(strategy.lightning_module, network, batch)
    if call is None:
        raise RuntimeError(f"training_step never called the network {name!r}, so balance='time' has nothing to time")
    return call[0]


def _first_training_batch(trainer: pl.Trainer) -> Any | None:
    """The first training batch (``None`` without a training dataloader); the fit loop reuses the dataloader,
    so it is requested once."""
    trainer.fit_loop.setup_data()
    if trainer.train_dataloader is None:
        return None
    return next(iter(CombinedLoader(trainer.train_dataloader, "max_size_cycle")))[0]


def _call_in_training_step(module: pl.LightningModule, network: nn.Module, batch: Any) -> tuple[tuple, dict] | None:
    """``network``'s inputs in ``module.training_step(batch, 0)``, run up to that call; ``None``: no call."""
    stand_in = ForwardStandIn()
    with shadowed(network, "forward", stand_in):
        return capture_inputs(module, stand_in, module.training_step, (batch, 0), {})
