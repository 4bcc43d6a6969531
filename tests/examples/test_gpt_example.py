"""The GPT example's data, LightningModule and training script, on one process."""

from __future__ import annotations

import sys

import pytest
import torch
from lightning.pytorch.callbacks import ThroughputMonitor

from examples.gpt import train
from examples.gpt.data import ByteBlocks, GPTDataModule, load_tokens
from examples.gpt.lightning_module import GPTLightningModule
from examples.gpt.model import config
from lightning_haiscale.strategies import HaiFSDPStrategy, PipeDreamStrategy


def test_default_corpus_is_deterministic_bytes() -> None:
    a, b = load_tokens(max_bytes=10_000), load_tokens(max_bytes=10_000)
    assert a.numel() == 10_000 and a.dtype == torch.int64
    assert torch.equal(a, b) and 0 <= int(a.min()) and int(a.max()) < 256


def test_blocks_are_shifted_by_one(tmp_path) -> None:
    path = tmp_path / "text.txt"
    path.write_bytes(bytes(range(100)))
    blocks = ByteBlocks(load_tokens(path), block_size=8)
    assert len(blocks) == 12
    x, y = blocks[3]
    assert x.tolist() == list(range(24, 32)) and y.tolist() == list(range(25, 33))


def test_datamodule_batches_and_seeded_order() -> None:
    def first_batch() -> tuple[torch.Tensor, torch.Tensor]:
        dm = GPTDataModule(block_size=16, batch_size=4, max_bytes=50_000, seed=7)
        dm.setup("fit")
        return next(iter(dm.train_dataloader()))

    (x1, y1), (x2, _) = first_batch(), first_batch()
    assert x1.shape == y1.shape == (4, 16)
    assert torch.equal(x1, x2)
    assert torch.equal(x1[:, 1:], y1[:, :-1])


def test_module_builds_model_once() -> None:
    module = GPTLightningModule(config("tiny", n_layer=1))
    module.configure_model()
    first = module.model
    module.configure_model()
    assert module.model is first
    assert module(torch.zeros(2, 8, dtype=torch.long)).shape == (2, 8, 256)


@pytest.fixture(autouse=True)
def _no_pytest_argv(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "argv", ["train.py"])  # LightningCLI warns when it sees both args and sys.argv


TINY_RUN = [
    "--trainer.accelerator=cpu", "--trainer.strategy=auto", "--trainer.max_steps=3", "--trainer.limit_val_batches=2",
    "--trainer.log_every_n_steps=1", "--trainer.enable_progress_bar=false", "--throughput.window_size=2",
    "--model.cfg.block_size=32", "--data.batch_size=2", "--data.max_bytes=20000",
]  # fmt: skip


def test_train_script_runs_and_summarizes(tmp_path) -> None:
    summary = train.main([*TINY_RUN, f"--trainer.default_root_dir={tmp_path}"])
    assert summary["samples_per_s"] > 0
    # Not a parity check: the summary's perplexity is exp(loss), but the metric weights tokens while val_loss
    # averages batch means, each logged in float32; 1% covers their difference on 2 batches of equal size.
    assert abs(summary["val_ppl"] - float(torch.tensor(summary["val_loss"]).exp())) < 1e-2 * summary["val_ppl"]


def _cli(args: list[str]) -> train.GPTCLI:
    return train.GPTCLI(
        GPTLightningModule, GPTDataModule, args=args, run=False, trainer_defaults=train.TRAINER_DEFAULTS
    )


def test_trainer_flags_and_strategy_arguments_come_from_yaml(tmp_path) -> None:
    (tmp_path / "run.yaml").write_text(
        "trainer:\n"
        "  strategy:\n"
        "    class_path: lightning_haiscale.strategies.PipeDreamStrategy\n"
        "    init_args: {chunks: 2, balance: [3, 4]}\n"
        "  accelerator: cpu\n"
        "  devices: 2\n"
        "  accumulate_grad_batches: 3\n"
        f"  default_root_dir: {tmp_path}\n"
        "model:\n"
        "  cfg: small\n"
        "  lr: 0.01\n"
    )
    cli = _cli(["--config", str(tmp_path / "run.yaml"), "--trainer.max_steps=7"])
    strategy = cli.trainer.strategy
    assert isinstance(strategy, PipeDreamStrategy) and strategy.chunks == 2 and strategy.balance == [3, 4]
    assert cli.trainer.accumulate_grad_batches == 3 and cli.trainer.max_steps == 7
    assert cli.model.cfg == config("small")  # tied: the stages holding the embedding and the head share it
    assert cli.model.lr == 0.01
    assert cli.datamodule.block_size == 1024  # follows the model's context


def test_registered_strategy_names_and_model_fields_from_the_command_line(tmp_path) -> None:
    cli = _cli([
        "--trainer.strategy=hai_fsdp", "--trainer.devices=2", "--trainer.accelerator=cpu",
        "--model.cfg.n_layer=2", "--model.cfg.block_size=64", f"--trainer.default_root_dir={tmp_path}",
    ])  # fmt: skip
    assert isinstance(cli.trainer.strategy, HaiFSDPStrategy)
    assert cli.model.cfg == config("tiny", n_layer=2, block_size=64)
    assert cli.datamodule.block_size == 64
    assert any(isinstance(c, ThroughputMonitor) for c in cli.trainer.callbacks)
