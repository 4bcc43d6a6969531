"""A checkpoint written under one strategy resumes under ``hai_fsdp`` with its optimizer state, and a hai_fsdp
full checkpoint resumes under ddp, hai_ddp and one device.

Was: a ddp, hai_ddp or single-device checkpoint failed with ``KeyError: 0`` in ``fsdp/optim_state.py``:
torch keys optimizer states by position, hai_fsdp expected parameter names. SGD with momentum (whose
buffers change every later step, so a lost state shows) in two parameter groups (positions run across
groups); ddp into hai_fsdp also with AdamW, whose state (two moments and a step count per parameter) is the
point there: this test compares a resumed run with its own source, not with a reference, so Adam's normalised
step hides nothing it checks (a lost or misplaced moment changes the next update by order lr). Each source
trains 6 steps with a checkpoint at step 3; resuming at step 3 under another strategy must give the source's
own losses for steps 4-6: bit-for-bit
from hai_fsdp checkpoints into hai_fsdp, and across strategies (a different reduction order; one device sums
the batch in one piece) in float64 (``default_dtype``) to a relative 1e-9 (``FLOAT64_RTOL``, which rounding
cannot reach: [Note: parity tolerances] in lightning_haiscale/testing/parity.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, DistributedSampler, Sampler

import lightning_haiscale  # noqa: F401  (registers the strategies)
from examples.gpt.model import Block
from lightning_haiscale.strategies import HaiFSDPStrategy
from lightning_haiscale.testing.parity import FLOAT64_RTOL, default_dtype
from tests.distributed import run_distributed
from tests.fsdp.helpers import deterministic_init
from tests.strategies.helpers import lm_dataset, quiet_fit
from tests.strategies.test_hai_fsdp import _GPT, CFG, _Losses

BATCH = 2  # sequences per rank; one device takes both ranks' rows


class _MomentumGPT(_GPT):
    def configure_optimizers(self) -> torch.optim.Optimizer:
        norms = [p for n, p in self.named_parameters() if ".ln" in n]
        others = [p for n, p in self.named_parameters() if ".ln" not in n]
        groups = [{"params": others, "weight_decay": 1e-2}, {"params": norms, "weight_decay": 0.0}]
        return torch.optim.SGD(groups, lr=0.5, momentum=0.9)


class _AdamWGPT(_MomentumGPT):
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=1e-2)


def _module(name: str) -> _GPT:
    torch.manual_seed(0)
    return _AdamWGPT(CFG) if name.endswith("adamw") else _MomentumGPT(CFG)


def _strategy(name: str) -> Any:
    if name.startswith("hai_fsdp"):
        kind = "sharded" if name.endswith("sharded") else "full"
        return HaiFSDPStrategy(auto_wrap_policy={Block}, param_init_fn=deterministic_init, state_dict_type=kind)
    return name.removesuffix("_adamw")


def _train(name: str, tmp: Path, world: int) -> list[float]:
    """6 steps (two epochs of 3) under ``name``, saving at step 3 (an epoch boundary: see test_hai_ddp)."""
    data = lm_dataset(CFG, 3 * 2 * BATCH)
    losses = _Losses()
    saver = ModelCheckpoint(dirpath=tmp / name, filename="{step}", every_n_train_steps=3, save_top_k=-1)
    batch, callbacks = BATCH * 2 // world, [losses, saver]
    quiet_fit(_module(name), _strategy(name), 6, data, batch, callbacks=callbacks, enable_checkpointing=True)
    return losses.losses


class _TwoRanksOrder(Sampler[int]):
    """The rows that Lightning's sampler deals to 2 ranks (shuffled, seed 0), rank 0's then rank 1's per step:
    one device sees each step's rows of the 2-process runs."""

    def __init__(self, data: Any) -> None:
        self.ranks = [DistributedSampler(data, num_replicas=2, rank=r, shuffle=True, seed=0) for r in range(2)]

    def set_epoch(self, epoch: int) -> None:
        for sampler in self.ranks:
            sampler.set_epoch(epoch)

    def __iter__(self) -> Iterator[int]:
        rows = [list(sampler) for sampler in self.ranks]
        for start in range(0, len(rows[0]), BATCH):
            yield from (i for ranked in rows for i in ranked[start : start + BATCH])

    def __len__(self) -> int:
        return sum(len(sampler) for sampler in self.ranks)


@default_dtype(torch.float64)
def _single_device(rank: int, world: int, tmp: str, resume_from: str | None = None) -> list[float]:
    """6 steps on one device, saving at step 3; or, from ``resume_from``'s step-3 checkpoint, steps 4-6."""
    data = lm_dataset(CFG, 3 * 2 * BATCH)
    losses = _Losses()
    saver = ModelCheckpoint(dirpath=Path(tmp, "single_device"), filename="{step}", every_n_train_steps=3, save_top_k=-1)
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=6, logger=False, callbacks=[losses, saver], enable_progress_bar=False,
        enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0,
    )  # fmt: skip
    ckpt = None if resume_from is None else Path(tmp, resume_from, "step=3.ckpt")
    loader = DataLoader(data, batch_size=2 * BATCH, sampler=_TwoRanksOrder(data))
    trainer.fit(_module("single_device"), loader, ckpt_path=ckpt)
    return losses.losses


@default_dtype(torch.float64)
def _resume_under_hai_fsdp(rank: int, world: int, tmp: str, sources: list[str]) -> dict[str, tuple[list, list]]:
    results = {}
    for source in sources:
        whole = _train(source, Path(tmp), world) if source != "single_device" else []  # saved by one process
        resumed = _Losses()
        data = lm_dataset(CFG, 3 * 2 * BATCH)
        ckpt = Path(tmp, source, "step=3.ckpt")
        quiet_fit(_module(source), _strategy("hai_fsdp"), 6, data, BATCH, callbacks=[resumed], ckpt_path=ckpt)
        results[source] = (whole[3:], resumed.losses)
        if source == "hai_fsdp":  # and back: a hai_fsdp full checkpoint resumes under ddp and hai_ddp
            for target in ("ddp", "hai_ddp"):
                back = _Losses()
                quiet_fit(_module(target), target, 6, data, BATCH, callbacks=[back], ckpt_path=ckpt)
                results[f"hai_fsdp->{target}"] = (whole[3:], back.losses)
    return results


def test_checkpoints_resume_across_strategies(tmp_path: Path) -> None:
    single = run_distributed(_single_device, 1, str(tmp_path), timeout=120)[0]
    sources = ["ddp", "hai_ddp", "hai_fsdp", "hai_fsdp_sharded", "ddp_adamw"]
    results = run_distributed(_resume_under_hai_fsdp, 2, str(tmp_path), [*sources, "single_device"], timeout=400)[0]
    results["single_device"] = (single[3:], results["single_device"][1])
    back = run_distributed(_single_device, 1, str(tmp_path), "hai_fsdp", timeout=120)[0]
    results["hai_fsdp->single_device"] = (results["hai_fsdp"][0], back)
    for source, (expected, resumed) in results.items():
        assert len(resumed) == 3, source
        if source in ("hai_fsdp", "hai_fsdp_sharded"):
            assert resumed == expected, source  # bit-for-bit
        else:
            torch.testing.assert_close(resumed, expected, rtol=FLOAT64_RTOL, atol=0, msg=source)
