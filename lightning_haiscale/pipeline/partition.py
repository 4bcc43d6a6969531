"""Cutting a network (an ``nn.Sequential``, or any module: see ``pipeline.split``) into pipeline stages, and
the process groups of DP x PP."""

from __future__ import annotations

import logging
import numbers
import time
from collections import OrderedDict
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_haiscale.hfreduce import kept_collectives
from lightning_haiscale.pipeline.balance import balanced_counts
from lightning_haiscale.pipeline.module_stage import split_module
from lightning_haiscale.pipeline.split import find_blocks, plan_split, trace_module
from lightning_haiscale.pipeline.ties import Tie, find_ties
from lightning_haiscale.pipeline.trace import Trace
from lightning_haiscale.rank_layout import RankLayout

__all__ = ["SequentialModel", "make_subgroups", "partition", "stage_layer_counts"]

log = logging.getLogger(__name__)


class SequentialModel(nn.Sequential):
    """An ``nn.Sequential`` whose layers may pass a tuple of tensors: a tuple is unpacked into the next layer.

    Stages keep the layer names of the original sequence (``"3"``, ``"4"``, ...), so a stage's
    ``state_dict`` keys are the original module's keys and checkpoints map between partitions.
    """

    stage: int | None = None  # its index among the pipeline's stages (set by ``partition``)
    ties: list[Tie] = []

    def local_ties(self) -> dict[Tie, nn.Parameter]:
        """This stage's copy of each tied parameter it holds."""
        mine = [(t, n) for t in self.ties for s, n in zip(t.stages, t.names, strict=True) if s == self.stage]
        return {t: self.get_parameter(n) for t, n in mine}

    def forward(self, *inputs: Any) -> Any:
        x: Any = inputs if len(inputs) != 1 else inputs[0]
        for layer in self:
            x = layer(*x) if isinstance(x, tuple) else layer(x)
        return x


