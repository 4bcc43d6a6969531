"""No save removes what the library did not write: a directory of the user's files at a checkpoint's path survives
every save path, Trainer and Fabric, full and sharded, and the pipeline's stage files.

Was: ``trainer.save_checkpoint(path)`` / ``fabric.save(path, state)`` with a full state dict, ``path`` an existing
directory, deleted the directory and everything in it (the atomic swap exchanged it with the new file, then removed
"the previous save"); a sharded save removed the folder's other files, then refused them (``FileExistsError``).
Lightning's ``FSDPStrategy`` raises ``IsADirectoryError("The checkpoint path exists and is a directory: ...")`` on a
full save and touches nothing, and writes a sharded save into the folder, keeping the user's ``file``, or turns a
file at the path into the folder (its ``tests_pytorch/strategies/test_fsdp.py::test_save_checkpoint_path_exists``);
so must every strategy here. What a save may replace, it still replaces: a previous checkpoint of the same kind, and
(as Lightning's FSDP) a sharded folder under a full save.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.distributed as dist
from lightning.fabric import Fabric
from torch.utils.data import DataLoader

import lightning_haiscale  # noqa: F401  (registers the strategies)
from lightning_haiscale.adapter.checkpoint_files import file_target_error, folder_checkpoint, writes_in_place
from lightning_haiscale.fabric import HaiFSDPStrategy as FabricHaiFSDP
from lightning_haiscale.strategies import HaiFSDPStrategy, PipeDreamStrategy
from lightning_haiscale.testing.parity import BATCH, Classifier, data
from tests.distributed import run_distributed

_LIGHTNING_MESSAGE = "The checkpoint path exists and is a directory"


def _user_folder(path: Path) -> dict[str, bytes]:
    """A directory of the user's own files at ``path`` (rank 0 makes it); returns what it must still hold."""
    files = {"notes.txt": b"days of work", "sub/data.bin": bytes(range(7))}
    if dist.get_rank() == 0:
        for name, content in files.items():
            (path / name).parent.mkdir(parents=True, exist_ok=True)
            (path / name).write_bytes(content)
    dist.barrier()
    return files


def _untouched(path: Path, files: dict[str, bytes]) -> None:
    found = {str(p.relative_to(path)): p.read_bytes() for p in path.rglob("*") if p.is_file()}
    assert found == files, path
    assert not [p for p in path.parent.iterdir() if p.name.startswith(f".{path.name}.")], "staging left behind"


def _refused(save: Callable[[Path], None], path: Path, error: type[Exception], match: str) -> None:
    files = _user_folder(path)
    with pytest.raises(error, match=match):
        save(path)
    dist.barrier()
    _untouched(path, files)


def _kept(save: Callable[[Path], None], load: Callable[[Path], Any], path: Path) -> None:
    """A sharded save into a folder of the user's files, holding an earlier checkpoint's stale shard and metadata,
    keeps the user's files, replaces the rest, and loads back."""
    files = _user_folder(path)
    if dist.get_rank() == 0:
        for name in ("__9_0.distcp", "meta.pt", ".metadata"):
            (path / name).write_bytes(b"stale")
    dist.barrier()
    save(path)
    dist.barrier()
    found = {str(p.relative_to(path)): p.read_bytes() for p in path.rglob("*") if p.is_file()}
    assert {n: found.get(n) for n in files} == files, path
    assert sorted(set(found) - set(files)) == [".metadata", "__0_0.distcp", "__1_0.distcp", "meta.pt"], sorted(found)
    assert found["meta.pt"] != b"stale" and found[".metadata"] != b"stale"
    load(path)
    dist.barrier()


def _fit(strategy: Any, tmp: Path) -> L.Trainer:
    trainer = L.Trainer(
        strategy=strategy, accelerator="cpu", devices=dist.get_world_size(), max_steps=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
        default_root_dir=tmp,
    )  # fmt: skip
    trainer.fit(Classifier(), DataLoader(data(4 * BATCH), batch_size=BATCH))
    return trainer


