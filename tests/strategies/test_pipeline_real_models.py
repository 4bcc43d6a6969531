"""Unmodified Hugging Face, litgpt-style and Sequential models under the three pipeline strategies, against
one process (see ``real_models``).

The LightningModule is what a user writes: ``loss = self.model(input_ids=x, labels=x).loss`` (the loss
computed inside the model's forward, on the last stage) or ``logits = self.model(x)`` with the loss in the
step. GPT-2, the litgpt-style module and the GPT example tie their head to the input embedding, which the
first and last stage both hold: the copies must stay equal, and the full checkpoint must load into a fresh,
unsplit model with ``strict=True``.
"""

from __future__ import annotations

import pytest

import lightning_haiscale  # noqa: F401 - registers the strategies
from lightning_haiscale.strategies import PipeDreamStrategy
from tests.distributed import run_distributed
from tests.strategies.real_models import MODELS, check, fit, one_process, schedules

CLIP = 0.5  # below the gradient norm at every step (one_process checks), so clipping acts


def _every_model_and_schedule(rank: int, world: int, names: tuple[str, ...] = tuple(MODELS)) -> None:
    for name in names:
        make, loss = MODELS[name]
        expected, val_loss = one_process(make, loss)
        for label, strategy in schedules(world).items():
            trainer = fit(make, loss, strategy)
            check(trainer.strategy.lightning_module_state_dict(), expected, name, f"{name} {label} on {world}")
            logged = float(trainer.callback_metrics["val_loss"])  # logged values are float32 tensors in Lightning
            assert abs(logged - val_loss) <= 1e-6 * abs(val_loss), (name, label, logged, val_loss)


def _clipped_tied_weight_counts_once(rank: int, world: int) -> None:
    make, loss = MODELS["gpt2"]
    expected, _ = one_process(make, loss, clip=CLIP)
    trainer = fit(make, loss, PipeDreamStrategy(chunks=2), gradient_clip_val=CLIP)
    check(trainer.strategy.lightning_module_state_dict(), expected, "gpt2", "gpt2 clipped")


def _dp_x_pp(rank: int, world: int) -> None:
    _every_model_and_schedule(rank, world, ("gpt2", "llama"))  # the 2-rank test covers the other two
    for name in ("gpt2", "llama"):
        make, loss = MODELS[name]
        expected, _ = one_process(make, loss, dp=2)
        trainer = fit(make, loss, PipeDreamStrategy(chunks=2, pp_size=2), dp=2, dp_rank=rank // 2)
        check(trainer.strategy.lightning_module_state_dict(), expected, name, f"{name} 2 x 2")


def test_real_models_train_unmodified_like_one_process() -> None:
    run_distributed(_every_model_and_schedule, 2, timeout=600)


def test_a_tied_weight_counts_once_in_the_clipping_norm() -> None:
    run_distributed(_clipped_tied_weight_counts_once, 2, timeout=300)


@pytest.mark.slow  # ~2 min on 2 loaded cores: 4 ranks, 8 runs
def test_real_models_on_four_stages_and_dp_x_pp() -> None:
    run_distributed(_dp_x_pp, 4, timeout=900)
