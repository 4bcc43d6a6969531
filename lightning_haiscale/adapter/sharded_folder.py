"""A sharded checkpoint folder as Lightning's FSDP strategies (the Trainer's and Fabric's) lay it out: every rank's
shards in a ``torch.distributed.checkpoint`` folder (see ``fsdp.dcp``), and ``meta.pt``, everything else, written by
rank 0 through the strategy's ``CheckpointIO``. One protocol for both faces: saved aside or "metadata last" (see
``checkpoint_files`` [Note: atomic publication]), and a folder without ``meta.pt`` is refused before any load.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from lightning.fabric.plugins import CheckpointIO

from lightning_haiscale.adapter.checkpoint_files import folder_checkpoint
from lightning_haiscale.adapter.checkpoint_io import save_file
from lightning_haiscale.fsdp.dcp import save_dcp

__all__ = ["META_FILE", "CheckpointingStrategy", "check_checkpoint_path", "load_meta", "save_sharded"]

META_FILE = "meta.pt"
"""Lightning's name for the folder's non-tensor part (its ``_METADATA_FILENAME``)."""


class CheckpointingStrategy(Protocol):
    """What a save or load needs of a Trainer or Fabric strategy."""

    checkpoint_io: CheckpointIO

    @property
    def is_global_zero(self) -> bool: ...

    def barrier(self, name: str | None = None) -> None: ...

    def broadcast(self, obj: Any, src: int = 0) -> Any: ...


def save_sharded(
    strategy: CheckpointingStrategy,
    path: Path,
    model_shard: Mapping[str, Any],
    optimizer_shards: Sequence[Mapping[str, Any]] | Mapping[str, Mapping[str, Any]],
    meta: dict[str, Any],
    process_group: Any,
    storage_options: Any | None = None,
    model_key: str = "model",
) -> None:
    """Writes the folder at ``path`` (the same path on every rank): shards under ``model_key`` and the optimizers'
    keys (``optimizer_<i>`` for a sequence), then ``meta`` as ``meta.pt``. Collective over ``process_group``."""
    publisher, barrier, broadcast = strategy.is_global_zero, strategy.barrier, strategy.broadcast
    with folder_checkpoint(path, publisher=publisher, barrier=barrier, broadcast=broadcast) as staging:
        save_dcp(staging, model_shard, optimizer_shards, process_group, model_key=model_key)  # creates the folder
        if strategy.is_global_zero:
            save_file(strategy.checkpoint_io, meta, staging / META_FILE, storage_options)


def check_checkpoint_path(path: Path) -> None:
    """Lightning's check before a load: ``path`` is a file or a folder with ``meta.pt`` (a folder that is neither
    is named with what it lacks, rather than torch's ``IsADirectoryError``)."""
    if path.is_dir() and not (path / META_FILE).is_file():
        raise ValueError(
            f"The path {str(path)!r} does not point to a valid checkpoint. Make sure the path points to either a "
            "sharded checkpoint folder (with DCP's .metadata and meta.pt) or a single file with a full checkpoint"
        )


def load_meta(strategy: CheckpointingStrategy, path: Path, weights_only: bool | None) -> dict[str, Any]:
    """The folder's ``meta.pt``, read through the strategy's ``CheckpointIO``."""
    return dict(strategy.checkpoint_io.load_checkpoint(path / META_FILE, weights_only=weights_only))
