"""Sharded checkpoints in ``torch.distributed.checkpoint`` (DCP) format, loadable at any world size and
convertible to one file with torch's ``dcp_to_torch_save``.

[Note: Lightning's keys] The folder holds the model under ``model`` and optimizer ``i`` under ``optimizer_<i>``,
``{"state": {name: {key: value}}, "param_groups": [{..., "params": [name, ...]}]}``, each tensor in its
parameter's shape: the layout Lightning's ``FSDPStrategy`` writes (torch FSDP's sharded optimizer state dict),
so Lightning's ``consolidate_checkpoint`` reads ours, and each strategy resumes the other's. Fabric names them
after the keys of the state the user saves (``model``, ``optimizer``), as Lightning's Fabric does. Folders of
earlier builds of lightning-haiscale (``state_dict`` and a list ``optimizer_states``) still load.

[Note: flat pieces as DCP chunks]
A rank holds elements ``[start, end)`` of each flattened parameter (see ``state_dict`` [Note: sharded
format]), which is not a box of the parameter's shape. DCP describes shards as boxes (offsets and sizes per
dimension), so each piece is cut into the few boxes that cover its range in row-major order: a partial
first row, whole rows, a partial last row, recursively in the trailing dimensions. Each box is a contiguous
stretch of the piece, so its data is a view, and the checkpoint holds every parameter in its own shape:
DCP reshards it for any world size, and ``dcp_to_torch_save`` writes whole tensors. Optimizer states shaped
like their parameter's piece are cut the same way; everything else is saved as it is.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner, FileSystemReader
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from lightning_haiscale.fsdp.fully_sharded import FullyShardedDataParallel
from lightning_haiscale.fsdp.layout import SHARDED_FORMAT

__all__ = [
    "FlatPiece",
    "boxes",
    "is_dcp_folder",
    "load_dcp",
    "load_into_module",
    "optimizer_keys",
    "save_dcp",
    "saved_keys",
]

_LEGACY_MODEL = "state_dict"  # earlier builds' folders: the model there, the optimizers listed at "optimizer_states"
_LEGACY_OPTIMIZERS = "optimizer_states"


def boxes(start: int, end: int, shape: Sequence[int]) -> list[tuple[list[int], list[int]]]:
    """The boxes ``(offsets, sizes)`` covering elements ``[start, end)`` of a row-major tensor of ``shape``,
    in flat order (see [Note: flat pieces as DCP chunks])."""
    if end <= start:
        return []
    if len(shape) == 0:
        return [([], [])]
    inner = math.prod(shape[1:])
    first, last = start // inner, end // inner  # the row holding start; the rows wholly before end
    out: list[tuple[list[int], list[int]]] = []
    whole_from = first
    if start % inner:
        row_end = min(end, (first + 1) * inner)
        out += [([first, *o], [1, *s]) for o, s in boxes(start - first * inner, row_end - first * inner, shape[1:])]
        if end <= (first + 1) * inner:
            return out
        whole_from = first + 1
    if last > whole_from:
        out.append(([whole_from, *[0] * (len(shape) - 1)], [last - whole_from, *shape[1:]]))
    if end % inner:
        out += [([last, *o], [1, *s]) for o, s in boxes(0, end - last * inner, shape[1:])]
    return out


class FlatPiece:
    """Elements ``[start, start + local.numel())`` of a flattened tensor of ``shape``, as DCP chunks.

    DCP asks it for its write items (save) and its chunks (load) and reads or fills its box views.
    """

    def __init__(self, local: torch.Tensor, start: int, shape: Sequence[int]) -> None:
        self.local = local.reshape(-1)
        self.shape = torch.Size(shape)
        self._views: dict[tuple[int, ...], torch.Tensor] = {}
        self._chunks: list[ChunkStorageMetadata] = []
        position = 0
        for offsets, sizes in boxes(start, start + self.local.numel(), self.shape):
            n = math.prod(sizes)
            self._views[tuple(offsets)] = self.local[position : position + n].view(sizes)
            self._chunks.append(ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes)))
            position += n

    def size(self) -> torch.Size:
        return self.shape

    def view(self, offsets: Sequence[int] | None) -> torch.Tensor:
        return self._views[tuple(offsets or ())]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return list(self._chunks)

    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        properties = TensorProperties.create_from_tensor(self.local)
        return [
            WriteItem(
                index=MetadataIndex(fqn, chunk.offsets),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(chunk=chunk, properties=properties, size=self.shape),
            )
            for chunk in self._chunks
        ]


class _SavePlanner(DefaultSavePlanner):
    def lookup_object(self, index: MetadataIndex) -> Any:
        obj = self.state_dict[index.fqn]
        return obj.view(index.offset) if isinstance(obj, FlatPiece) else super().lookup_object(index)


class _LoadPlanner(DefaultLoadPlanner):
    def set_up_planner(self, state_dict: dict[str, Any], metadata: Any = None, is_coordinator: bool = False) -> None:
        """DefaultLoadPlanner's, without its first step (materializing meta tensors), which replaces objects it
        does not know, such as a FlatPiece, by ``None``; nothing loaded here is on the meta device."""
        self.original_state_dict = state_dict
        self.state_dict, self.mappings = flatten_state_dict(state_dict)
        self.metadata = metadata
        self.is_coordinator = is_coordinator

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        obj = self.state_dict[index.fqn]
        return obj.view(index.offset) if isinstance(obj, FlatPiece) else super().lookup_tensor(index)


def _pieces_of(shard: Mapping[str, Any], aliases: bool = False) -> dict[str, Any]:
    """The shard's pieces as DCP chunks, also under the other keys of a shared parameter with ``aliases``."""
    pieces = {
        fqn: FlatPiece(piece, shard["layout"][fqn]["start"], shard["layout"][fqn]["shape"])
        for fqn, piece in shard["tensors"].items()
    }
    if aliases:
        pieces.update((key, pieces[fqn]) for fqn, keys in shard.get("aliases", {}).items() for key in keys)
    return pieces


