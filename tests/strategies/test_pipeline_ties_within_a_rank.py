"""A parameter tied between two model chunks of one rank (interleaved stages 0 and 2 of 4, both on pipeline rank
0): one pipeline trains it like one process (float64, SGD with momentum, ``FLOAT64_TOLERANCES``); data-parallel
pipelines refuse it on every rank, naming the parameter, where before the first backward failed on one rank with
hai_ddp's "got no gradient ... find_unused_parameters" error."""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader

from lightning_haiscale.pipeline.ties import Tie, ties_within_a_rank
from lightning_haiscale.strategies import Interleaved1F1BStrategy
from lightning_haiscale.testing.parity import BATCH, FLOAT64_TOLERANCES, Classifier, data, reference
from tests.distributed import run_distributed

STEPS = 3


class _TiedChunks(Classifier):
    """``net`` has 8 layers: 4 stages of 2; layers 1 and 4 open stages 0 and 2 and share their weight."""

    def __init__(self) -> None:
        super().__init__()
        self.net[4][0].weight = self.net[1][0].weight


def _fit(rank: int, world: int, pp_size: int) -> dict[str, Any]:
    trainer = L.Trainer(
        strategy=Interleaved1F1BStrategy(chunks=2, pp_size=pp_size), accelerator="cpu", devices=world,
        max_steps=STEPS, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, limit_val_batches=0, precision="64-true",
    )  # fmt: skip
    try:
        trainer.fit(_TiedChunks(), DataLoader(data(), batch_size=BATCH))
    except ValueError as error:
        return {"error": str(error)}
    return {"state": {k: v.tolist() for k, v in trainer.strategy.lightning_module_state_dict().items()}}


def test_ties_within_a_rank() -> None:
    tie = Tie((0, 2), ("a.weight", "b.weight"))
    assert ties_within_a_rank([tie, Tie((0, 3), ("a.bias", "c.bias"))], ranks=2) == [tie]
    assert ties_within_a_rank([tie], ranks=4) == []


def test_one_pipeline_trains_a_tie_within_a_rank_like_one_process() -> None:
    (result, _) = run_distributed(_fit, 2, 2, timeout=300)
    expected, _ = reference(STEPS, BATCH, dtype=torch.float64, model=_TiedChunks)
    assert sorted(result["state"]) == sorted(expected)
    for name, value in expected.items():
        torch.testing.assert_close(
            torch.tensor(result["state"][name], dtype=torch.float64), value, **FLOAT64_TOLERANCES, msg=name
        )


def test_data_parallel_pipelines_refuse_a_tie_within_a_rank() -> None:
    for result in run_distributed(_fit, 4, 2, timeout=300):
        assert "error" in result, "trained instead of refusing"
        assert "'1.0.weight' (stage 0) = '4.0.weight' (stage 2)" in result["error"], result["error"]
        assert "pp_size=None" in result["error"]
