"""The pipeline strategies' checkpoint format: one full file, plus one stage file per stage.

[Note: stage files] Rank 0 writes the full checkpoint: every stage's weights, gathered, under the
unpartitioned module's names (it loads into the plain module with ``load_state_dict``, and into a pipeline of
any number of stages), every stage's optimizer states merged as one optimizer over the unpartitioned module
holds them (torch's index-keyed layout: see ``pipeline_optim_state`` [Note: the whole model's optimizer
state]), so that it resumes under ``hai_fsdp``, ``hai_ddp``, ``ddp`` or one device, and
``"pipeline": {"stages", "num_model_chunks", "save_id", "param_names"}`` (the names of those states'
parameters). Each stage of the first data-parallel pipeline writes ``<file>.stage<k>``: the sorted names of its
layers' state (``"layers"``), its weights, its own optimizer states and their parameters' names. A resume with
the same layout restores a stage's optimizer states from its own stage file; at another layout (another number
of stages, another cut) every rank takes the states of the parameters it now holds from the full file, by name
(files written before the full file held them: from every stage file). A checkpoint of another strategy
(index-keyed, from ``ddp``, ``hai_fsdp`` or one device) is named by the stages' parameter order. A state that
cannot be restored raises, naming the file: a resume never continues from fresh optimizer states silently.

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
import secrets
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

from lightning.fabric.plugins import CheckpointIO
from torch.optim import Optimizer
from typing_extensions import override

from lightning_haiscale.adapter.checkpoint_io import check_file_targets, check_optimizer_count, save_file
from lightning_haiscale.hfreduce import kept_collectives
from lightning_haiscale.strategies.pipeline_optim_state import first_names, merge_stage_states, stage_order, tie_aliases

__all__ = [
    "LoadedCheckpoint",
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


def full_checkpoint(
    checkpoint: Mapping[str, Any],
    stages: int,
    num_model_chunks: int,
    save_id: str,
    optimizers: tuple[list[dict[str, Any]], list[list[list[str]]], dict[str, str]] | None,
) -> dict[str, Any]:
    """What rank 0 writes: the checkpoint with the whole model's ``optimizers`` (states, names, and which tied
    copy's state is which name's; ``None``: weights only) in place of this stage's, and the layout."""
    full = {k: v for k, v in checkpoint.items() if k != "optimizer_states"}
    full["pipeline"] = {"stages": stages, "num_model_chunks": num_model_chunks, "save_id": save_id}
    if optimizers is not None:
        full["optimizer_states"], full["pipeline"]["param_names"], full["pipeline"]["tied"] = optimizers
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
    names = first_names(module)
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


@dataclass
class LoadedCheckpoint:
    """What a pipeline's ``load_checkpoint`` read, for its ``load_optimizer_state_dict``."""

    path: str
    weights_only: bool | None
    save_id: str | None  # the full file's (None: no pipeline wrote it, or one before save ids)
    stages: int  # of the pipeline that saved it (0: another strategy)
    whole: list[dict[str, Any]] | None  # the full file's optimizer states
    names: list[list[list[str]]] | None  # their parameters' names, per optimizer, per group
    tied: dict[str, str]  # a tied copy's name -> the name its state is saved under