def _optim_pieces(shard: Mapping[str, Any]) -> dict[str, Any]:
    """An optimizer's sharded state in DCP form; ``param_groups`` as one tuple (one saved object)."""
    state = {}
    for name, values in shard["state"].items():
        layout = shard["layout"][name]
        state[name] = {
            key: FlatPiece(value, layout["start"], layout["shape"]) if _is_piece(value, layout["numel"]) else value
            for key, value in values.items()
        }
    return {"state": state, "param_groups": list(shard["param_groups"])}


def _is_piece(value: Any, numel: int) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() == 1 and value.numel() == numel


def save_dcp(
    path: str | Path,
    model_shard: Mapping[str, Any],
    optim_shards: Sequence[Mapping[str, Any]] | Mapping[str, Mapping[str, Any]],
    group: Any = None,
    model_key: str = "model",
) -> None:
    """Writes this rank's model and optimizer shards (``model.sharded_state_dict()`` /
    ``model.sharded_optim_state_dict(optimizer)``) into the DCP folder ``path``, under ``model_key`` and
    ``optimizer_<i>`` (or the keys of a mapping; see [Note: Lightning's keys]). Collective over ``group``
    (``model.process_group``: every rank of the model, replicas included)."""
    if not isinstance(optim_shards, Mapping):
        optim_shards = {f"optimizer_{i}": shard for i, shard in enumerate(optim_shards)}
    state = {model_key: {**_pieces_of(model_shard, aliases=True), **model_shard["buffers"]}}
    state.update((key, _optim_pieces(shard)) for key, shard in optim_shards.items())
    dcp.save(state, checkpoint_id=path, planner=_SavePlanner(), process_group=group)


def optimizer_keys(path: str | Path) -> list[str]:
    """The ``optimizer_<i>`` entries of the DCP folder ``path``, in order (earlier builds: ``optimizer_states``
    items)."""
    paths = FileSystemReader(path).read_metadata().planner_data.values()
    legacy = {p[1] for p in paths if len(p) > 1 and p[0] == _LEGACY_OPTIMIZERS}
    if legacy:
        return [f"optimizer_{i}" for i in range(max(legacy) + 1)]
    found = {int(p[0].removeprefix("optimizer_")) for p in paths if p and re.fullmatch(r"optimizer_\d+", str(p[0]))}
    return [f"optimizer_{i}" for i in range(max(found) + 1)] if found else []


def saved_keys(path: str | Path) -> dict[str, str]:
    """The top-level entries of the DCP folder ``path``, each ``"optimizer"`` (it has ``state`` and
    ``param_groups``, or is an earlier build's list) or ``"module"``."""
    kinds: dict[str, str] = {}
    for path_ in FileSystemReader(path).read_metadata().planner_data.values():
        optimizer = path_[0] == _LEGACY_OPTIMIZERS or (len(path_) > 1 and path_[1] in ("state", "param_groups"))
        if optimizer or path_[0] not in kinds:
            kinds[path_[0]] = "optimizer" if optimizer else "module"
    return kinds


