"""``Trainer(strategy="hai_fsdp")`` against a single process, on externally launched ranks.

One spawn at world 2 checks several behaviours (parity with accumulation and clipping, checkpoints,
bf16; 2 shared cores), one at world 4 resumes its sharded and full checkpoints with the same losses.
The parity check trains with SGD (momentum 0.9; Adam's normalised step would hide a wrong gradient scale) in
float64 (``default_dtype``): relative 1e-9 of each parameter (``FLOAT64_RTOL``, which rounding cannot reach:
[Note: parity tolerances] in lightning_haiscale/testing/parity.py; one rank's gradient scaled by 1 + 1e-6 moves
a parameter by ~1e-7 relative here). The resume checks keep the example's AdamW, whose state (two moments and a
step count per parameter) is what they move between shardings, and compare bit-for-bit; bf16 against fp32 at
its own rounding.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.distributed as dist
from lightning.fabric.accelerators import CPUAccelerator
from lightning.fabric.plugins.environments import LightningEnvironment
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import lightning_haiscale  # noqa: F401  (registers "hai_fsdp")
from examples.gpt.lightning_module import GPTLightningModule
from examples.gpt.model import GPT, Block, config, lm_loss
from lightning_haiscale import fabric
from lightning_haiscale.fsdp import FullyShardedDataParallel
from lightning_haiscale.hfreduce import HFReduceError
from lightning_haiscale.strategies import HaiFSDPStrategy
from lightning_haiscale.testing.parity import FLOAT64_RTOL, default_dtype
from tests.distributed import run_distributed
from tests.fsdp.helpers import deterministic_init
from tests.strategies.helpers import lm_dataset, quiet_fit

CFG = config("tiny", n_layer=2, n_embd=36, n_head=3, vocab_size=67, block_size=16, bias=False)
BATCH = 2  # sequences per rank
LR = 0.5  # the parity check's SGD
# gradient_clip_val: the parity check's gradient norms are 0.0188, 0.0156 and 0.0171, so clipping acts on steps 1
# and 3 (the norm taken across shards) and not on step 2 (where a wrong gradient scale cannot be normalised away)
CLIP = 0.0165


class _GPT(GPTLightningModule):
    """Records whether ``configure_model`` ran on the meta device."""

    built_on_meta: bool | None = None

    def configure_model(self) -> None:
        super().configure_model()
        self.built_on_meta = all(p.is_meta for p in self.model.parameters())


class _SGDGPT(_GPT):
    """The parity check's optimizer: SGD with momentum (so the optimizer has state)."""

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=LR, momentum=0.9)


class _Losses(L.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, outputs: Any, *args: Any) -> None:
        loss = outputs["loss"].detach().reshape(1)
        dist.all_reduce(loss)
        self.losses.append(loss.item() / trainer.world_size)


def _strategy(**kwargs: Any) -> HaiFSDPStrategy:
    return HaiFSDPStrategy(auto_wrap_policy={Block}, param_init_fn=deterministic_init, **kwargs)


def _reference(data: TensorDataset, world: int, steps: int, accumulate: int) -> GPT:
    """One process: every rank's micro-batches, gradients summed per rank then averaged over ranks."""
    ref = GPT(CFG)
    for module in ref.modules():
        deterministic_init(module)
    opt = torch.optim.SGD(ref.parameters(), lr=LR, momentum=0.9)
    rows = [list(DistributedSampler(data, num_replicas=world, rank=r, shuffle=True, seed=0)) for r in range(world)]
    for step in range(steps):
        per_rank = []
        for r in range(world):
            for micro in range(accumulate):
                start = (step * accumulate + micro) * BATCH
                x, y = data[torch.tensor(rows[r][start : start + BATCH])]
                (lm_loss(ref(x), y) / accumulate).backward()
            per_rank.append([p.grad.clone() for p in ref.parameters()])
            opt.zero_grad()
        for p, *grads in zip(ref.parameters(), *per_rank, strict=True):
            p.grad = sum(grads[1:], grads[0].clone()) / world
        torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
    return ref


