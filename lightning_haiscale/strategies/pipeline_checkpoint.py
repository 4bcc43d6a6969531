"""The pipeline strategies' checkpoint format: one full file, plus one stage file per stage.

[Note: stage files] Rank 0 writes the full checkpoint: every stage's weights, gathered, under the
unpartitioned module's names (it loads into the plain module with ``load_state_dict``, and into a pipeline of
any number of stages), without optimizer states, and with ``"pipeline": {"stages", "num_model_chunks"}``.
Each stage of the first data-parallel pipeline writes ``<file>.stage<k>``: the sorted names of its layers'
state (``"layers"``), its weights, its optimizer states and the names of the parameters they are for
(``"param_names"``: per optimizer, per parameter group). A resume with the same layout restores a stage's
optimizer states from its own stage file; at another layout (another number of stages, another cut) every
rank reads every stage file and takes the states of the parameters it now holds, by name, so a resume at
another pipeline size continues as the saved run would have.

[Note: one save, many files] A kill between two files of one save must not pair a new full file with an old
stage file. Every save has an id, in the full file and in each stage file. The stage files are written
first, under ``<file>.stage<k>.<id>``; then rank 0 replaces the full file (one rename: the commit); then each
stage file is renamed to ``<file>.stage<k>``. A load takes ``<file>.stage<k>.<id>`` of the full file's id if
it is still there (killed before the rename), else ``<file>.stage<k>``, and checks its id. Leftovers of a
killed save are deleted by the next one.
"""

from __future__ import annotations

import glob
import logging
import os
import secrets
from collections.abc import Mapping, Sequence
from typing import Any

import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO
from typing_extensions import override

from lightning_haiscale.strategies.checkpoint_file import check_file_targets, save_file

__all__ = [
    "PipelineCheckpoints",
    "full_checkpoint",
    "load_stage_file",
    "optimizer_param_names",
    "read_stage_file",
    "stage_checkpoint",
    "stage_files_of",
    "stage_path",
    "stage_slice",
    "states_by_name",
]

log = logging.getLogger(__name__)

_SAVE_ID_BYTES = 8
_SAVE_ID_GLOB = "[0-9a-f]" * 2 * _SAVE_ID_BYTES  # only the names this module writes (see stage_files_of)


def stage_path(filepath: str | os.PathLike, stage: int, save_id: str | None = None) -> str:
    """The stage file of pipeline stage ``stage`` beside the full checkpoint ``filepath``; with ``save_id``,
    its name until that save is committed (see [Note: one save, many files])."""
    final = f"{os.fspath(filepath)}.stage{stage}"
    return final if save_id is None else f"{final}.{save_id}"


def stage_files_of(filepath: str | os.PathLike, stage: int) -> list[str]:
    """Every stage file of ``stage`` beside ``filepath``: the committed one, any of unfinished saves, and the
    staging file of a save killed while writing one (``save_file``'s hidden sibling). Only names this module
    writes (a save id is 16 hex digits): a user's ``<file>.stage0.txt`` is not one of them."""
    final = stage_path(filepath, stage)
    folder, name = os.path.split(final)
    killed_writes = glob.glob(os.path.join(glob.escape(folder), f".{glob.escape(name)}.{_SAVE_ID_GLOB}.partial"))
    return [final] * os.path.isfile(final) + glob.glob(f"{glob.escape(final)}.{_SAVE_ID_GLOB}") + killed_writes


def full_checkpoint(checkpoint: Mapping[str, Any], stages: int, num_model_chunks: int, save_id: str) -> dict[str, Any]:
    """What rank 0 writes: the checkpoint without optimizer states (they are per stage), with the layout."""
    full = {k: v for k, v in checkpoint.items() if k != "optimizer_states"}
    full["pipeline"] = {"stages": stages, "num_model_chunks": num_model_chunks, "save_id": save_id}
    return full


def stage_checkpoint(
    stage_state: Mapping[str, Any],
    module_name: str,
    checkpoint: Mapping[str, Any],
    param_names: list[Any],
    save_id: str,
) -> dict[str, Any]:
    """What a stage writes: its layers' names, its weights (under the module's names), its optimizer states and
    the names of their parameters."""
    return {
        "save_id": save_id,
        "layers": sorted(stage_state),
        "state_dict": {f"{module_name}.{k}": v for k, v in stage_state.items()},
        "optimizer_states": checkpoint.get("optimizer_states", []),
        "param_names": param_names,
    }


def optimizer_param_names(module: Any, optimizers: Sequence[Any]) -> list[list[list[str]]]:
    """Per optimizer, per parameter group, the module's names of its parameters (in the group's order)."""
    names = {id(p): n for n, p in module.named_parameters(remove_duplicate=False)}
    return [[[names[id(p)] for p in group["params"]] for group in opt.param_groups] for opt in optimizers]


def states_by_name(saved: Sequence[Mapping[str, Any]], wanted: list[list[list[str]]]) -> list[dict[str, Any]] | None:
    """Optimizer state dicts for the parameters named in ``wanted``, merged from every stage file in ``saved``;
    ``None`` when a file has no names (written before they were) or the parameter groups do not line up."""
    merged = []
    for o, groups in enumerate(wanted):
        by_name: dict[str, Any] = {}
        hyper: list[dict[str, Any]] | None = None
        for stage in saved:
            if "param_names" not in stage or len(stage["optimizer_states"]) <= o:
                return None
            state = stage["optimizer_states"][o]
            if len(state["param_groups"]) != len(groups):
                return None
            hyper = hyper or [{k: v for k, v in g.items() if k != "params"} for g in state["param_groups"]]
            for group, names in zip(state["param_groups"], stage["param_names"][o], strict=True):
                pairs = zip(group["params"], names, strict=True)
                by_name.update({n: state["state"][i] for i, n in pairs if i in state["state"]})
        ids = iter(range(sum(len(g) for g in groups)))
        param_groups = [{**hyper[g], "params": [next(ids) for _ in names]} for g, names in enumerate(groups)]
        flat = [n for names in groups for n in names]
        states = {i: by_name[n] for i, n in enumerate(flat) if n in by_name}
        merged.append({"state": states, "param_groups": param_groups})
    return merged


