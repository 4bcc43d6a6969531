"""One checkpoint file written so that a kill at any moment leaves the previous file or the new one, and no
temporary file: what every Trainer and Fabric strategy of this package saves a file with.

Lightning's ``TorchCheckpointIO`` writes through ``_atomic_save``: a temporary file in ``$TMPDIR``, then a move.
A kill before the move leaves that file behind (as large as the checkpoint), and where ``$TMPDIR`` is on another
filesystem the move is a copy, which a kill can leave half done. Here the file is written beside its final name
and published by one rename (see [Note: atomic publication] in ``checkpoint_files``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import fsspec
import torch
from fsspec.implementations.local import LocalFileSystem
from lightning.fabric.plugins import CheckpointIO, TorchCheckpointIO

from lightning_haiscale.adapter.checkpoint_files import file_checkpoint, file_target_error

__all__ = ["check_file_targets", "check_optimizer_count", "optimizer_states_of", "save_file"]


def check_file_targets(broadcast: Callable[[Any], Any], is_global_zero: bool, paths: Iterable[Any]) -> None:
    """Collective: raises on every rank when rank 0 finds one of ``paths`` (local files a save is about to write) to
    be a directory that is not our checkpoint (see ``checkpoint_files`` [Note: only our own files]); before any
    rank writes, so that none waits for a rank that raised."""
    error = None
    if is_global_zero:
        local = (fsspec.core.url_to_fs(str(p)) for p in paths)
        error = next((e for fs, p in local if isinstance(fs, LocalFileSystem) and (e := file_target_error(p))), None)
    error = broadcast(error)
    if error is not None:
        raise error


def check_optimizer_count(configured: int, saved: int) -> None:
    """Lightning's check before restoring optimizers (its ``FSDPStrategy``'s message): one state per optimizer."""
    if configured != saved:
        raise RuntimeError(
            f"You have configured {configured} optimizers but the checkpoint contains {saved} optimizers to load. "
            "Please resume training with the same number of optimizers or edit the checkpoint manually to remove "
            "states."
        )


def optimizer_states_of(checkpoint: Mapping[str, Any], path: Any, configured: int) -> list[Any]:
    """The checkpoint's optimizer states, one per configured optimizer; raises, naming ``path`` and the fix, where
    a resume would otherwise continue from fresh optimizer states."""
    states = checkpoint.get("optimizer_states")
    if states is None and "pipeline" in checkpoint:
        raise RuntimeError(
            f"{path} was saved by a pipeline strategy of an earlier lightning-haiscale, whose full file holds no "
            "optimizer states (they are in its .stage<k> files beside it): resume it once under the pipeline "
            "strategy and layout that saved it and save again (the full file then holds every stage's states), or "
            "load the weights alone (model.load_state_dict(torch.load(path)['state_dict']), fit without ckpt_path)"
        )
    if states is None:
        raise KeyError(
            "Trying to restore optimizer state but checkpoint contains only the model. This is probably due to "
            f"`ModelCheckpoint.save_weights_only` being set to `True`. ({path})"
        )
    check_optimizer_count(configured, len(states))
    return list(states)


def save_file(io: CheckpointIO, checkpoint: dict[str, Any], path: Any, storage_options: Any | None) -> None:
    """Writes ``checkpoint`` to ``path``: with Lightning's default ``TorchCheckpointIO`` and a local path,
    ``torch.save`` to a staging sibling, then one rename. Another ``CheckpointIO`` (the user's own, an
    asynchronous one), ``storage_options`` or a remote path: ``io`` writes it as it does. A local directory
    that is not our checkpoint is never replaced: ``IsADirectoryError``."""
    filesystem, local = fsspec.core.url_to_fs(str(path))
    if isinstance(filesystem, LocalFileSystem) and (error := file_target_error(local)) is not None:
        raise error
    if type(io) is not TorchCheckpointIO or storage_options is not None or not isinstance(filesystem, LocalFileSystem):
        io.save_checkpoint(checkpoint, path, storage_options=storage_options)
        return
    with file_checkpoint(local) as staging, open(staging, "wb") as file:
        torch.save(checkpoint, file)