@default_dtype(torch.float64)
def _parity_accumulation_and_full_checkpoint(rank: int, world: int, tmp: Path) -> None:
    data = lm_dataset(CFG, 6 * world * BATCH)
    module = _SGDGPT(CFG)
    trainer = quiet_fit(module, _strategy(), 3, data, BATCH, accumulate_grad_batches=2, gradient_clip_val=CLIP)
    assert module.built_on_meta, "configure_model ran outside the meta device"
    assert trainer._accelerator_connector.is_distributed
    assert isinstance(trainer.train_dataloader.sampler, DistributedSampler)
    assert isinstance(trainer.strategy.model, FullyShardedDataParallel)
    ref = _reference(data, world, 3, accumulate=2)
    full = trainer.strategy.model.full_state_dict()
    trainer.save_checkpoint(tmp / "full.ckpt")
    if rank == 0:
        for name, q in ref.named_parameters():
            err = (full[f"model.{name}"] - q.detach()).norm() / q.detach().norm()
            assert err <= FLOAT64_RTOL, f"{name}: relative error {err:.2e}"
        bare = GPTLightningModule(CFG)
        bare.configure_model()
        bare.load_state_dict(torch.load(tmp / "full.ckpt", weights_only=True)["state_dict"])  # plain torch.load
        assert all(torch.equal(full[k], v) for k, v in bare.state_dict().items())
    pieces = sum(p.numel() for p in module.parameters())
    assert pieces <= sum(p.numel() for p in ref.parameters()) // world + 2 * len(trainer.strategy.model.layout.units)


def _resume(rank: int, world: int, tmp: Path) -> None:
    # 3 steps an epoch, checkpoints after step 3 (Lightning restarts an interrupted epoch from its start)
    data = lm_dataset(CFG, 3 * world * BATCH)
    whole = _Losses()
    savers = [
        ModelCheckpoint(dirpath=tmp / kind, filename="{step}", every_n_train_steps=3, save_top_k=-1)
        for kind in ("full", "sharded")
    ]
    trainer = quiet_fit(_GPT(CFG), _strategy(), 6, data, BATCH, callbacks=[whole, savers[0]], enable_checkpointing=True)
    expected = trainer.strategy.model.full_state_dict()
    quiet_fit(
        _GPT(CFG),
        _strategy(state_dict_type="sharded"),
        3,
        data,
        BATCH,
        callbacks=[savers[1]],
        enable_checkpointing=True,
    )
    assert (tmp / "sharded" / "step=3.ckpt" / ".metadata").is_file()  # torch.distributed.checkpoint format
    for kind in ("full", "sharded"):
        resumed = _Losses()
        ckpt = tmp / kind / "step=3.ckpt"
        strategy = _strategy(state_dict_type=kind)
        trainer = quiet_fit(_GPT(CFG), strategy, 6, data, BATCH, callbacks=[resumed], ckpt_path=ckpt)
        assert resumed.losses == whole.losses[3:], kind  # bit-for-bit
        got = trainer.strategy.model.full_state_dict()  # rank 0 holds it; {} elsewhere
        assert got.keys() == expected.keys() and all(torch.equal(got[k], v) for k, v in expected.items()), kind
        # The same Trainer validates a fresh module from the checkpoint: the finished fit's optimizers stay out.
        trainer.validate(_GPT(CFG), DataLoader(data, batch_size=BATCH), ckpt_path=ckpt, verbose=False)
        loaded = trainer.strategy.model.full_state_dict()
        if rank == 0 and kind == "full":
            saved = torch.load(ckpt, weights_only=True)["state_dict"]
            assert all(torch.equal(loaded[k], v) for k, v in saved.items())