class PipelineCheckpoints:
    """The pipeline strategies' checkpoint hooks (mixed into ``_PipelineStrategy`` before Lightning's base)."""

    def _full_parameters(self, writeback: bool = False) -> AbstractContextManager[None]:
        """Inside, sharded stages hold their whole parameters (collective over the data-parallel ranks; see
        ``pipeline_sharding`` [Note: full forms of sharded stages])."""
        return self._sharded.full_parameters(writeback) if self._sharded is not None else nullcontext()

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """``optimizer.state_dict()``, sharded stages' states whole (collective over the data-parallel ranks)."""
        optimizer = getattr(optimizer, "_optimizer", optimizer)  # a LightningOptimizer
        return self._sharded.optimizer_state(optimizer) if self._sharded is not None else optimizer.state_dict()

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The full module's state dict, gathered from the stages of this rank's pipeline."""
        with self._full_parameters():
            local = {k: v.detach().cpu() for k, v in self.lightning_module.state_dict().items()}
        if self.stages_per_pipeline == 1:
            return local
        parts = kept_collectives.all_gather_object(local, self._pp_group)
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
        optimizers = self._whole_optimizer_states(checkpoint)
        with self._full_parameters():
            stage_state = {k: v.detach().cpu() for k, v in self._proxy.state_dict().items()}
        if self.dp_rank == 0:
            names = optimizer_param_names(self.lightning_module, self.optimizers)
            stage = stage_checkpoint(stage_state, self.module_name, checkpoint, names, save_id)
            uncommitted = stage_path(filepath, self.pp_rank, save_id)  # checkpoint_io creates the folder
            save_file(self.checkpoint_io, stage, uncommitted, storage_options)
        self.barrier()
        if self.is_global_zero:
            full = full_checkpoint(checkpoint, self.stages_per_pipeline, self.num_model_chunks, save_id, optimizers)
            save_file(self.checkpoint_io, full, filepath, storage_options)
        self.barrier()
        if self.dp_rank == 0:
            os.replace(uncommitted, stage_path(filepath, self.pp_rank))
            for leftover in stage_files_of(filepath, self.pp_rank)[1:]:
                os.remove(leftover)

    def _pipeline_parts(self, part: Any) -> list[Any]:
        """``part`` of every stage of this rank's pipeline, in stage order. Collective over the pipeline."""
        if self.stages_per_pipeline == 1:
            return [part]
        return kept_collectives.all_gather_object(part, self._pp_group)

    def _stage_order(self) -> dict[str, Any]:
        return stage_order(self._stages, self.lightning_module, self.pp_rank, self.stages_per_pipeline)

    def _whole_optimizer_states(
        self, checkpoint: Mapping[str, Any]
    ) -> tuple[list[dict[str, Any]], list[list[list[str]]], dict[str, str]] | None:
        """Every stage's optimizer states as one optimizer over the unpartitioned module holds them, and their
        parameters' names; ``None`` for a weights-only checkpoint. Collective over the pipeline."""
        if "optimizer_states" not in checkpoint:
            return None
        names = optimizer_param_names(self.lightning_module, self.optimizers)
        parts = self._pipeline_parts((self._stage_order(), names, checkpoint["optimizer_states"]))
        orders, param_names, states = zip(*parts, strict=True)
        return (*merge_stage_states(orders, param_names, states), tie_aliases(orders))

    @override
    def remove_checkpoint(self, filepath: str | os.PathLike) -> None:
        for stage_file in stage_files_of(filepath, self.pp_rank) if self.dp_rank == 0 else []:
            os.remove(stage_file)
        super().remove_checkpoint(filepath)

    @override
    def load_checkpoint(self, checkpoint_path: str | os.PathLike, weights_only: bool | None = None) -> dict[str, Any]:
        """The full checkpoint, with this stage's optimizer states when its stage file matches this layout."""
        checkpoint = dict(self.checkpoint_io.load_checkpoint(checkpoint_path, weights_only=weights_only))
        layout = checkpoint.get("pipeline", {})
        self._loaded = LoadedCheckpoint(
            os.fspath(checkpoint_path), weights_only, layout.get("save_id"), layout.get("stages", 0),
            checkpoint.get("optimizer_states"), layout.get("param_names"), layout.get("tied", {}),
        )  # fmt: skip
        self._saved_layers, stage_states = load_stage_file(
            self.checkpoint_io, checkpoint_path, self.pp_rank, weights_only, self._loaded.save_id
        )
        if self._saved_layers is not None:
            checkpoint["optimizer_states"] = stage_states
        elif layout:  # an earlier version's file at another layout: the stage files decide (or the error does)
            checkpoint.setdefault("optimizer_states", [])
        return checkpoint

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Restores optimizers from this stage's file when the layout is the same, else by parameter name (see
        [Note: stage files]); raises, naming the file, when a state cannot be restored."""
        loaded = self._loaded
        if loaded is None:
            raise RuntimeError("load_optimizer_state_dict runs after load_checkpoint")
        same_layout = self._saved_layers is not None and self._saved_layers == sorted(self._proxy.state_dict())
        saved = checkpoint["optimizer_states"] if same_layout else loaded.whole
        if saved is not None:
            check_optimizer_count(len(self.optimizers), len(saved))
        states = list(checkpoint["optimizer_states"]) if same_layout else self._states_by_name(loaded)
        for optimizer, state in zip(self.optimizers, states, strict=True):
            if self._sharded is not None:
                self._sharded.load_optimizer_state(optimizer, state)
            else:
                optimizer.load_state_dict(state)
        self._optimizer_states_to_device()

    def _states_by_name(self, loaded: LoadedCheckpoint) -> list[dict[str, Any]]:
        wanted = optimizer_param_names(self.lightning_module, self.optimizers)
        saved, tied = self._named_states(loaded, wanted)
        wanted = [[[tied.get(n, n) for n in group] for group in opt] for opt in wanted]  # a copy: its first's
        if saved is None:
            raise RuntimeError(
                f"{loaded.path} holds no optimizer state this pipeline can take: it was saved with weights only, or "
                "by a pipeline of an earlier lightning-haiscale whose stage files are missing. Resume it with the "
                "layout that saved it (its .stage<k> files beside it), or load the weights alone: "
                "model.load_state_dict(torch.load(path)['state_dict']) and trainer.fit(model) without ckpt_path"
            )
        have = {n for stage in saved for opt in stage["param_names"] for group in opt for n in group}
        missing = [n for opt in wanted for group in opt for n in group if n not in have]
        states = states_by_name(saved, wanted) if not missing else None
        if states is None:
            raise RuntimeError(
                f"the optimizers of {loaded.path} do not match this module's: "
                + (f"no state for {missing[:3]}" if missing else "other parameter groups")
                + "; resume with the same module and configure_optimizers as the run that saved it"
            )
        return states

    def _named_states(
        self, loaded: LoadedCheckpoint, wanted: list[list[list[str]]]
    ) -> tuple[list[dict[str, Any]] | None, dict[str, str]]:
        """The checkpoint's optimizer states with their parameters' names, as ``states_by_name`` takes them, and
        the tied copies' aliases; from another strategy's index-keyed file, named by the pipeline's parameter
        order (collective)."""
        whole = loaded.whole
        if whole is not None and loaded.names is not None:
            return [{"param_names": loaded.names, "optimizer_states": whole}], loaded.tied
        if whole and all(isinstance(p, str) for s in whole for g in s["param_groups"] for p in g["params"]):
            names = [[list(g["params"]) for g in s["param_groups"]] for s in whole]  # hai_fsdp before issue 31: by name
            return [{"param_names": names, "optimizer_states": whole}], {}
        if whole is not None and loaded.stages == 0:
            orders, wanted_by_stage = zip(*self._pipeline_parts((self._stage_order(), wanted)), strict=True)
            shapes = [[{"state": {}, "param_groups": [{"params": list(range(len(g)))} for g in opt]} for opt in w]
                      for w in wanted_by_stage]  # fmt: skip
            names = merge_stage_states(orders, wanted_by_stage, shapes)[1]
            return [{"param_names": names, "optimizer_states": whole}], tie_aliases(orders)
        saved = [
            read_stage_file(self.checkpoint_io, loaded.path, k, loaded.weights_only, loaded.save_id)
            for k in range(loaded.stages)
        ]  # earlier builds: each stage file names its own copies
        return (saved if saved and all(saved) and all("param_names" in s for s in saved) else None), {}

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        """Loads this stage's slice of a full state dict (from any number of stages, or none)."""
        module = self.lightning_module
        with self._full_parameters(writeback=True):
            state = stage_slice(checkpoint["state_dict"], module.state_dict().keys(), strict)
            module.load_state_dict(state, strict=strict)