def _trainer_saves(rank: int, world: int, tmp: str) -> None:
    tmp_path = Path(tmp)
    for name, strategy in {
        "hai_ddp": "hai_ddp",
        "hai_fsdp": HaiFSDPStrategy(),
        "hai_pipedream": PipeDreamStrategy(chunks=2),
    }.items():
        trainer = _fit(strategy, tmp_path)
        _refused(trainer.save_checkpoint, tmp_path / f"{name}.ckpt", IsADirectoryError, _LIGHTNING_MESSAGE)
    pipeline = trainer  # the last: 2 stages
    # The pipeline's stage files: a directory where stage 1's file goes refuses the save before any file is written.
    path = tmp_path / "stages.ckpt"
    _refused(lambda _: pipeline.save_checkpoint(path), Path(f"{path}.stage1"), IsADirectoryError, _LIGHTNING_MESSAGE)
    assert not path.exists() and not Path(f"{path}.stage0").exists()
    # A user's file named like a stage file survives two saves and the checkpoint's removal.
    path = tmp_path / "kept.ckpt"
    mine = Path(f"{path}.stage0.txt")
    if rank == 0:
        mine.write_bytes(b"mine")
    dist.barrier()
    pipeline.save_checkpoint(path)
    pipeline.save_checkpoint(path)  # the second save replaces the first's stage files, and only those
    dist.barrier()
    names = sorted(p.name for p in tmp_path.glob("kept.ckpt*"))
    assert names == ["kept.ckpt", "kept.ckpt.stage0", "kept.ckpt.stage0.txt", "kept.ckpt.stage1"], names
    dist.barrier()  # every rank looked before any removes
    pipeline.strategy.remove_checkpoint(path)
    dist.barrier()
    assert [p.name for p in tmp_path.glob("kept.ckpt*")] == ["kept.ckpt.stage0.txt"]

    sharded = _fit(HaiFSDPStrategy(state_dict_type="sharded"), tmp_path)
    _kept(sharded.save_checkpoint, sharded.strategy.load_checkpoint, tmp_path / "sharded")
    file = tmp_path / "file.pt"
    if rank == 0:
        file.write_bytes(b"")
    dist.barrier()
    sharded.save_checkpoint(file)  # a file at the path becomes the folder, as in Lightning's FSDP
    assert (file / "meta.pt").is_file()
    folder = tmp_path / "empty"
    if rank == 0:
        folder.mkdir()
    dist.barrier()
    sharded.save_checkpoint(folder)  # an empty folder is taken, as Lightning's FSDP takes it
    sharded.save_checkpoint(folder)  # and a checkpoint replaces the previous one
    assert (folder / "meta.pt").is_file() and (folder / ".metadata").is_file()
    full = _fit(HaiFSDPStrategy(), tmp_path)
    full.save_checkpoint(folder)  # a full save replaces a sharded checkpoint folder (Lightning's FSDP does too)
    dist.barrier()
    assert folder.is_file()


def _fabric_save(fabric: Fabric, path: Path, state: dict[str, Any]) -> None:
    fabric.save(path, state)


def _fabric_saves(rank: int, world: int, tmp: str) -> None:
    tmp_path = Path(tmp)
    for name, strategy in {
        "hai_ddp": "hai_ddp",
        "hai_fsdp": FabricHaiFSDP(),
        "hai_fsdp_sharded": FabricHaiFSDP(state_dict_type="sharded"),
    }.items():
        fabric = Fabric(accelerator="cpu", devices=world, strategy=strategy)
        fabric.launch()
        model = Classifier()
        model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
        state = {"model": model, "optimizer": optimizer, "step": 1}
        save = functools.partial(_fabric_save, fabric, state=state)
        if name.endswith("sharded"):
            _kept(save, functools.partial(fabric.load, state=state), tmp_path / name)
        else:
            _refused(save, tmp_path / name, IsADirectoryError, _LIGHTNING_MESSAGE)


