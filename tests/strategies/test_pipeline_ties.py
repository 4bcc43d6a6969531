"""A parameter shared by two pipeline stages under the Lightning strategies (the GPT example, tied head)."""

from __future__ import annotations

from typing import Any

import pytest

import lightning_haiscale  # noqa: F401 - registers the strategies
from examples.gpt.lightning_module import GPTLightningModule
from examples.gpt.model import config
from lightning_haiscale.strategies import GPipeStrategy, Interleaved1F1BStrategy, PipeDreamStrategy
from tests.distributed import run_distributed
from tests.strategies.helpers import lm_dataset, quiet_fit

TIED = config("tiny", n_layer=4, n_embd=16, n_head=2, block_size=8, vocab_size=32, tie_weights=True)


def _refused_on_every_rank(rank: int, world: int) -> None:
    for strategy in (GPipeStrategy(chunks=2), PipeDreamStrategy(chunks=2), Interleaved1F1BStrategy(chunks=2)):
        with pytest.raises(ValueError, match=r"'0\.wte\.weight' \(stage 0\) = '\d\.lm_head\.weight' \(stage \d\)"):
            quiet_fit(GPTLightningModule(TIED), strategy, 1, lm_dataset(TIED, 8), 4)


def test_a_tied_head_across_stages_is_refused_before_the_first_step(tmp_path: Any) -> None:
    run_distributed(_refused_on_every_rank, 2, timeout=120)