def read_stage_file(
    checkpoint_io: CheckpointIO,
    checkpoint_path: str | os.PathLike,
    stage: int,
    weights_only: bool | None,
    save_id: str | None,
) -> dict[str, Any] | None:
    """The stage file of ``stage`` in the save ``save_id`` (the full file's; None before save ids), or ``None``
    when there is none; raises when the file found belongs to another save."""
    uncommitted = stage_path(checkpoint_path, stage, save_id) if save_id is not None else None
    path = uncommitted if uncommitted and os.path.exists(uncommitted) else stage_path(checkpoint_path, stage)
    if not os.path.exists(path):
        return None
    saved = checkpoint_io.load_checkpoint(path, weights_only=weights_only)
    if saved.get("save_id") != save_id:
        raise RuntimeError(
            f"{path} belongs to another save ({saved.get('save_id')}) than {os.fspath(checkpoint_path)} "
            f"({save_id}): the stage file was replaced by hand or by another job writing the same path"
        )
    return saved


def load_stage_file(
    checkpoint_io: CheckpointIO,
    checkpoint_path: str | os.PathLike,
    stage: int,
    weights_only: bool | None,
    save_id: str | None,
) -> tuple[list[str] | None, list[Any]]:
    """The saved layer names and optimizer states of ``stage``; ``(None, [])`` when it has no stage file."""
    saved = read_stage_file(checkpoint_io, checkpoint_path, stage, weights_only, save_id)
    return (None, []) if saved is None else (saved["layers"], saved["optimizer_states"])


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
        """See [Note: stage files] and [Note: one save, many files]. A directory at the full file's or a stage
        file's path raises on every rank before anything is written."""
        stage_files = (stage_path(filepath, k) for k in range(self.stages_per_pipeline))
        check_file_targets(self.broadcast, self.is_global_zero, [filepath, *stage_files])
        save_id = self.broadcast(secrets.token_hex(_SAVE_ID_BYTES))
        if self.dp_rank == 0:
            names = optimizer_param_names(self.lightning_module, self.optimizers)
            stage = stage_checkpoint(self._proxy.state_dict(), self.module_name, checkpoint, names, save_id)
            uncommitted = stage_path(filepath, self.pp_rank, save_id)  # checkpoint_io creates the folder
            save_file(self.checkpoint_io, stage, uncommitted, storage_options)
        self.barrier()
        if self.is_global_zero:
            full = full_checkpoint(checkpoint, self.stages_per_pipeline, self.num_model_chunks, save_id)
            save_file(self.checkpoint_io, full, filepath, storage_options)
        self.barrier()
        if self.dp_rank == 0:
            os.replace(uncommitted, stage_path(filepath, self.pp_rank))
            for leftover in stage_files_of(filepath, self.pp_rank)[1:]:
                os.remove(leftover)

    @override
    def remove_checkpoint(self, filepath: str | os.PathLike) -> None:
        for stage_file in stage_files_of(filepath, self.pp_rank) if self.dp_rank == 0 else []:
            os.remove(stage_file)
        super().remove_checkpoint(filepath)

    @override
    def load_checkpoint(self, checkpoint_path: str | os.PathLike, weights_only: bool | None = None) -> dict[str, Any]:
        """The full checkpoint, with this stage's optimizer states when its stage file matches this layout."""
        checkpoint = dict(self.checkpoint_io.load_checkpoint(checkpoint_path, weights_only=weights_only))
        save_id = checkpoint.get("pipeline", {}).get("save_id")
        self._saved_layers, checkpoint["optimizer_states"] = load_stage_file(
            self.checkpoint_io, checkpoint_path, self.pp_rank, weights_only, save_id
        )
        saved_stages = checkpoint.get("pipeline", {}).get("stages", 0)
        self._stage_files = checkpoint_path, range(saved_stages), weights_only, save_id
        return checkpoint

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Restores optimizers from this stage's file when the layout is the same, else by parameter name from
        every stage file (see [Note: stage files])."""
        if self._saved_layers == sorted(self._proxy.state_dict()):
            super().load_optimizer_state_dict(checkpoint)
            return
        path, stages, weights_only, save_id = self._stage_files
        saved = [read_stage_file(self.checkpoint_io, path, k, weights_only, save_id) for k in stages]
        wanted = optimizer_param_names(self.lightning_module, self.optimizers)
        states = states_by_name(saved, wanted) if saved and all(saved) else None
        if states is None:
            log.info("the checkpoint has no optimizer states for this stage layout: optimizers start fresh")
            return
        for optimizer, state in zip(self.optimizers, states, strict=True):
            optimizer.load_state_dict(state)

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        """Loads this stage's slice of a full state dict (from any number of stages, or none)."""
        module = self.lightning_module
        state = stage_slice(checkpoint["state_dict"], module.state_dict().keys(), strict)
        module.load_state_dict(state, strict=strict)
