"""The real models of the pipeline tests (``real_models``: GPT-2 and the litgpt-style module with tied heads,
Llama) under ``hai_ddp`` and ``hai_fsdp`` (blocks wrapped by class), against one process: every strategy is
shown on a model its users have. float64 and SGD: 1e-10."""

from __future__ import annotations

import pytest
import torch.distributed as dist
from transformers.models.gpt2.modeling_gpt2 import GPT2Block
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

import lightning_haiscale  # noqa: F401 - registers the strategies
from lightning_haiscale.strategies import HaiDDPStrategy, HaiFSDPStrategy
from tests.distributed import run_distributed
from tests.strategies.real_models import MODELS, Block, check, fit, one_process


def _data_parallel(rank: int, world: int) -> None:
    for name in ("gpt2", "llama", "litgpt"):
        make, loss = MODELS[name]
        expected, _ = one_process(make, loss, dp=world)
        strategies = {
            "hai_ddp": HaiDDPStrategy(),
            "hai_fsdp": HaiFSDPStrategy(auto_wrap_policy={GPT2Block, LlamaDecoderLayer, Block}),
        }
        for label, strategy in strategies.items():
            trainer = fit(make, loss, strategy, dp=world, dp_rank=rank)
            full = trainer.strategy.lightning_module_state_dict()
            if full or rank == 0:  # a full state dict may be gathered on rank 0 only
                check(full, expected, name, f"{name} {label}")
            dist.barrier()


@pytest.mark.slow  # 30-45 s on 2 loaded cores: 6 runs
def test_real_models_under_hai_ddp_and_hai_fsdp() -> None:
    run_distributed(_data_parallel, 2, timeout=600)
