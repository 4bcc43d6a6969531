"""The strategies' collectives (``adapter/collectives.py``): Lightning's results, with every gloo work kept to exit
so that a script ending right after one exits 0 (the abort it prevents is counted by ``tests/exits/exit_loop.sh``)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import lightning_haiscale.fabric as fabric_strategies
import lightning_haiscale.strategies as trainer_strategies
from lightning_haiscale.adapter.collectives import ExitSafeCollectives
from lightning_haiscale.testing.distributed import run_distributed


def _ours_and_lightnings(rank: int, world: int) -> dict[str, Any]:
    from lightning.fabric.utilities.distributed import _all_gather_ddp_if_available, _sync_ddp
    from torch.distributed import ReduceOp

    from lightning_haiscale.hfreduce import at_exit

    class Host(ExitSafeCollectives):
        root_device = torch.device("cpu")

    ours = Host()

    def value() -> torch.Tensor:
        return torch.tensor([rank + 1.0, 2.0 * rank - 3.0], dtype=torch.float64)

    result: dict[str, Any] = {"kept": []}
    reductions = [("mean", value), ("sum", value), (ReduceOp.MAX, value), ("mean", lambda: torch.tensor([rank + 2]))]
    for i, (op, make) in enumerate(reductions):
        before = len(at_exit._RETAINED)
        mine = ours.reduce(make(), reduce_op=op)
        result["kept"].append(len(at_exit._RETAINED) - before)
        result[f"reduce {i} {op}"] = (
            mine.tolist(),
            _sync_ddp(make(), reduce_op=op).tolist(),
            mine.dtype == make().dtype,
        )
    result["all_reduce is reduce"] = Host.all_reduce is Host.reduce
    result["not a tensor"] = ours.reduce(3.5)
    gathered = ours.all_gather(value())
    result["all_gather"] = (gathered.tolist(), _all_gather_ddp_if_available(value()).tolist())
    message = {"rank": rank, "tensor": torch.arange(3) * rank, "text": "é" * 1000}
    received = ours.broadcast(message, src=1)
    result["broadcast"] = (received["rank"], received["tensor"].tolist(), received["text"] == "é" * 1000)
    result["src keeps its object"] = received is message if rank == 1 else None
    before = len(at_exit._RETAINED)
    ours.barrier("name")
    result["kept"].append(len(at_exit._RETAINED) - before)
    return result


def test_the_collectives_give_lightnings_results_and_keep_their_works() -> None:
    for rank, result in enumerate(run_distributed(_ours_and_lightnings, 2)):
        for key, (mine, lightnings, same_dtype) in ((k, v) for k, v in result.items() if k.startswith("reduce ")):
            assert mine == lightnings and same_dtype, key
        assert result["reduce 0 mean"][0] == [1.5, -2.0]  # (1 + 2) / 2 and (-3 + -1) / 2, exact in float64
        assert result["reduce 3 mean"][0] == [2]  # an integer mean stays an integer tensor, as Lightning's: 5 // 2
        assert result["all_reduce is reduce"] and result["not a tensor"] == 3.5
        assert result["all_gather"][0] == result["all_gather"][1] == [[1.0, -3.0], [2.0, -1.0]]
        assert result["broadcast"] == (1, [0, 1, 2], True)
        assert result["src keeps its object"] in ((None,) if rank == 0 else (True,))
        assert result["kept"] == [1, 1, 1, 1, 1]  # each reduce and the barrier handed its work over


STRATEGIES = [
    trainer_strategies.HaiDDPStrategy,
    trainer_strategies.HaiFSDPStrategy,
    trainer_strategies.PipeDreamStrategy,
    trainer_strategies.GPipeStrategy,
    trainer_strategies.Interleaved1F1BStrategy,
    fabric_strategies.HaiDDPStrategy,
    fabric_strategies.HaiFSDPStrategy,
]


@pytest.mark.parametrize("strategy", STRATEGIES, ids=lambda cls: f"{cls.__module__}.{cls.__name__}")
def test_every_strategy_runs_these_collectives(strategy: type) -> None:
    names = ["barrier", "broadcast", "all_gather", "reduce" if strategy.__module__.startswith(
        "lightning_haiscale.strategies") else "all_reduce"]  # fmt: skip
    for name in names:
        assert getattr(strategy, name) is getattr(ExitSafeCollectives, name), f"{strategy.__name__}.{name}"