def test_trainer_saves_keep_the_users_files(tmp_path: Path) -> None:
    run_distributed(_trainer_saves, 2, str(tmp_path), timeout=300)


def test_fabric_saves_keep_the_users_files(tmp_path: Path) -> None:
    run_distributed(_fabric_saves, 2, str(tmp_path), timeout=300)


def test_what_a_save_may_replace(tmp_path: Path) -> None:
    """The pure checks: a file save takes an absent path, a file and our checkpoint folder; a folder save swaps in
    over an absent path, a file, an empty folder and our checkpoint folder (0.1's ``rank_<r>.pt`` form included), and
    writes in place into a folder of the user's."""
    ours, old, user, empty = (tmp_path / n for n in ("ours", "old", "user", "empty"))
    for folder, names in ((ours, [".metadata", "__0_0.distcp", "meta.pt"]), (old, ["meta.pt", "rank_0.pt"])):
        folder.mkdir()
        for name in names:
            (folder / name).write_bytes(b"")
    user.mkdir()
    (user / "meta.pt").write_bytes(b"")
    (user / "notes.txt").write_bytes(b"")
    empty.mkdir()
    (tmp_path / "file").write_bytes(b"")
    for path in (tmp_path / "absent", tmp_path / "file", ours, old):
        assert file_target_error(path) is None and not writes_in_place(path), path
    assert isinstance(file_target_error(user), IsADirectoryError)
    assert isinstance(file_target_error(empty), IsADirectoryError)  # as Lightning's: only a checkpoint folder
    assert not writes_in_place(empty) and writes_in_place(user)


def test_a_save_in_place_removes_the_metadata_first(tmp_path: Path) -> None:
    """Metadata last, as torch's DCP: while the ranks write into a folder of the user's, the previous checkpoint's
    ``.metadata`` and ``meta.pt`` are already gone (a kill then leaves no folder a load takes for a checkpoint), so
    are its stale shards; the user's file and directories (even one named like a shard) stay."""
    folder = tmp_path / "ckpt"
    (folder / "x.distcp").mkdir(parents=True)
    for name in (".metadata", "meta.pt", "__0_0.distcp", "__3_0.distcp", "rank_0.pt", "file"):
        (folder / name).write_bytes(b"old")
    with folder_checkpoint(folder, publisher=True, barrier=lambda: None) as target:
        assert target == folder
        assert sorted(e.name for e in folder.iterdir()) == ["file", "x.distcp"]
        (target / "__0_0.distcp").write_bytes(b"new")
        (target / "meta.pt").write_bytes(b"new")
    assert sorted(e.name for e in folder.iterdir()) == ["__0_0.distcp", "file", "meta.pt", "x.distcp"]
    assert (folder / "file").read_bytes() == b"old" and (folder / "meta.pt").read_bytes() == b"new"
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]  # no staging sibling


def test_removing_a_sharded_checkpoint_keeps_the_users_files(tmp_path: Path) -> None:
    """``ModelCheckpoint(save_top_k=)`` removes older checkpoints through ``remove_checkpoint``: a folder holding
    the user's entries beside our checkpoint keeps them (was: removed whole, as Lightning's ``TorchCheckpointIO``
    does); a folder of ours alone goes."""
    shared, ours = tmp_path / "shared", tmp_path / "ours"
    for folder in (shared, ours):
        folder.mkdir()
        for name in (".metadata", "meta.pt", "__0_0.distcp"):
            (folder / name).write_bytes(b"")
    (shared / "notes.txt").write_bytes(b"mine")
    strategy = HaiFSDPStrategy(state_dict_type="sharded")
    strategy.remove_checkpoint(shared)
    strategy.remove_checkpoint(ours)
    assert [p.name for p in shared.iterdir()] == ["notes.txt"] and not ours.exists()
