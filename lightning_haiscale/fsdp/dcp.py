"""Sharded checkpoints in ``torch.distributed.checkpoint`` (DCP) format, loadable at any world size and
convertible to one file with torch's ``dcp_to_torch_save``.

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
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
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

__all__ = ["FlatPiece", "boxes", "is_dcp_folder", "load_dcp", "save_dcp"]


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
    return {"state": state, "param_groups": tuple(shard["param_groups"])}


def _is_piece(value: Any, numel: int) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() == 1 and value.numel() == numel


def save_dcp(
    path: str | Path, model_shard: Mapping[str, Any], optim_shards: Sequence[Mapping[str, Any]], group: Any = None
) -> None:
    """Writes this rank's model and optimizer shards (``model.sharded_state_dict()`` /
    ``model.sharded_optim_state_dict(optimizer)``) into the DCP folder ``path``. Collective over ``group``
    (``model.process_group``: every rank of the model, replicas included)."""
    state = {
        "state_dict": {**_pieces_of(model_shard, aliases=True), **model_shard["buffers"]},
        "optimizer_states": [_optim_pieces(shard) for shard in optim_shards],
    }
    dcp.save(state, checkpoint_id=path, planner=_SavePlanner(), process_group=group)


def load_dcp(
    path: str | Path, model: FullyShardedDataParallel, num_optimizers: int, strict: bool = True
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """This rank's model shard and optimizer shards read from the DCP folder ``path`` (written at any world
    size), in the format ``model.load_sharded_state_dict`` and ``model.load_sharded_optim_state_dict`` take.
    Collective."""
    metadata = FileSystemReader(path).read_metadata()
    mine = model.sharded_state_dict()
    layout = {fqn: {**where, "numel": mine["tensors"][fqn].numel()} for fqn, where in mine["layout"].items()}
    state: dict[str, Any] = {"state_dict": {**_pieces_of(mine), **mine["buffers"]}}
    optimizers = [_optim_template(metadata, layout, i) for i in range(num_optimizers)]
    if optimizers:
        state["optimizer_states"] = optimizers
    planner = _LoadPlanner(allow_partial_load=not strict)
    dcp.load(state, checkpoint_id=path, planner=planner, process_group=model.process_group)
    model_shard = {**mine, "buffers": {k: state["state_dict"][k] for k in mine["buffers"]}}
    return model_shard, [_optim_shard(o, layout) for o in state.get("optimizer_states", [])]


def _optim_template(metadata: Any, layout: Mapping[str, Any], index: int) -> dict[str, Any]:
    """Buffers for optimizer ``index``'s saved entries of this rank's parameters (found in the metadata)."""
    state: dict[str, dict[str, Any]] = {}
    for flat, path in metadata.planner_data.items():
        if path[:3] != ("optimizer_states", index, "state") or path[3] not in layout:
            continue
        name, key = path[3], path[4]
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
    return {"state": state, "param_groups": None}


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
