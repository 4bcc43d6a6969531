"""``fabric.save``'s one file (Fabric's ``hai_ddp``, ``hai_fsdp`` full, and ``meta.pt`` of a sharded save), in one
process: with Fabric's default ``TorchCheckpointIO`` it is written beside the final name and renamed there, with
nothing written under ``$TMPDIR`` (where Lightning's ``_atomic_save`` leaves its temporary file when killed);
a ``CheckpointIO`` of the user's, or storage options, still get the write."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import fsspec
import pytest
import torch
from lightning.fabric.plugins import TorchCheckpointIO

from lightning_haiscale.adapter.checkpoint_io import save_file


class Recording(TorchCheckpointIO):
    def __init__(self) -> None:
        self.saved: list[tuple[Any, Any]] = []

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        self.saved.append((path, storage_options))


def test_the_default_io_writes_beside_the_final_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    final = tmp_path / "ckpt" / "last.ckpt"
    save_file(TorchCheckpointIO(), {"step": 1}, final, None)
    save_file(TorchCheckpointIO(), {"step": 2}, f"file://{final}", None)
    assert torch.load(final) == {"step": 2}
    assert sorted(p.name for p in final.parent.iterdir()) == ["last.ckpt"]
    assert list((tmp_path / "tmp").iterdir()) == []


def test_another_io_or_storage_options_keep_their_own_write(tmp_path: Path) -> None:
    io = Recording()
    save_file(io, {"step": 1}, tmp_path / "a.ckpt", None)
    assert io.saved == [(tmp_path / "a.ckpt", None)]
    with pytest.raises(TypeError, match="storage_options"):  # TorchCheckpointIO's own refusal
        save_file(TorchCheckpointIO(), {"step": 1}, tmp_path / "b.ckpt", {"option": 1})


def test_a_remote_path_is_left_to_the_io() -> None:
    save_file(TorchCheckpointIO(), {"step": 3}, "memory://lhs/last.ckpt", None)
    with fsspec.open("memory://lhs/last.ckpt", "rb") as file:
        assert torch.load(file) == {"step": 3}
