"""The publication of ``checkpoint_files`` in one process: whatever was at the final name (nothing, a folder, a
file), it ends as the staged folder or file, with no staging leftover; a stale staging folder is cleared."""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning_haiscale.adapter import checkpoint_files
from lightning_haiscale.adapter.checkpoint_files import (
    clear_staging,
    file_checkpoint,
    folder_checkpoint,
    publish_folder,
    staging_folder,
)


def _stage(final: Path, text: str) -> None:
    staging = staging_folder(final)
    staging.mkdir()
    (staging / "meta.pt").write_text(text)


@pytest.mark.parametrize("before", ["nothing", "a folder", "a file"])
@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2", "two renames"])
def test_publish_replaces_whatever_was_there(
    tmp_path: Path, before: str, exchange: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not exchange:
        monkeypatch.setattr(checkpoint_files, "_exchange", lambda a, b: False)
    final = tmp_path / "last.ckpt"
    if before == "a folder":
        final.mkdir()
        (final / "meta.pt").write_text("old")
        (final / "__0_0.distcp").write_text("old shard")
    elif before == "a file":
        final.write_text("old full checkpoint")
    _stage(final, "new")
    publish_folder(final)
    assert sorted(p.name for p in final.iterdir()) == ["meta.pt"]
    assert (final / "meta.pt").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]


def test_a_stale_staging_folder_is_cleared_and_a_failed_save_publishes_nothing(tmp_path: Path) -> None:
    final = tmp_path / "last.ckpt"
    _stage(final, "from a killed save")
    clear_staging(final)
    assert not staging_folder(final).exists()
    final.mkdir()
    (final / "meta.pt").write_text("old")
    save = folder_checkpoint(final, publisher=True, barrier=lambda: None)
    with pytest.raises(RuntimeError, match="disk full"), save as staging:
        staging.mkdir()
        raise RuntimeError("disk full")
    assert (final / "meta.pt").read_text() == "old"


@pytest.mark.parametrize("before", ["nothing", "a folder", "a file", "a stale staging file"])
def test_a_file_checkpoint_replaces_whatever_was_there(tmp_path: Path, before: str) -> None:
    final = tmp_path / "sub" / "last.ckpt"  # the parent is created
    if before == "a folder":
        final.mkdir(parents=True)
        (final / "meta.pt").write_text("old")
    elif before == "a file":
        final.parent.mkdir()
        final.write_text("old")
    elif before == "a stale staging file":
        final.parent.mkdir()
        staging_folder(final).write_text("from a killed save")
    with file_checkpoint(final) as staging:
        assert not staging.exists()
        staging.write_text("new")
    assert final.read_text() == "new"
    assert sorted(p.name for p in final.parent.iterdir()) == ["last.ckpt"]


def test_a_failed_file_checkpoint_publishes_nothing(tmp_path: Path) -> None:
    final = tmp_path / "last.ckpt"
    final.write_text("old")
    with pytest.raises(RuntimeError, match="disk full"), file_checkpoint(final) as staging:
        staging.write_text("half")
        raise RuntimeError("disk full")
    assert final.read_text() == "old"
