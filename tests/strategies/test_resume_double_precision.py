"""A ``precision="64-true"`` run resumes bit for bit under hai_ddp and a pipeline strategy.

The module is built in float32 and ``setup`` converts it to float64. Weights loaded before ``setup`` (where
Lightning's ``ddp`` loads them) pass through the float32 module and resume rounded, about 1e-8 off; our
strategies load them after (``restore_checkpoint_after_setup``). The checkpoint's weights are checked to be
off float32's grid, so that the comparison could see that rounding.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_haiscale.strategies import HaiDDPStrategy, PipeDreamStrategy
from lightning_haiscale.testing.parity import BATCH, Classifier, data
from tests.distributed import run_distributed
from tests.strategies.helpers import quiet_fit

STRATEGIES = {"hai_ddp": HaiDDPStrategy, "hai_pipedream": functools.partial(PipeDreamStrategy, chunks=2)}


def _fit(name: str, tmp: Path, rows: int, **kwargs: Any) -> Classifier:
    module = Classifier()
    quiet_fit(module, STRATEGIES[name](), 6, data(rows), BATCH, precision="64-true", default_root_dir=tmp, **kwargs)
    return module


def _resume(rank: int, world: int, tmp: str) -> dict[str, Any]:
    results = {}
    for name in STRATEGIES:
        folder = Path(tmp) / name
        data_parallel = world if name == "hai_ddp" else 1
        rows = BATCH * 3 * data_parallel  # 3 steps an epoch: the checkpoint at step 3 is an epoch's end
        saver = ModelCheckpoint(dirpath=folder, filename="{step}", every_n_train_steps=3, save_top_k=-1)
        whole = _fit(name, folder, rows, callbacks=[saver], enable_checkpointing=True)
        path = folder / "step=3.ckpt"
        resumed = _fit(name, folder, rows, ckpt_path=path)
        saved = torch.load(path, weights_only=False)["state_dict"]
        expected, got = whole.state_dict(), resumed.state_dict()
        results[name] = {
            "off_float32": all(not torch.equal(v.float().double(), v) for v in saved.values()),
            "equal": sorted(k for k, v in expected.items() if torch.equal(got[k], v)),
            "keys": sorted(expected),
        }
    return results


def test_double_precision_resumes_bit_for_bit(tmp_path: Path) -> None:
    for result in run_distributed(_resume, 2, str(tmp_path), timeout=300):
        for name, r in result.items():
            assert r["off_float32"], name  # rounding through float32 would change every saved tensor
            assert r["equal"] == r["keys"], name
