"""Lightning's checks and messages, written from its own unit tests (2.6.5's ``tests_fabric/strategies/test_fsdp.py``
and ``tests_pytorch/strategies/test_fsdp.py``), where they test public behaviour rather than torch-FSDP internals.

Was (each run with ``HaiFSDPStrategy`` in place of Lightning's class): a load from a folder that is no checkpoint
raised torch's ``IsADirectoryError`` (Lightning: ``ValueError: ... does not point to a valid checkpoint``, and
``load_raw``: ``The given path must be a single file ...``); a state without a set-up module, with two, or ``None``,
and an optimizer loaded alone, raised errors whose messages Lightning's tests do not find; so did gradient clipping of
a module not set up. One process, no training: these are checks made before anything is read or written.
"""

from __future__ import annotations

from pathlib import Path
from re import escape
from unittest.mock import Mock

import pytest
import torch
from torch import nn

from lightning_haiscale.fabric import HaiFSDPStrategy as FabricHaiFSDP
from lightning_haiscale.strategies import HaiFSDPStrategy

_NOT_A_CHECKPOINT = "does not point to a valid checkpoint"


def test_fabric_state_checks(tmp_path: Path) -> None:
    # test_load_checkpoint_no_state, test_save/load_checkpoint_one_fsdp_module_required,
    # test_load_raw_checkpoint_optimizer_unsupported
    strategy = FabricHaiFSDP()
    for state in (None, {}):
        with pytest.raises(ValueError, match=escape(f"FSDPStrategy.load_checkpoint(..., state={state!r})")):
            strategy.load_checkpoint(path=tmp_path, state=state)
    for state in ({}, {"model": nn.Linear(3, 3)}):
        with pytest.raises(ValueError, match=r"Could not find a FSDP model in the provided checkpoint state\."):
            strategy.save_checkpoint(path=tmp_path / "x", state=state)
    with pytest.raises(ValueError, match=r"Could not find a FSDP model in the provided checkpoint state\."):
        strategy.load_checkpoint(path=tmp_path, state={"other": "data"})
    optimizer = Mock(spec=torch.optim.Optimizer)
    with pytest.raises(NotImplementedError, match="Loading a single optimizer object from a checkpoint is not"):
        strategy.load_checkpoint(path=tmp_path, state=optimizer)


def test_fabric_a_folder_that_is_no_checkpoint(tmp_path: Path) -> None:
    # test_load_raw_checkpoint_validate_single_file; a DCP folder is taken too (see test_fabric_fsdp_surface.py)
    folder = tmp_path / "folder"
    folder.mkdir()
    with pytest.raises(ValueError, match="The given path must be a single file containing the full state dict"):
        FabricHaiFSDP().load_checkpoint(path=folder, state=nn.Linear(2, 2))


def test_fabric_clipping_needs_the_set_up_module() -> None:
    # test_grad_clipping_norm_error
    with pytest.raises(TypeError, match=r"only possible if the module.*is wrapped in `FullyShardedDataParallel`"):
        FabricHaiFSDP().clip_gradients_norm(Mock(), Mock(), Mock())


def test_trainer_a_folder_that_is_no_checkpoint(tmp_path: Path) -> None:
    # test_load_unknown_checkpoint_type: refused before the model is looked at; a file is read as before
    folder = tmp_path / "empty_dir"
    folder.mkdir()
    with pytest.raises(ValueError, match=_NOT_A_CHECKPOINT):
        HaiFSDPStrategy().load_checkpoint(checkpoint_path=folder)
    (folder / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match=escape(str(folder))):
        HaiFSDPStrategy().load_checkpoint(checkpoint_path=folder)
