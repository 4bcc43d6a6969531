"""The GPT example's data, LightningModule and training script, on one process."""

from __future__ import annotations

import torch

from examples.gpt import train
from examples.gpt.data import ByteBlocks, GPTDataModule, load_tokens
from examples.gpt.lightning_module import GPTLightningModule
from examples.gpt.model import config


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


def test_train_script_runs_and_summarizes(tmp_path) -> None:
    summary = train.main(
        ["--strategy", "auto", "--accelerator", "cpu", "--max-steps", "3", "--batch-size", "2",
         "--block-size", "32", "--max-bytes", "20000", "--val-batches", "2", "--warmup-steps", "1"]
    )  # fmt: skip
    assert summary["samples_per_s"] > 0
    assert abs(summary["val_ppl"] - float(torch.tensor(summary["val_loss"]).exp())) < 1e-2 * summary["val_ppl"]
