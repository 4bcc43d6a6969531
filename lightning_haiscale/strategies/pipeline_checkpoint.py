"""The pipeline strategies' checkpoint format: one full file, plus one stage file per stage.

[Note: stage files] Rank 0 writes the full checkpoint: every stage's weights, gathered, under the
unpartitioned module's names (it loads into the plain module with ``load_state_dict``, and into a pipeline of
any number of stages), without optimizer states, and with ``"pipeline": {"stages", "num_model_chunks"}``.
Each stage of the first data-parallel pipeline writes ``<file>.stage<k>``: the sorted names of its layers'
state (``"layers"``), its weights and its optimizer states. A resume restores a stage's optimizer states only
when its stage file holds exactly the layers this rank now holds; another layout starts them fresh.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO
from typing_extensions import override

__all__ = ["PipelineCheckpoints", "full_checkpoint", "load_stage_file", "stage_checkpoint", "stage_path", "stage_slice"]

log = logging.getLogger(__name__)


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


class PipelineCheckpoints:
    """The pipeline strategies' checkpoint hooks (mixed into ``_PipelineStrategy`` before Lightning's base)."""

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The full module's state dict, gathered from the stages of this rank's pipeline."""
        local = {k: v.detach().cpu() for k, v in self.lightning_module.state_dict().items()}
        if self.stages_per_pipeline == 1:
            return local
        parts: list[Any] = [None] * self.stages_per_pipeline
        dist.all_gather_object(parts, local, group=self._pp_group)
        return {k: v for part in parts for k, v in part.items()}

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: str | os.PathLike, storage_options: Any | None = None
    ) -> None:
        """See [Note: stage files] in ``pipeline_checkpoint``."""
        if self.dp_rank == 0:
            stage_file = stage_path(filepath, self.pp_rank)  # checkpoint_io creates the folder
            stage = stage_checkpoint(self._proxy.state_dict(), self.module_name, checkpoint)
            self.checkpoint_io.save_checkpoint(stage, stage_file, storage_options)
        if self.is_global_zero:
            full = full_checkpoint(checkpoint, self.stages_per_pipeline, self.num_model_chunks)
            self.checkpoint_io.save_checkpoint(full, filepath, storage_options=storage_options)

    @override
    def remove_checkpoint(self, filepath: str | os.PathLike) -> None:
        stage_file = stage_path(filepath, self.pp_rank)
        if self.dp_rank == 0 and os.path.exists(stage_file):
            os.remove(stage_file)
        super().remove_checkpoint(filepath)

    @override
    def load_checkpoint(self, checkpoint_path: str | os.PathLike, weights_only: bool | None = None) -> dict[str, Any]:
        """The full checkpoint, with this stage's optimizer states when its stage file matches this layout."""
        checkpoint = dict(self.checkpoint_io.load_checkpoint(checkpoint_path, weights_only=weights_only))
        self._saved_layers, checkpoint["optimizer_states"] = load_stage_file(
            self.checkpoint_io, checkpoint_path, self.pp_rank, weights_only
        )
        return checkpoint

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Restores optimizers only from a stage file of this very layout (same layers on this rank)."""
        if self._saved_layers != sorted(self._proxy.state_dict()):
            log.info("the checkpoint has no optimizer states for this stage layout: optimizers start fresh")
            return
        super().load_optimizer_state_dict(checkpoint)

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        """Loads this stage's slice of a full state dict (from any number of stages, or none)."""
        module = self.lightning_module
        state = stage_slice(checkpoint["state_dict"], module.state_dict().keys(), strict)
        module.load_state_dict(state, strict=strict)