def load_into_module(path: str | Path, module: nn.Module, key: str = "model", strict: bool = True) -> None:
    """The module saved under ``key`` in the DCP folder ``path`` (at any world size), whole, into a plain
    ``module``: what ``fabric.load_raw`` does with a folder. Collective when a process group is initialized."""
    state = {key: module.state_dict()}
    dcp.load(state, checkpoint_id=path, planner=DefaultLoadPlanner(allow_partial_load=not strict))
    module.load_state_dict(state[key], strict=strict)


def load_dcp(
    path: str | Path,
    model: FullyShardedDataParallel,
    optimizers: int | Sequence[str],
    strict: bool = True,
    model_key: str = "model",
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """This rank's model shard and optimizer shards read from the DCP folder ``path`` (written at any world
    size, by this package or Lightning's ``FSDPStrategy``), in the format ``model.load_sharded_state_dict`` and
    ``model.load_sharded_optim_state_dict`` take. ``optimizers``: how many (``optimizer_<i>``), or their keys.
    Collective."""
    metadata = FileSystemReader(path).read_metadata()
    keys = [f"optimizer_{i}" for i in range(optimizers)] if isinstance(optimizers, int) else list(optimizers)
    legacy = any(p[0] == _LEGACY_MODEL for p in metadata.planner_data.values())
    if legacy:
        model_key, prefixes = _LEGACY_MODEL, [(_LEGACY_OPTIMIZERS, int(k.removeprefix("optimizer_"))) for k in keys]
    else:
        prefixes = [(key,) for key in keys]
    mine = model.sharded_state_dict()
    layout = {fqn: {**where, "numel": mine["tensors"][fqn].numel()} for fqn, where in mine["layout"].items()}
    state: dict[str, Any] = {model_key: {**_pieces_of(mine), **mine["buffers"]}}
    templates = [_optim_template(metadata, layout, prefix) for prefix in prefixes]
    if legacy and templates:
        state[_LEGACY_OPTIMIZERS] = templates
    else:
        state.update((prefix[0], template) for prefix, template in zip(prefixes, templates, strict=True))
    planner = _LoadPlanner(allow_partial_load=not strict)
    dcp.load(state, checkpoint_id=path, planner=planner, process_group=model.process_group)
    model_shard = {**mine, "buffers": {k: state[model_key][k] for k in mine["buffers"]}}
    return model_shard, [_optim_shard(t, layout) for t in templates]


def _optim_template(metadata: Any, layout: Mapping[str, Any], prefix: tuple[Any, ...]) -> dict[str, Any]:
    """Buffers for the saved entries, under ``prefix``, of this rank's parameters (found in the metadata)."""
    state: dict[str, dict[str, Any]] = {}
    for flat, path in metadata.planner_data.items():
        if path[: len(prefix) + 1] != (*prefix, "state") or path[len(prefix) + 1] not in layout:
            continue
        name, key = path[len(prefix) + 1], path[len(prefix) + 2]
        md = metadata.state_dict_metadata[flat]
        placeholder: Any = None  # a saved object: DCP puts it here
        if isinstance(md, TensorStorageMetadata):
            shape = layout[name]["shape"]
            if list(md.size) == list(shape):
                piece = torch.zeros(layout[name]["numel"], dtype=md.properties.dtype)
                placeholder = FlatPiece(piece, layout[name]["start"], shape)
            else:
                placeholder = torch.zeros(md.size, dtype=md.properties.dtype)
        state.setdefault(name, {})[key] = placeholder
    return {"state": state, "param_groups": _groups_template(metadata, prefix)}


def _groups_template(metadata: Any, prefix: tuple[Any, ...]) -> list[dict[str, Any]] | None:
    """Where DCP puts the saved ``param_groups``: one object (earlier builds saved a tuple), or a list of groups
    whose every entry DCP saved on its own (a list of dicts is flattened, as Lightning's folders have it)."""
    groups: dict[int, dict[str, Any]] = {}
    at = len(prefix) + 1
    for path in metadata.planner_data.values():
        if path[:at] == (*prefix, "param_groups") and len(path) == at + 2:
            groups.setdefault(int(path[at]), {})[path[at + 1]] = None
    return [groups[i] for i in sorted(groups)] if groups else None


def _optim_shard(loaded: Mapping[str, Any], layout: Mapping[str, Any]) -> dict[str, Any]:
    state = {
        name: {k: v.local if isinstance(v, FlatPiece) else v for k, v in values.items()}
        for name, values in loaded["state"].items()
    }
    pieces = {name: layout[name] for name in state}
    return {"format": SHARDED_FORMAT, "state": state, "layout": pieces, "param_groups": list(loaded["param_groups"])}


def is_dcp_folder(path: str | Path) -> bool:
    """Whether ``path`` is a DCP checkpoint folder (it has DCP's ``.metadata`` file)."""
    return Path(path, ".metadata").is_file()
