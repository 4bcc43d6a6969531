"""Checkpoints (folders and files) that a kill cannot leave half-written: a save is made aside, then published by
one rename; a folder save among the user's files writes its metadata last instead.

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

[Note: only our own files] A checkpoint path may already hold something the user made. A save never removes
what this package did not write: a file save onto a directory raises ``IsADirectoryError`` (as Lightning's
``FSDPStrategy`` does) unless the directory is one of our folder checkpoints and nothing else. A folder save into a
directory holding anything a folder checkpoint does not write (see :func:`foreign_entries`) writes into that
directory and keeps those entries, as Lightning's ``FSDPStrategy`` does; a swap would remove them, so this save is
not atomic but "metadata last", as torch's DCP: rank 0 first removes the previous checkpoint's ``.metadata`` and
``meta.pt``, then its other entries (see :func:`remove_own_entries`), every rank writes its shards, and
``.metadata`` then ``meta.pt`` come last. A kill midway leaves a folder without one of the two, which no load
takes for a complete checkpoint, never new shards beside the old metadata. Rank 0 decides which way before
anything is written, and every rank follows it (:func:`folder_checkpoint` broadcasts it).

Where ``RENAME_EXCHANGE`` is refused (an old kernel, some network filesystems), a folder over an existing
one takes two renames: the old save moves to ``.<name>.previous`` first, and a kill between the two leaves
the checkpoint there, and the final name absent, until someone moves it back.
"""

from __future__ import annotations

import ctypes
import errno
import fnmatch
import os
import shutil
from collections.abc import Callable, Generator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

__all__ = [
    "clear_staging",
    "file_checkpoint",
    "file_target_error",
    "folder_checkpoint",
    "foreign_entries",
    "publish_folder",
    "remove_own_entries",
    "staging_folder",
    "writes_in_place",
]

OWN_ENTRIES = (".metadata", "meta.pt", "*.distcp", "rank_*.pt")
"""What a folder checkpoint of this package holds: DCP's metadata and shards, ``meta.pt``, and the ``rank_<r>.pt``
files of lightning-haiscale 0.1."""

_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def staging_folder(final: str | os.PathLike) -> Path:
    """Where a checkpoint for ``final`` (a folder, or a file) is written before :func:`publish_folder` (hidden, a
    sibling)."""
    final = Path(final)
    return final.with_name(f".{final.name}.partial")


def _previous(final: Path) -> Path:
    return final.with_name(f".{final.name}.previous")


def foreign_entries(folder: str | os.PathLike) -> list[str]:
    """The entries of ``folder`` (sorted) that no folder checkpoint of this package writes (see
    [Note: only our own files])."""
    return sorted(e.name for e in os.scandir(folder) if not any(fnmatch.fnmatch(e.name, p) for p in OWN_ENTRIES))


def _is_own_checkpoint(folder: Path) -> bool:
    marked = (folder / ".metadata").is_file() or (folder / "meta.pt").is_file()
    return marked and not foreign_entries(folder)


def file_target_error(final: str | os.PathLike) -> OSError | None:
    """Why a file checkpoint must not be written at ``final``: it is a directory that is not one of our folder
    checkpoints (a file save replaces those, as Lightning's ``FSDPStrategy`` does); ``None`` when it may."""
    final = Path(final)
    if not final.is_dir() or _is_own_checkpoint(final):
        return None
    return IsADirectoryError(
        f"The checkpoint path exists and is a directory: {final}. It is not a checkpoint folder of this package, so "
        "nothing in it is touched: save the file under another name, or move the directory away"
    )


def writes_in_place(final: str | os.PathLike) -> bool:
    """Whether a folder checkpoint at ``final`` is written into the existing directory (it holds entries that a
    folder checkpoint does not write, which a swap would remove) rather than swapped in (see
    [Note: only our own files])."""
    final = Path(final)
    return final.is_dir() and not final.is_symlink() and bool(foreign_entries(final))


def remove_own_entries(folder: str | os.PathLike) -> None:
    """Removes the files of the previous folder checkpoint in ``folder``, its metadata (``.metadata``,
    ``meta.pt``) first, so that a kill midway leaves no folder that a load takes for a checkpoint; the user's
    entries, and any directory, are kept (rank 0, before a save in place)."""
    for pattern in OWN_ENTRIES:
        for entry in sorted(os.scandir(folder), key=lambda e: e.name):
            if fnmatch.fnmatch(entry.name, pattern) and not entry.is_dir(follow_symlinks=False):
                os.unlink(entry.path)


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
    final: str | os.PathLike,
    *,
    publisher: bool,
    barrier: Callable[[], None],
    broadcast: Callable[[Any], Any] = lambda obj: obj,
) -> Generator[Path, None, None]:
    """Collective: every rank writes its part of the folder checkpoint ``final`` into the yielded folder, the
    metadata last; when all are done, ``publisher`` (one rank, the source of ``broadcast``) publishes it (see
    [Note: atomic publication]). Where ``final`` holds entries a folder checkpoint does not write, the yielded
    folder is ``final`` itself, cleared of the previous checkpoint's files only (see [Note: only our own
    files])."""
    in_place = broadcast(writes_in_place(final) if publisher else None)
    if publisher:
        clear_staging(final)
        if in_place:
            remove_own_entries(final)
    barrier()
    yield Path(final) if in_place else staging_folder(final)
    barrier()
    if publisher and not in_place:
        publish_folder(final)
    barrier()


@contextmanager
def file_checkpoint(final: str | os.PathLike) -> Generator[Path, None, None]:
    """One process writes the file checkpoint ``final`` at the yielded staging path; when the block ends without
    an error, it is published (see [Note: atomic publication]). The parent folder is created. Raises
    ``IsADirectoryError`` when ``final`` is a directory that is not one of our checkpoints."""
    error = file_target_error(final)
    if error is not None:
        raise error
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
