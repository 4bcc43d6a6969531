"""Byte-level language-modelling data for the GPT example: no tokenizer, no download.

Tokens are raw bytes (vocabulary 256). The default corpus is the Python standard library's own
``.py`` source, read in sorted path order up to a byte cap, so it exists on every machine that runs
this example and is the same on every rank. ``--data PATH`` trains on a text file (or a folder of
them) instead.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset

__all__ = ["DEFAULT_MAX_BYTES", "ByteBlocks", "GPTDataModule", "batch_samples", "load_tokens", "stdlib_corpus"]

DEFAULT_MAX_BYTES = 4 << 20  # 4 MiB of the standard library: ~16k blocks of 256 tokens


def stdlib_corpus(max_bytes: int = DEFAULT_MAX_BYTES) -> bytes:
    """The first ``max_bytes`` bytes of the standard library's ``.py`` files, concatenated in sorted order.

    Installed packages (``site-packages``) are skipped, so the corpus depends only on the Python version.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    return _concatenate(sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts), max_bytes)


def load_tokens(path: str | Path | None = None, max_bytes: int = DEFAULT_MAX_BYTES) -> torch.Tensor:
    """The corpus as a 1-D ``int64`` tensor of byte values.

    Args:
        path: a text file, or a folder whose files are read in sorted order; ``None`` = the stdlib corpus.
        max_bytes: read at most this many bytes.
    """
    if max_bytes <= 0:
        raise ValueError(f"max_bytes={max_bytes} must be positive")
    if path is None:
        data = stdlib_corpus(max_bytes)
    else:
        p = Path(path)
        if not p.exists():
            raise FileNotFoundError(f"--data {path}: no such file or folder")
        files = sorted(f for f in p.rglob("*") if f.is_file()) if p.is_dir() else [p]
        data = _concatenate(files, max_bytes)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


def _concatenate(files: list[Path], max_bytes: int) -> bytes:
    parts, total = [], 0
    for f in files:
        if total >= max_bytes:
            break
        chunk = f.read_bytes()[: max_bytes - total]
        parts.append(chunk)
        total += len(chunk)
    return b"".join(parts)


class ByteBlocks(Dataset):
    """Non-overlapping windows of a token stream: item i is ``(x, y)``, both (T,), y = x shifted by one."""

    def __init__(self, tokens: torch.Tensor, block_size: int) -> None:
        if tokens.numel() < block_size + 1:
            raise ValueError(
                f"the corpus has {tokens.numel()} tokens, fewer than block_size + 1 = {block_size + 1}; "
                "use a larger --data file or a smaller --block-size"
            )
        self.tokens = tokens
        self.block_size = block_size

    def __len__(self) -> int:
        return (self.tokens.numel() - 1) // self.block_size

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = i * self.block_size
        window = self.tokens[start : start + self.block_size + 1]  # (T + 1,)
        return window[:-1], window[1:]  # (T,), (T,)


def batch_samples(batch: tuple[torch.Tensor, torch.Tensor]) -> int:
    """Sequences in an ``(x, y)`` batch: ``ThroughputMonitor``'s ``batch_size_fn``."""
    return batch[0].size(0)


class GPTDataModule(L.LightningDataModule):
    """Train and validation batches of ``(x, y)``, each (B, T), from one byte corpus.

    The last ``val_fraction`` of the corpus is the validation split. Training order is shuffled with
    ``seed`` (Lightning's distributed sampler reshuffles per epoch with its own seed), so runs repeat.

    Args:
        data: text file or folder (``--data.data``); ``None`` = the standard-library corpus.
        block_size: tokens per sequence (T).
        batch_size: sequences per batch and per process (B).
        val_fraction: share of the corpus held out for validation.
        max_bytes: corpus cap in bytes.
        seed: seed of the training shuffle.
    """

    def __init__(
        self,
        data: str | None = None,
        block_size: int = 256,
        batch_size: int = 8,
        val_fraction: float = 0.1,
        max_bytes: int = DEFAULT_MAX_BYTES,
        seed: int = 0,
    ) -> None:
        super().__init__()
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"val_fraction={val_fraction} must lie strictly between 0 and 1")
        if batch_size < 1 or block_size < 1:
            raise ValueError(f"batch_size={batch_size} and block_size={block_size} must be >= 1")
        self.data, self.block_size, self.batch_size = data, block_size, batch_size
        self.val_fraction, self.max_bytes, self.seed = val_fraction, max_bytes, seed
        self.train_set: ByteBlocks | None = None
        self.val_set: ByteBlocks | None = None

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        tokens = load_tokens(self.data, self.max_bytes)
        split = int(tokens.numel() * (1.0 - self.val_fraction))
        self.train_set = ByteBlocks(tokens[:split], self.block_size)
        self.val_set = ByteBlocks(tokens[split:], self.block_size)

    def train_dataloader(self) -> DataLoader:
        generator = torch.Generator().manual_seed(self.seed)
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True, drop_last=True, generator=generator)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.batch_size, shuffle=False)
