"""Checkpoints (folders and files) that a kill cannot leave half-written: every save is made aside, then
published by one rename.

[Note: atomic publication] A checkpoint path is either absent, the previous save, or the new one, whatever
moment the writing processes are killed at. A folder (DCP shards, ``.metadata``, ``meta.pt``) is written
by every rank into a hidden staging sibling ``.<name>.partial``; once all ranks are done, rank 0 swaps it
with the final path in one ``renameat2(RENAME_EXCHANGE)`` (or renames it there, when the path is new), then
deletes the previous save, now at the staging name. The rename stays inside one directory, so inside one
filesystem. A single file written by one process (:func:`file_checkpoint`) is staged and published the same way,
by the same rename. (Lightning's ``_atomic_save`` writes a file under ``$TMPDIR`` and moves it: a kill before the
move leaves the temporary file there, and where ``$TMPDIR`` is another filesystem the move is a copy into the
final name, which a kill can cut short.) Staging leftovers of a killed save are deleted by the next save. This is
atomic against killed processes, not against a power cut (nothing is fsynced), and a folder save needs room for
two copies while it runs.

Where ``RENAME_EXCHANGE`` is refused (an old kernel, some network filesystems), a folder over an existing
one takes two renames: the old save moves to ``.<name>.previous`` first, and a kill between the two leaves
the checkpoint there, and the final name absent, until someone moves it back.
"""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
from collections.abc import Callable, Generator
from contextlib import contextmanager
from pathlib import Path

__all__ = ["clear_staging", "file_checkpoint", "folder_checkpoint", "publish_folder", "staging_folder"]

_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def staging_folder(final: str | os.PathLike) -> Path:
    """Where a checkpoint for ``final`` (a folder, or a file) is written before :func:`publish_folder` (hidden, a
    sibling)."""
    final = Path(final)
    return final.with_name(f".{final.name}.partial")


def _previous(final: Path) -> Path:
    return final.with_name(f".{final.name}.previous")


def clear_staging(final: str | os.PathLike) -> None:
    """Deletes what a killed save left beside ``final`` (rank 0, before the ranks write into the staging
    folder)."""
    _remove(staging_folder(final))


def publish_folder(final: str | os.PathLike) -> None:
    """Makes the complete staging folder (or file) of ``final`` the checkpoint at ``final`` in one rename, then
    deletes what was there (rank 0, once every rank has written; see [Note: atomic publication])."""
    final = Path(final)
    staging = staging_folder(final)
    if not os.path.lexists(final):
        os.rename(staging, final)
        return
    if _exchange(staging, final):
        _remove(staging)  # the previous save
        return
    previous = _previous(final)
    _remove(previous)
    os.rename(final, previous)
    os.rename(staging, final)
    _remove(previous)


@contextmanager
def folder_checkpoint(
    final: str | os.PathLike, *, publisher: bool, barrier: Callable[[], None]
) -> Generator[Path, None, None]:
    """Collective: every rank writes its part of the folder checkpoint ``final`` into the yielded staging
    folder; when all are done, ``publisher`` (one rank) publishes it (see [Note: atomic publication])."""
    if publisher:
        clear_staging(final)
    barrier()
    yield staging_folder(final)
    barrier()
    if publisher:
        publish_folder(final)
    barrier()


@contextmanager
def file_checkpoint(final: str | os.PathLike) -> Generator[Path, None, None]:
    """One process writes the file checkpoint ``final`` at the yielded staging path; when the block ends without
    an error, it is published (see [Note: atomic publication]). The parent folder is created."""
    Path(final).parent.mkdir(parents=True, exist_ok=True)
    clear_staging(final)
    yield staging_folder(final)
    publish_folder(final)


def _exchange(a: Path, b: Path) -> bool:
    """Swaps two paths in one step (Linux ``renameat2``); False where the system or filesystem refuses."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except AttributeError:  # not glibc >= 2.28
        return False
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EPERM):
        return False
    raise OSError(code, f"renameat2({a}, {b}, RENAME_EXCHANGE): {os.strerror(code)}")


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif os.path.lexists(path):
        path.unlink()
