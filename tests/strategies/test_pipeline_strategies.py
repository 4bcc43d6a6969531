"""hai_gpipe / hai_pipedream / hai_interleaved_1f1b against a single-process run of the same module and data.

An unmodified LightningModule (``x, y = batch; out = self(x); loss = F.cross_entropy(out, y);
self.log(...); return loss``) trains 5 steps in float64 (``precision="64-true"``, the reference in float64);
its parameters must equal the reference's at ``FLOAT64_TOLERANCES`` (rtol 1e-9, which rounding cannot reach:
[Note: parity tolerances] in lightning_haiscale/testing/parity.py), the
last stage's logged loss must reach rank 0, ``gradient_clip_val`` must clip by the whole model's norm
(not each stage's), an epoch's uneven last batch must train as one process would, checkpoints must
round-trip between stage counts, and a resume must continue bit-for-bit.
"""

from __future__ import annotations

import copy
import os
from typing import Any

import lightning as L
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

import lightning_haiscale  # noqa: F401 - registers the strategies
from lightning_haiscale.callbacks import CPUOffloadCallback
from lightning_haiscale.cpu_offload import offload_stats
from lightning_haiscale.strategies import GPipeStrategy, Interleaved1F1BStrategy, PipeDreamStrategy
from lightning_haiscale.testing.parity import (
    BATCH,
    FLOAT64_TOLERANCES,
    STEPS,
    Classifier,
    data,
    reference,
)
from tests.distributed import run_distributed

CLIP = 0.1  # below the gradient norm at most steps (0.08-0.53), so clipping acts
DTYPE = torch.float64
# A logged loss is the float64 loss stored in Lightning's float32 accumulator (result.py builds its states in the
# default dtype, float32 outside "64-true"'s forward): a few float32 roundings of a value near 1.
LOGGED_RTOL = 8 * torch.finfo(torch.float32).eps


def fit(
    strategy: L.pytorch.strategies.Strategy,
    tmp: str,
    accumulate: int = 1,
    ckpt_path: str | None = None,
    steps: int = STEPS,
    rows: int = BATCH * STEPS * 2,
    num_nodes: int = 1,
    module: L.LightningModule | None = None,
    **kwargs: Any,
) -> L.Trainer:
    options = {
        "max_steps": steps,
        "accumulate_grad_batches": accumulate,
        "limit_val_batches": 2,
        "val_check_interval": steps * accumulate,
        "num_sanity_val_steps": 0,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "default_root_dir": tmp,
        "precision": "64-true",  # float64: compared with reference(..., dtype=DTYPE) at FLOAT64_TOLERANCES
    }
    devices = dist.get_world_size() // num_nodes
    trainer = L.Trainer(
        strategy=strategy, accelerator="cpu", devices=devices, num_nodes=num_nodes, **{**options, **kwargs}
    )
    module = module if module is not None else Classifier()
    train, val = DataLoader(data(rows), batch_size=BATCH), DataLoader(data(), batch_size=BATCH)
    trainer.fit(module, train, val, ckpt_path=ckpt_path)
    return trainer


def _check_full_state(trainer: L.Trainer, expected: dict[str, torch.Tensor], label: str) -> None:
    full = trainer.strategy.lightning_module_state_dict()
    assert sorted(full) == sorted(expected), label
    for k, v in expected.items():
        torch.testing.assert_close(full[k], v, **FLOAT64_TOLERANCES, msg=f"{label} {k}")


def _train_world_2(rank: int, world: int, tmp: str) -> None:
    expected, last_loss = reference(STEPS, BATCH, dtype=DTYPE)
    strategies = {
        "gpipe": GPipeStrategy(chunks=2, checkpoint="except_last"),
        "pipedream": PipeDreamStrategy(chunks=4),
        "interleaved": Interleaved1F1BStrategy(chunks=2),
        "by name": "hai_pipedream",
    }
    for label, strategy in strategies.items():
        trainer = fit(strategy, tmp)
        _check_full_state(trainer, expected, label)
        if rank == 0:  # the last stage's values reach rank 0, which is the first stage
            assert float(trainer.callback_metrics["train_loss"]) == pytest.approx(last_loss, rel=LOGGED_RTOL), label
            assert "val_loss" in trainer.callback_metrics
    offload = CPUOffloadCallback(1.0, tag="pipeline-test", min_bytes=0, force_copy=True)
    trainer = fit(PipeDreamStrategy(chunks=2), tmp, callbacks=[offload])  # each microbatch's forward offloads
    _check_full_state(trainer, expected, "offload")
    stats = offload_stats("pipeline-test")
    assert stats.entries == STEPS * 2 and stats.total_bytes_offloaded > 0
    expected_acc, _ = reference(STEPS, BATCH, accumulate=2, dtype=DTYPE)
    trainer = fit(PipeDreamStrategy(chunks=2), tmp, accumulate=2)
    _check_full_state(trainer, expected_acc, "accumulate")
    expected_clip, _ = reference(STEPS, BATCH, clip=CLIP, dtype=DTYPE)
    trainer = fit(Interleaved1F1BStrategy(chunks=2), tmp, gradient_clip_val=CLIP)  # two stages per rank
    _check_full_state(trainer, expected_clip, "clip")
    manual = Classifier()
    manual.automatic_optimization = False  # refused on every rank at setup, before any transfer
    trainer = L.Trainer(strategy=PipeDreamStrategy(chunks=2), accelerator="cpu", devices=2, max_steps=1, logger=False)
    with pytest.raises(ValueError, match="needs automatic optimization"):
        trainer.fit(manual, DataLoader(data(), batch_size=BATCH))
    # An epoch's smaller last batch (6 rows, 4 chunks: 2, 2, 1, 1) trains as one process would on it.
    rows = 2 * BATCH + 6
    expected_uneven, last_loss = reference(3, BATCH, rows=rows, dtype=DTYPE)
    for strategy in (PipeDreamStrategy(chunks=4), Interleaved1F1BStrategy(chunks=4)):
        trainer = fit(strategy, tmp, steps=3, rows=rows, limit_val_batches=0)
        _check_full_state(trainer, expected_uneven, f"uneven {strategy.strategy_name}")
        assert float(trainer.callback_metrics["train_loss"]) == pytest.approx(last_loss, rel=LOGGED_RTOL)
    with pytest.raises(ValueError, match=r"batch of 3 rows cannot make chunks=4 microbatches.*drop_last=True"):
        fit(PipeDreamStrategy(chunks=4), tmp, steps=3, rows=2 * BATCH + 3, limit_val_batches=0)


