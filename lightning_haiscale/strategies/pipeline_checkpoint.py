"""The pipeline strategies' checkpoint format: one full file, plus one stage file per stage.

[Note: stage files] Rank 0 writes the full checkpoint: every stage's weights, gathered, under the
unpartitioned module's names (it loads into the plain module with ``load_state_dict``, and into a pipeline of
any number of stages), without optimizer states, and with ``"pipeline": {"stages", "num_model_chunks"}``.
Each stage of the first data-parallel pipeline writes ``<file>.stage<k>``: the sorted names of its layers'
state (``"layers"``), its weights and its optimizer states. A resume restores a stage's optimizer states only
when its stage file holds exactly the layers this rank now holds; another layout starts them fresh.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from lightning.fabric.plugins import CheckpointIO

__all__ = ["full_checkpoint", "load_stage_file", "stage_checkpoint", "stage_path", "stage_slice"]


def stage_path(filepath: str | os.PathLike, stage: int) -> str:
    """The stage file of pipeline stage ``stage`` beside the full checkpoint ``filepath``."""
    return f"{os.fspath(filepath)}.stage{stage}"


def full_checkpoint(checkpoint: Mapping[str, Any], stages: int, num_model_chunks: int) -> dict[str, Any]:
    """What rank 0 writes: the checkpoint without optimizer states (they are per stage), with the layout."""
    full = {k: v for k, v in checkpoint.items() if k != "optimizer_states"}
    full["pipeline"] = {"stages": stages, "num_model_chunks": num_model_chunks}
    return full


def stage_checkpoint(stage_state: Mapping[str, Any], module_name: str, checkpoint: Mapping[str, Any]) -> dict[str, Any]:
    """What a stage writes: its layers' names, its weights (under the module's names), its optimizer states."""
    return {
        "layers": sorted(stage_state),
        "state_dict": {f"{module_name}.{k}": v for k, v in stage_state.items()},
        "optimizer_states": checkpoint.get("optimizer_states", []),
    }


def load_stage_file(
    checkpoint_io: CheckpointIO, checkpoint_path: str | os.PathLike, stage: int, weights_only: bool | None
) -> tuple[list[str] | None, list[Any]]:
    """The saved layer names and optimizer states of ``stage``; ``(None, [])`` when it has no stage file."""
    path = stage_path(checkpoint_path, stage)
    if not os.path.exists(path):
        return None, []
    saved = checkpoint_io.load_checkpoint(path, weights_only=weights_only)
    return saved["layers"], saved["optimizer_states"]


def stage_slice(state_dict: Mapping[str, Any], wanted: Any, strict: bool) -> dict[str, Any]:
    """This stage's entries of a full state dict; with ``strict``, raises when one is missing."""
    missing = [k for k in wanted if k not in state_dict]
    if strict and missing:
        raise KeyError(f"the checkpoint lacks {len(missing)} keys of this stage, e.g. {missing[:3]}")
    return {k: v for k, v in state_dict.items() if k in wanted}
