"""Where ``DistributedDataParallel`` keeps gradients (reducer [Note: where gradients live]), against one process.

A gradient of at least ``IN_PLACE_BYTES`` is reduced in the tensor autograd made (no copy); a smaller one
lives in a view of a shared bucket, across ``zero_grad(set_to_none=True)`` and later steps. What the user
sees is torch's: ``zero_grad()`` leaves every ``.grad`` None. SGD throughout (Adam's normalised step would
hide a wrong gradient scale); float64 throughout (``_run_all``), tolerance relative 1e-9 of each parameter's
norm (``FLOAT64_RTOL``: tests/ddp/test_distributed.py).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn

from lightning_haiscale.ddp import DistributedDataParallel
from lightning_haiscale.ddp import reducer as reducer_module
from lightning_haiscale.testing.parity import default_dtype
from tests.ddp import test_distributed as plain
from tests.distributed import run_distributed

ROWS = 4  # rows per rank and micro-batch


def _model() -> nn.Module:
    """``0.weight`` is 2 MiB of float64 (reduced in place by default), the rest is packed."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(512, 512), nn.Tanh(), nn.Linear(512, 4))


def _batch(step: int, rows: int) -> torch.Tensor:
    return torch.randn(rows, 512, generator=torch.Generator().manual_seed(step))


def _loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).square().mean()


@contextmanager
def _in_place_bytes(n: int) -> Iterator[None]:
    """Reducers made inside reduce CPU gradients of at least ``n`` bytes in place."""
    previous = reducer_module.IN_PLACE_BYTES
    reducer_module.IN_PLACE_BYTES = n
    try:
        yield
    finally:
        reducer_module.IN_PLACE_BYTES = previous


def _inside(storage: torch.Tensor, t: torch.Tensor) -> bool:
    return storage.data_ptr() <= t.data_ptr() < storage.data_ptr() + storage.numel() * storage.element_size()


def _homes_across_zero_grad(rank: int, world: int) -> None:
    model, ref = DistributedDataParallel(_model()), _model()
    reducer = model.reducer
    assert reducer.in_place == [True, False, False, False], "0.weight (2 MiB) in place, the rest packed"
    storage = reducer.storage[(torch.float64, torch.device("cpu"))]
    made: list[int] = []  # data_ptr of the gradient autograd makes for 0.weight
    model.module[0].weight.register_hook(lambda g: made.append(g.data_ptr()))
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref))
    for step in range(3):
        x = _batch(step, world * ROWS)
        _loss(model, x[rank * ROWS : (rank + 1) * ROWS]).backward()
        _loss(ref, x).backward()
        for i, p in enumerate(reducer.params):  # no attach_grad: what backward left
            assert _inside(storage, p.grad) != reducer.in_place[i], f"step {step}: parameter {i} in the wrong home"
        weight = model.module[0].weight
        assert weight.grad.data_ptr() == made[-1], "the in-place gradient was copied, not reduced where it was"
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()  # set_to_none=True, as torch and Lightning
        assert all(p.grad is None for p in model.parameters()), "zero_grad() leaves None, as torch DDP"
    plain._assert_close(model.module, ref)
    packed = sum(p.numel() * 8 for p, home in zip(reducer.params, reducer.in_place, strict=True) if not home)
    assert reducer.stats.backwards == 3
    assert reducer.stats.copied_bytes == 3 * packed, "only packed gradients are copied, once a step"
    assert reducer.stats.in_place_bytes == 3 * 512 * 512 * 8
    # set_to_none=False keeps every tensor: the views stay views, autograd adds into them, nothing is copied
    _loss(model, _batch(3, ROWS)).backward()
    opt.zero_grad(set_to_none=False)
    assert all(not p.grad.any() for p in model.parameters())
    _loss(model, _batch(4, ROWS)).backward()
    assert reducer.stats.copied_bytes == 4 * packed
    assert all(_inside(storage, p.grad) for p, home in zip(reducer.params, reducer.in_place, strict=True) if not home)
    model.reducer.stop()


def _accumulation_matches_one_process(rank: int, world: int) -> None:
    """Two micro-batches a step, the first under no_sync(); both homes; zero_grad with and without set_to_none."""
    model, ref = DistributedDataParallel(_model()), _model()
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref))
    for step in range(4):
        x = _batch(step, world * 2 * ROWS)
        mine = x[rank * 2 * ROWS : (rank + 1) * 2 * ROWS]
        with model.no_sync():
            (_loss(model, mine[:ROWS]) / 2).backward()
        (_loss(model, mine[ROWS:]) / 2).backward()
        _loss(ref, x).backward()
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad(set_to_none=step % 2 == 0)
    plain._assert_close(model.module, ref)
    model.reducer.stop()


def _in_place(check: Callable[[int, int], None], rank: int, world: int) -> None:
    with _in_place_bytes(0):
        check(rank, world)


def _everything_in_place(check: Callable[[int, int], None]) -> Callable[[int, int], None]:
    return functools.partial(_in_place, check)


@default_dtype(torch.float64)
def _run_all(rank: int, world: int, checks: list[Callable[[int, int], None]]) -> None:
    for check in checks:
        check(rank, world)
        dist.barrier()


def test_gradient_homes_on_two_processes() -> None:
    checks = [
        _homes_across_zero_grad,
        _accumulation_matches_one_process,
        _everything_in_place(_accumulation_matches_one_process),
        _everything_in_place(plain._gpt_parity),
        _everything_in_place(plain._unused_parameters),
        _everything_in_place(plain._double_accumulation_matches_one_process),
    ]
    run_distributed(_run_all, 2, checks)


def test_in_place_on_two_hosts_of_two_ranks() -> None:
    """In-place gradients take the engine's hierarchical path across hosts (a job on its Python thread)."""
    run_distributed(_run_all, 4, [_everything_in_place(plain._gpt_parity)], node_ids=["a", "a", "b", "b"])