def partition(
    module: nn.Module,
    rank: int,
    world_size: int,
    balance: Sequence[int] | str | None = None,
    num_model_chunks: int = 1,
    *,
    split_points: Sequence[str] | None = None,
    example_inputs: tuple[Any, ...] | None = None,
    example_kwargs: dict[str, Any] | None = None,
    process_group: dist.ProcessGroup | None = None,
) -> nn.Module | list[nn.Module]:
    r"""Returns rank ``rank``'s stage of ``module`` (or its ``num_model_chunks`` chunks, interleaved order).

    An ``nn.Sequential`` without ``split_points`` is cut between its layers (a ``SequentialModel``); any other
    module is cut between the blocks of its largest block list, or at ``split_points`` (see
    ``pipeline.split``), into ``ModuleStage``\ s that run the module's own forward. A parameter that stages on
    two ranks share (a tied embedding and head) is kept equal by the pipeline (see ``pipeline.ties``).

    Args:
        module: the whole network; every rank passes the same one.
        balance: layers (blocks) per stage (``world_size * num_model_chunks`` ints), ``None`` to balance
            parameter counts, or ``"time"`` (Sequential only) to balance the forward + backward time of each
            layer, measured once on ``example_inputs`` (rank 0 of ``process_group`` measures and broadcasts,
            so every rank cuts alike).
        num_model_chunks: with ``V > 1`` the network is cut into ``world_size * V`` parts and rank ``r``
            gets parts ``r, r + world_size, ...`` (Interleaved1F1B's layout) as a list.
        split_points: names of the blocks that begin each stage after the first (``["transformer.h.6"]``).
        example_inputs, example_kwargs: a call of the module; with a split module, one traced call decides
            which modules outside the blocks run before them (first stage) and after them (last stage).
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} must be in [0, world_size={world_size})")
    if num_model_chunks < 1:
        raise ValueError(f"num_model_chunks={num_model_chunks} must be at least 1")
    parts_count = world_size * num_model_chunks
    if not isinstance(module, nn.Sequential) or split_points is not None:
        if isinstance(balance, str):
            raise ValueError(f"balance={balance!r} cuts an nn.Sequential; give a split module a list of block counts")
        plan = plan_split(module, parts_count, split_points=split_points, balance=balance, trace=_trace(
            module, split_points, example_inputs, example_kwargs))  # fmt: skip
        stages = split_module(module, plan, list(range(rank, parts_count, world_size)))
        return stages[0] if num_model_chunks == 1 else list(stages)
    counts = stage_layer_counts(
        module, parts_count, balance, example_inputs=example_inputs, process_group=process_group
    )
    items = list(module._modules.items())
    bounds = [sum(counts[:i]) for i in range(len(counts) + 1)]
    parts = [SequentialModel(OrderedDict(items[bounds[i] : bounds[i + 1]])) for i in range(len(counts))]
    ties = find_ties(parts)
    for index, part in enumerate(parts):
        part.stage, part.ties = index, ties
    chunks = parts[rank::world_size]
    return chunks[0] if num_model_chunks == 1 else chunks


def _trace(
    module: nn.Module, split_points: Sequence[str] | None, args: tuple[Any, ...] | None, kwargs: dict[str, Any] | None
) -> Trace | None:
    """One traced call when there is an example (the block lists and where the other modules run); else
    ``None``: one block list, the other modules placed by registration."""
    if args is None and kwargs is None:
        return None
    blocks = split_points[0].rpartition(".")[0] if split_points else find_blocks(module)
    return trace_module(module, blocks, tuple(args or ()), dict(kwargs or {}))


def stage_layer_counts(
    module: nn.Sequential,
    parts: int,
    balance: Sequence[int] | str | None,
    *,
    example_inputs: tuple[Any, ...] | None = None,
    process_group: dist.ProcessGroup | None = None,
) -> list[int]:
    """Layers per part: ``balance`` checked, or balanced by parameter count or measured time."""
    n = len(module)
    if n < parts:
        raise ValueError(f"the module has {n} layers, fewer than the {parts} stages asked for; use fewer stages")
    if balance is None:
        return balanced_counts([sum(p.numel() for p in layer.parameters()) + 1 for layer in module], parts)
    if balance == "time":
        return balanced_counts(_measured_times(module, example_inputs, process_group), parts)
    if isinstance(balance, str):
        raise ValueError(f"balance={balance!r} is unknown; pass None, 'time' or a list of layer counts")
    if any(isinstance(c, bool) or not isinstance(c, numbers.Integral) for c in balance):
        raise TypeError(f"balance={list(balance)} must hold whole layer counts (ints), such as [3, 3]")
    counts = [int(c) for c in balance]
    if len(counts) != parts or sum(counts) != n or min(counts) < 1:
        raise ValueError(
            f"balance={list(balance)} must be {parts} positive layer counts (stages x model chunks) summing to {n}"
        )
    return counts


def _measured_times(
    module: nn.Sequential, example_inputs: tuple[Any, ...] | None, process_group: dist.ProcessGroup | None
) -> list[float]:
    """Forward + backward seconds of each layer on ``example_inputs``, agreed on by every rank.

    [Note: timing layers] Each layer is timed where the inputs are (moved there for its turn and back, so a
    model still on the CPU is profiled on the GPU it will train on, one layer at a time), on its second run
    (the first pays for kernel selection and allocator growth), and on CUDA between synchronizations: a CUDA
    layer returns as soon as its kernels are queued, so the host clock alone measures launch time.
    """
    if example_inputs is None:
        raise ValueError("balance='time' needs example_inputs=(a batch the first layer accepts,) to profile on")
    device = next((a.device for a in example_inputs if torch.is_tensor(a)), torch.device("cpu"))
    times = [0.0] * len(module)
    x: Any = example_inputs if len(example_inputs) != 1 else example_inputs[0]
    for i, layer in enumerate(module):
        home = next((t.device for t in (*layer.parameters(), *layer.buffers())), device)
        layer.to(device)
        args = x if isinstance(x, tuple) else (x,)
        args = tuple(a.detach().requires_grad_(a.is_floating_point()) if torch.is_tensor(a) else a for a in args)
        for _ in range(2):
            out, times[i] = _time_layer(layer, args, device)
        layer.to(home)
        x = tuple(o.detach() for o in out) if isinstance(out, tuple) else out.detach()
    module.zero_grad(set_to_none=True)
    if dist.is_available() and dist.is_initialized():
        group = process_group if process_group is not None else dist.group.WORLD
        times = kept_collectives.broadcast_object(times, dist.get_global_rank(group, 0), group)
    log.info("measured layer times (s): %s", ", ".join(f"{t:.4f}" for t in times))
    return times


def _time_layer(layer: nn.Module, args: tuple[Any, ...], device: torch.device) -> tuple[Any, float]:
    """One forward and backward of ``layer``: its output and the seconds they took on ``device``."""
    _synchronize(device)
    start = time.perf_counter()
    out = layer(*args)
    outs = [o for o in (out if isinstance(out, tuple) else (out,)) if torch.is_tensor(o) and o.requires_grad]
    if outs:
        torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
    _synchronize(device)
    return out, time.perf_counter() - start


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def make_subgroups(pp_size: int, timeout: timedelta | None = None) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """Returns this rank's ``(dp_group, pp_group)`` for ``world_size / pp_size`` pipelines of ``pp_size`` stages.

    Pipelines are consecutive ranks: pipeline ``i`` is ranks ``i*pp_size ... i*pp_size + pp_size - 1`` and its
    stage ``s`` is rank ``i*pp_size + s``; the data-parallel group of stage ``s`` is ``s, s + pp_size, ...``
    (``RankLayout``'s [Note: rank order]). With hosts of ``pp_size`` ranks each pipeline stays inside a host
    (point-to-point traffic on shared memory) and gradients all-reduce across hosts. Collective: every rank
    calls it. ``timeout`` bounds every operation of the new groups.
    """
    if not dist.is_initialized():
        raise RuntimeError("make_subgroups needs torch.distributed initialized (dist.init_process_group)")
    groups = RankLayout(dist.get_world_size(), pp_size=pp_size).groups(timeout)
    return groups.data_parallel, groups.pipeline
