"""One checkpoint file written so that a kill at any moment leaves the previous file or the new one, and no
temporary file: what every Trainer and Fabric strategy of this package saves a file with.

Lightning's ``TorchCheckpointIO`` writes through ``_atomic_save``: a temporary file in ``$TMPDIR``, then a move.
A kill before the move leaves that file behind (as large as the checkpoint), and where ``$TMPDIR`` is on another
filesystem the move is a copy, which a kill can leave half done. Here the file is written beside its final name
and published by one rename (see [Note: atomic publication] in ``checkpoint_files.py``).
"""

from __future__ import annotations

from typing import Any

import fsspec
import torch
from fsspec.implementations.local import LocalFileSystem
from lightning.fabric.plugins import CheckpointIO, TorchCheckpointIO

from lightning_haiscale.checkpoint_files import file_checkpoint

__all__ = ["save_file"]


def save_file(io: CheckpointIO, checkpoint: dict[str, Any], path: Any, storage_options: Any | None) -> None:
    """Writes ``checkpoint`` to ``path``: with Lightning's default ``TorchCheckpointIO`` and a local path,
    ``torch.save`` to a staging sibling, then one rename. Another ``CheckpointIO`` (the user's own, an
    asynchronous one), ``storage_options`` or a remote path: ``io`` writes it as it does."""
    filesystem, local = fsspec.core.url_to_fs(str(path))
    if type(io) is not TorchCheckpointIO or storage_options is not None or not isinstance(filesystem, LocalFileSystem):
        io.save_checkpoint(checkpoint, path, storage_options=storage_options)
        return
    with file_checkpoint(local) as staging, open(staging, "wb") as file:
        torch.save(checkpoint, file)