def test_strategies_train_like_one_process(tmp_path: Any) -> None:
    run_distributed(_train_world_2, 2, str(tmp_path), timeout=300)


def _checkpoint_round_trip(rank: int, world: int, tmp: str) -> None:
    expected, _ = reference(STEPS, BATCH, dp=2, clip=CLIP, dtype=DTYPE)  # 2 data-parallel pipelines of 2 stages
    trainer = fit(PipeDreamStrategy(chunks=2, pp_size=2), tmp, gradient_clip_val=CLIP)
    _check_full_state(trainer, expected, "dp x pp, clipped")
    path = os.path.join(tmp, "full.ckpt")
    trainer.save_checkpoint(path)
    dist.barrier()
    assert os.path.exists(f"{path}.stage0") and os.path.exists(f"{path}.stage1")
    # Resuming with the same layout restores this stage's optimizer state (momentum buffers).
    saved_state = copy.deepcopy(trainer.optimizers[0].state_dict())
    resumed = fit(PipeDreamStrategy(chunks=2, pp_size=2), tmp, ckpt_path=path)
    restored = resumed.optimizers[0].state_dict()
    assert restored["state"].keys() == saved_state["state"].keys() and saved_state["state"]
    for i, state in saved_state["state"].items():
        assert torch.equal(restored["state"][i]["momentum_buffer"], state["momentum_buffer"])  # a copy
    _resume_is_bit_for_bit(tmp)
    plain = Classifier().to(DTYPE)  # the unpartitioned module
    plain.load_state_dict(torch.load(path, weights_only=False)["state_dict"])
    for k, v in expected.items():
        torch.testing.assert_close(plain.state_dict()[k], v, **FLOAT64_TOLERANCES)
    # Back into a pipeline of 4 stages: validation gives the same loss as the unpartitioned module.
    module = Classifier()
    validator = L.Trainer(
        strategy=GPipeStrategy(chunks=2, pp_size=4), accelerator="cpu", devices=world, logger=False,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=1,
    )  # fmt: skip
    results = validator.validate(module, DataLoader(data(), batch_size=BATCH), ckpt_path=path)
    x, y = data().tensors
    want = float(F.cross_entropy(plain(x[:BATCH].to(DTYPE)), y[:BATCH]))
    assert results[0]["val_loss"] == pytest.approx(want, rel=LOGGED_RTOL)  # logged


def _resume_is_bit_for_bit(tmp: str) -> None:
    """6 steps saving at step 3 (an epoch's end); resumed there, 3 more steps give the same bits."""
    rows = BATCH * 3 * 2  # an epoch is 3 steps of each of the 2 replicas
    saver = ModelCheckpoint(dirpath=os.path.join(tmp, "ckpt"), filename="{step}", every_n_train_steps=3, save_top_k=-1)
    options = {"steps": 6, "rows": rows, "limit_val_batches": 0}  # in "64-true": the weights load after setup
    whole = fit(PipeDreamStrategy(chunks=2, pp_size=2), tmp, callbacks=[saver], enable_checkpointing=True, **options)
    path = os.path.join(tmp, "ckpt", "step=3.ckpt")
    resumed = fit(PipeDreamStrategy(chunks=2, pp_size=2), tmp, ckpt_path=path, **options)
    expected, got = whole.strategy.lightning_module_state_dict(), resumed.strategy.lightning_module_state_dict()
    assert resumed.global_step == 6 and expected.keys() == got.keys()
    for k, v in expected.items():
        assert torch.equal(got[k], v), k


def test_dp_x_pp_and_checkpoints_across_stage_counts(tmp_path: Any) -> None:
    run_distributed(_checkpoint_round_trip, 4, str(tmp_path), timeout=300)
