"""The pipeline strategies' checkpoint format: one full file, plus one stage file per stage.

[Note: stage files] Rank 0 writes the full checkpoint: every stage's weights, gathered, under the
unpartitioned module's names (it loads into the plain module with ``load_state_dict``, and into a pipeline of
any number of stages), without optimizer states, and with ``"pipeline": {"stages", "num_model_chunks"}``.
Each stage of the first data-parallel pipeline writes ``<file>.stage<k>``: the sorted names of its layers'
state (``"layers"``), its weights and its optimizer states. A resume restores a stage's optimizer states only
when its stage file holds exactly the layers this rank now holds; another layout starts them fresh.

[Note: one save, many files] A kill between two files of one save must not pair a new full file with an old
stage file. Every save has an id, in the full file and in each stage file. The stage files are written
first, under ``<file>.stage<k>.<id>``; then rank 0 replaces the full file (one rename: the commit); then each
stage file is renamed to ``<file>.stage<k>``. A load takes ``<file>.stage<k>.<id>`` of the full file's id if
it is still there (killed before the rename), else ``<file>.stage<k>``, and checks its id. Leftovers of a
killed save are deleted by the next one.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Mapping
from typing import Any

from lightning.fabric.plugins import CheckpointIO

__all__ = [
    "full_checkpoint",
    "load_stage_file",
    "stage_checkpoint",
    "stage_files_of",
    "stage_path",
    "stage_slice",
]


def stage_path(filepath: str | os.PathLike, stage: int, save_id: str | None = None) -> str:
    """The stage file of pipeline stage ``stage`` beside the full checkpoint ``filepath``; with ``save_id``,
    its name until that save is committed (see [Note: one save, many files])."""
    final = f"{os.fspath(filepath)}.stage{stage}"
    return final if save_id is None else f"{final}.{save_id}"


def stage_files_of(filepath: str | os.PathLike, stage: int) -> list[str]:
    """Every stage file of ``stage`` beside ``filepath``: the committed one and any of unfinished saves."""
    final = stage_path(filepath, stage)
    return [final] * os.path.exists(final) + glob.glob(f"{glob.escape(final)}.*")


def full_checkpoint(
    checkpoint: Mapping[str, Any], stages: int, num_model_chunks: int, save_id: str
) -> dict[str, Any]:
    """What rank 0 writes: the checkpoint without optimizer states (they are per stage), with the layout."""
    full = {k: v for k, v in checkpoint.items() if k != "optimizer_states"}
    full["pipeline"] = {"stages": stages, "num_model_chunks": num_model_chunks, "save_id": save_id}
    return full


def stage_checkpoint(
    stage_state: Mapping[str, Any], module_name: str, checkpoint: Mapping[str, Any], save_id: str
) -> dict[str, Any]:
    """What a stage writes: its layers' names, its weights (under the module's names), its optimizer states."""
    return {
        "save_id": save_id,
        "layers": sorted(stage_state),
        "state_dict": {f"{module_name}.{k}": v for k, v in stage_state.items()},
        "optimizer_states": checkpoint.get("optimizer_states", []),
    }


def load_stage_file(
    checkpoint_io: CheckpointIO,
    checkpoint_path: str | os.PathLike,
    stage: int,
    weights_only: bool | None,
    save_id: str | None,
) -> tuple[list[str] | None, list[Any]]:
    """The saved layer names and optimizer states of ``stage`` in the save ``save_id`` (the full file's; None
    before save ids); ``(None, [])`` when it has no stage file."""
    uncommitted = stage_path(checkpoint_path, stage, save_id) if save_id is not None else None
    path = uncommitted if uncommitted and os.path.exists(uncommitted) else stage_path(checkpoint_path, stage)
    if not os.path.exists(path):
        return None, []
    saved = checkpoint_io.load_checkpoint(path, weights_only=weights_only)
    if saved.get("save_id") != save_id:
        raise RuntimeError(
            f"{path} belongs to another save ({saved.get('save_id')}) than {os.fspath(checkpoint_path)} "
            f"({save_id}): the stage file was replaced by hand or by another job writing the same path"
        )
    return saved["layers"], saved["optimizer_states"]


def stage_slice(state_dict: Mapping[str, Any], wanted: Any, strict: bool) -> dict[str, Any]:
    """This stage's entries of a full state dict; with ``strict``, raises when one is missing."""
    missing = [k for k in wanted if k not in state_dict]
    if strict and missing:
        raise KeyError(f"the checkpoint lacks {len(missing)} keys of this stage, e.g. {missing[:3]}")
    return {k: v for k, v in state_dict.items() if k in wanted}
