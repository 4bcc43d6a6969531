"""Hugging Face models built on the meta device (``configure_model`` under the Trainer,
``init_module(empty_init=True)`` under Fabric) start as HF starts them eagerly: the same statistics per parameter.

GPT-2's rule for ``c_proj.weight`` (std ``0.02 / sqrt(2 * n_layer)``) is keyed on the parent module; Llama's rotary
``inv_freq`` is a non-persistent buffer that only HF's ``_init_weights`` recomputes. Tolerance: a random parameter's
std within 10% of eager's (the smallest has 2,048 elements: the std's sampling error is ~1.6%, so 10% is 6 sigma,
while a wrong rule is off by 2x); a constant one (norms, biases) and a buffer are equal exactly.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.distributed as dist
from lightning.fabric import Fabric
from torch.utils.data import TensorDataset
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM
from transformers.models.gpt2.modeling_gpt2 import GPT2Block
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

import lightning_haiscale  # noqa: F401  (registers "hai_fsdp")
from lightning_haiscale import fabric
from lightning_haiscale.strategies import HaiFSDPStrategy
from tests.distributed import run_distributed
from tests.strategies.helpers import quiet_fit

GPT2 = GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=128, n_positions=32, bos_token_id=0, eos_token_id=0)
LLAMA = LlamaConfig(
    hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    vocab_size=128, max_position_embeddings=32, bos_token_id=0, eos_token_id=0, pad_token_id=0,
)  # fmt: skip


class _HFModule(L.LightningModule):
    """docs/hai_fsdp.md's advice for large models: build in ``configure_model``. SGD with lr=0 keeps the start."""

    def __init__(self, build: Any) -> None:
        super().__init__()
        self.build = build
        self.model: torch.nn.Module | None = None

    def configure_model(self) -> None:
        if self.model is None:
            self.model = self.build()

    def training_step(self, batch: tuple[torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.model(input_ids=batch[0], labels=batch[0]).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.0)


def _compare(built: dict[str, torch.Tensor], eager: dict[str, torch.Tensor]) -> None:
    assert built.keys() == eager.keys()
    for name, expected in eager.items():
        got = built[name]
        if expected.numel() == 1 or expected.std() == 0:
            assert torch.equal(got, expected), name
        else:
            ratio = (got.std() / expected.std()).item()
            assert abs(ratio - 1) < 0.1, f"{name}: std {got.std():.4f}, eager {expected.std():.4f}"
            assert abs(got.mean().item()) < 0.1 * expected.std().item(), name


def _eager(model_cls: type, cfg: Any) -> dict[str, torch.Tensor]:
    torch.manual_seed(1)
    return model_cls(cfg).state_dict()


def _inv_freqs(model: torch.nn.Module) -> list[torch.Tensor]:
    return [b for name, b in model.named_buffers() if name.endswith("inv_freq")]


def _trainer_and_fabric(rank: int, world: int, tmp: str) -> None:
    data = TensorDataset(torch.randint(0, 128, (2 * world, 16), generator=torch.Generator().manual_seed(0)))
    cases = [(GPT2LMHeadModel, GPT2, GPT2Block), (LlamaForCausalLM, LLAMA, LlamaDecoderLayer)]
    for model_cls, cfg, block in cases:
        module = _HFModule(lambda model_cls=model_cls, cfg=cfg: model_cls(cfg))
        trainer = quiet_fit(module, HaiFSDPStrategy(auto_wrap_policy={block}), 1, data, 2)
        built = {k.removeprefix("model."): v for k, v in trainer.strategy.model.full_state_dict().items()}
        eager = model_cls(cfg)
        if rank == 0:
            _compare(built, _eager(model_cls, cfg))
        for got, expected in zip(_inv_freqs(module.model), _inv_freqs(eager), strict=True):
            torch.testing.assert_close(got, expected, rtol=0, atol=0)

        runner = Fabric(accelerator="cpu", devices=world, strategy=fabric.HaiFSDPStrategy(auto_wrap_policy={block}))
        runner.launch()
        with runner.init_module(empty_init=True):
            model = model_cls(cfg)
        assert all(p.is_meta for p in model.parameters())
        model = runner.setup(model)
        runner.save(Path(tmp, "fabric.ckpt"), {"model": model})
        if rank == 0:
            _compare(torch.load(Path(tmp, "fabric.ckpt"), weights_only=True)["model"], _eager(model_cls, cfg))
        runner.barrier()
        dist.barrier()


def test_hf_models_built_on_meta_start_as_eager(tmp_path: Path) -> None:
    run_distributed(_trainer_and_fabric, 2, str(tmp_path), timeout=240)


def test_a_parameter_no_initializer_writes_raises() -> None:
    """A module with a raw parameter that neither it nor HF's rules initialize: named, not left as garbage."""
    run_distributed(_uninitialized, 1, timeout=120)


class _Scale(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gain = torch.nn.Parameter(torch.ones(4))


def _uninitialized(rank: int, world: int) -> None:
    from lightning_haiscale.fsdp import FullyShardedDataParallel

    with torch.device("meta"):
        model = GPT2LMHeadModel(GPT2)
        model.transformer.extra = _Scale()
        plain = torch.nn.Sequential(_Scale())
    with pytest.raises(ValueError, match="_Scale has parameters or buffers on the meta device but no reset_param"):
        FullyShardedDataParallel(plain)
    with pytest.raises(ValueError, match=r"transformer\.extra\.gain was built on the meta device and no initializer"):
        FullyShardedDataParallel(model, auto_wrap_policy={GPT2Block})
