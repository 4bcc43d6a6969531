"""Vision, masked-autoencoder and encoder-decoder models under the three pipeline strategies and DP x PP,
against one process (see ``model_families``).

HF's ``ViTModel.forward`` reads ``self.embeddings.patch_embeddings.projection.weight.dtype`` on every stage,
ViTMAE's embeddings return a tuple whose random mask and restore indices its loss reads on the last stage,
timm's ``VisionTransformer`` keeps ``cls_token`` and ``pos_embed`` beside its blocks, T5's and BART's
decoder blocks take the encoder's output (and T5's a position bias the first block computes),
their embedding is tied to the head across stages, and Lightning converts the float32 model to float64 after
the user built it: each model must train to one process's numbers, its tied copies must stay equal, and its
full checkpoint must load strictly into a fresh model.
"""

from __future__ import annotations

import pytest

import lightning_haiscale  # noqa: F401 - registers the strategies
from lightning_haiscale.strategies import PipeDreamStrategy
from tests.distributed import run_distributed
from tests.strategies.model_families import MODELS, check, fit, one_process
from tests.strategies.real_models import schedules


def _every_model_and_schedule(rank: int, world: int, names: tuple[str, ...] = tuple(MODELS)) -> None:
    for name in names:
        expected = one_process(name)
        for label, strategy in schedules(world).items():
            trainer = fit(name, strategy)
            check(trainer.strategy.lightning_module_state_dict(), expected, name, f"{name} {label} on {world}")


def _dp_x_pp(rank: int, world: int) -> None:
    for name in MODELS:
        expected = one_process(name, dp=2)
        trainer = fit(name, PipeDreamStrategy(chunks=2, pp_size=2), dp=2, dp_rank=rank // 2)
        check(trainer.strategy.lightning_module_state_dict(), expected, name, f"{name} 2 x 2")


@pytest.mark.slow  # ~2.5 min on 2 loaded cores: 4 models x 3 schedules
def test_model_families_train_unmodified_like_one_process() -> None:
    run_distributed(_every_model_and_schedule, 2, timeout=900)


@pytest.mark.slow  # 4 ranks on 2 loaded cores
def test_model_families_train_data_parallel_pipelines_like_one_process() -> None:
    run_distributed(_dp_x_pp, 4, timeout=900)


def test_timms_vision_transformer_trains_like_one_process() -> None:
    """timm's own ``VisionTransformer`` (``cls_token`` and ``pos_embed`` beside its blocks), where timm is
    installed (the tests above use a module of its layout)."""
    pytest.importorskip("timm")
    run_distributed(_every_model_and_schedule, 2, ("timm",), timeout=600)