def _bf16_mixed(rank: int, world: int, tmp: Path) -> None:
    data = lm_dataset(CFG, 2 * world * BATCH)
    fp32, bf16 = _Losses(), _Losses()
    quiet_fit(_GPT(CFG), _strategy(), 2, data, BATCH, callbacks=[fp32])
    trainer = quiet_fit(_GPT(CFG), _strategy(), 2, data, BATCH, callbacks=[bf16], precision="bf16-mixed")
    assert trainer.strategy.model._root_group.param_dtype == torch.bfloat16
    # bf16 keeps 8 mantissa bits (2^-8 = 0.4% a rounding): 2 steps of bf16 matmuls move a loss near 4 by < 2%.
    torch.testing.assert_close(bf16.losses, fp32.losses, rtol=2e-2, atol=0)


def _teardown_closes_the_engine(rank: int, world: int, tmp: Path) -> None:
    """The Trainer's and Fabric's teardown stop the wrapper's engine (as hai_ddp's do); a later call that needs
    one (validation with the same module, a full checkpoint) starts a new one."""
    data = lm_dataset(CFG, 2 * world * BATCH)
    module = _GPT(CFG)
    trainer = quiet_fit(module, _strategy(), 1, data, BATCH)
    wrapper = trainer.strategy.model
    stopped = wrapper.comm
    with pytest.raises(HFReduceError, match="stopped"):
        stopped.barrier()
    assert wrapper.closed
    trainer.limit_val_batches = 1
    trainer.validate(module, DataLoader(data, batch_size=BATCH), verbose=False)  # the same wrapper
    assert trainer.strategy.model is wrapper and wrapper.comm is not stopped and wrapper.closed
    assert (len(wrapper.full_state_dict()) > 0) == (rank == 0)
    wrapper.close()  # idempotent
    strategy = fabric.HaiFSDPStrategy(
        accelerator=CPUAccelerator(),
        cluster_environment=LightningEnvironment(),
        parallel_devices=[torch.device("cpu")] * world,
    )
    wrapped = [strategy.setup_module(nn.Linear(4, 2)), strategy.setup_module(nn.Linear(2, 2))]
    strategy.teardown()
    for model in wrapped:
        with pytest.raises(HFReduceError, match="stopped"):
            model.comm.barrier()


def _run_all(rank: int, world: int, tmp: str, checks: list[Any]) -> None:
    for check in checks:
        check(rank, world, Path(tmp))
        dist.barrier()


def _resume_on_four_ranks(rank: int, world: int, tmp: str) -> list[list[float]]:
    """The world-2 checkpoints at step 3 resume on 4 ranks: the sharded one loads the full one's weights,
    and the next 3 steps' losses are the same from either."""
    data = lm_dataset(CFG, 6 * world * BATCH)
    losses = []
    for kind in ("sharded", "full"):
        resumed = _Losses()
        ckpt = Path(tmp) / kind / "step=3.ckpt"
        trainer = quiet_fit(_GPT(CFG), _strategy(), 6, data, BATCH, callbacks=[resumed], ckpt_path=ckpt)
        assert trainer.global_step == 6
        losses.append(resumed.losses)
    trainer = quiet_fit(_GPT(CFG), _strategy(), 3, data, BATCH, ckpt_path=Path(tmp) / "sharded" / "step=3.ckpt")
    loaded = trainer.strategy.model.full_state_dict()
    if rank == 0:
        saved = torch.load(Path(tmp) / "full" / "step=3.ckpt", weights_only=True)["state_dict"]
        assert loaded.keys() == saved.keys() and all(torch.equal(loaded[k], saved[k]) for k in saved)
    return losses


def test_hai_fsdp_strategy(tmp_path: Path) -> None:
    checks = [_parity_accumulation_and_full_checkpoint, _resume, _bf16_mixed, _teardown_closes_the_engine]
    run_distributed(_run_all, 2, str(tmp_path), checks, timeout=240)
    sharded, full = run_distributed(_resume_on_four_ranks, 4, str(tmp_path), timeout=300)[0]
    assert len(sharded) == 3 and sharded == full  # bit-for-bit


def test_bad_state_dict_type() -> None:
    try:
        HaiFSDPStrategy(state_dict_type="fsdp")  # type: ignore[arg-type]
    except ValueError as e:
        assert "state_dict_type='fsdp'" in str(e)
    else:
        raise AssertionError("expected ValueError")
