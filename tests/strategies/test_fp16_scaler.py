"""``precision="16-mixed"`` on a model split across ranks (pipeline stages, hai_fsdp shards).

CPU Lightning turns "16-mixed" into bf16, so the plugin is built as a CUDA run would build it:
``MixedPrecision("16-mixed", "cpu", scaler=GradScaler("cpu", init_scale=1024))`` (fp16 autocast on CPU, a
fixed scale: it never grows within these steps). Checked: one SGD step changes the parameters as one fp32
process does (relative 2e-2: fp16 autocast's rounding; a loss scale that is never applied but unscaled anyway
gives 1/1024 of the change), and an inf in one rank's gradient makes every rank skip the step and halve the
scale alike.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.plugins.precision import MixedPrecision
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

import lightning_haiscale  # noqa: F401 - registers the strategies
from lightning_haiscale.strategies import HaiFSDPStrategy, Interleaved1F1BStrategy, PipeDreamStrategy
from lightning_haiscale.testing.parity import BATCH, Classifier, reference
from tests.distributed import run_distributed
from tests.strategies.test_pipeline_strategies import fit

SCALE = 1024.0


def _fp16() -> MixedPrecision:
    scaler = torch.amp.GradScaler("cpu", init_scale=SCALE, growth_interval=10**6)
    return MixedPrecision("16-mixed", "cpu", scaler=scaler)


class _InfOnRank1(L.Callback):
    """Puts an inf into rank 1's first (non-empty) gradient after the backward (before the scaler unscales)."""

    def on_after_backward(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        if trainer.global_rank != 1:
            return
        grads = [
            p.grad
            for g in trainer.optimizers[0].param_groups
            for p in g["params"]
            if p.grad is not None and p.grad.numel()
        ]
        grads[0].view(-1)[0] = float("inf")


def _full_state(trainer: L.Trainer) -> dict[str, torch.Tensor]:
    state = [trainer.strategy.lightning_module_state_dict()]  # a collective; rank 0 holds the whole model
    dist.broadcast_object_list(state, src=0)
    return state[0]


def _step_matches_fp32(strategy: L.pytorch.strategies.Strategy, tmp: str, dp: int) -> None:
    initial = Classifier().state_dict()
    expected, _ = reference(1, BATCH, dp=dp)
    trainer = fit(strategy, tmp, steps=1, plugins=[_fp16()], precision=None, limit_val_batches=0)  # not 64-true
    assert isinstance(trainer.precision_plugin.scaler, ShardedGradScaler)
    for name, value in _full_state(trainer).items():
        change, wanted = value - initial[name], expected[name] - initial[name]
        err = (change - wanted).norm() / wanted.norm()
        assert err < 2e-2, f"{type(strategy).__name__} {name}: the step's change is off by {err:.2e} (relative)"


def _inf_on_one_rank_skips_everywhere(strategy: L.pytorch.strategies.Strategy, tmp: str) -> None:
    initial = Classifier().state_dict()
    trainer = fit(
        strategy, tmp, steps=1, plugins=[_fp16()], precision=None, callbacks=[_InfOnRank1()], limit_val_batches=0
    )
    scales: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(scales, trainer.precision_plugin.scaler.get_scale())
    assert scales == [SCALE / 2] * dist.get_world_size(), scales
    for name, value in _full_state(trainer).items():
        assert torch.equal(value, initial[name]), f"{type(strategy).__name__} {name} stepped despite the inf"


def _fp16_checks(rank: int, world: int, tmp: str) -> None:
    _step_matches_fp32(PipeDreamStrategy(chunks=2), tmp, dp=1)
    _step_matches_fp32(Interleaved1F1BStrategy(chunks=2), tmp, dp=1)
    _step_matches_fp32(HaiFSDPStrategy(), tmp, dp=2)
    _inf_on_one_rank_skips_everywhere(PipeDreamStrategy(chunks=2), tmp)
    _inf_on_one_rank_skips_everywhere(HaiFSDPStrategy(), tmp)


def test_fp16_loss_scaling_and_agreed_skips(tmp_path: Any) -> None:
    run_distributed(_fp16_checks, 2, str(tmp_path), timeout=240)


def test_plain_scaler_is_converted_with_its_settings_and_a_custom_one_refused() -> None:
    strategy = PipeDreamStrategy(chunks=2)
    strategy.precision_plugin = _fp16()
    strategy._agree_on_inf()
    scaler = strategy.precision_plugin.scaler
    assert isinstance(scaler, ShardedGradScaler)
    assert scaler.get_scale() == SCALE and scaler.get_growth_interval() == 10**6

    class _Custom(torch.amp.GradScaler):
        pass

    strategy.precision_plugin = MixedPrecision("16-mixed", "cpu", scaler=_Custom("cpu"))
    with pytest.raises(TypeError, match=r"must agree on inf/NaN.*ShardedGradScaler"):
        strategy._agree_on_inf()
