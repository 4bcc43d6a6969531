"""``Trainer(strategy="hai_ddp")`` against Lightning's ``"ddp"`` and a single-process run, on externally launched ranks.

One spawn checks several behaviours (the machine has 2 cores). Every check trains with SGD (momentum 0.9: Adam's
normalised step would hide a wrong gradient scale) in float64 (``_run_all`` builds modules, data and optimizers
under ``default_dtype``; the spawn test uses ``precision="64-true"``), so the tolerance, relative 1e-9 of each
parameter's norm (``FLOAT64_RTOL``), cannot be reached by another summation order
(lightning_haiscale/testing/parity.py, [Note: parity tolerances]); a resumed run's losses and weights equal the
uninterrupted run's bit-for-bit (with the same SGD momentum buffers).
"""

from __future__ import annotations

import copy
import inspect
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.accelerators import CPUAccelerator
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.utils.data import DistributedSampler, TensorDataset

import lightning_haiscale  # noqa: F401  (registers "hai_ddp")
from examples.gpt.lightning_module import GPTLightningModule
from examples.gpt.model import config, lm_loss
from lightning_haiscale.ddp import DistributedDataParallel
from lightning_haiscale.strategies import HaiDDPStrategy
from lightning_haiscale.testing.parity import FLOAT64_ATOL, FLOAT64_RTOL, default_dtype
from tests.distributed import run_distributed
from tests.strategies.helpers import lm_dataset, quiet_fit

CFG = config("tiny", n_layer=2, n_embd=32, n_head=2, block_size=16, bias=False)  # see tests/ddp: no biases
BATCH = 2  # sequences per rank
LR = 0.5  # SGD's


class _SGDGPT(GPTLightningModule):
    """The GPT example's module with the parity tests' optimizer."""

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=LR, momentum=0.9)


class _Losses(L.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, outputs: Any, *args: Any) -> None:
        if outputs is not None:
            self.losses.append(float(outputs["loss"]))


def _gpt_module() -> _SGDGPT:
    torch.manual_seed(0)
    module = _SGDGPT(CFG)
    module.configure_model()  # weights known before fit, for the reference
    return module


def _assert_close(model: nn.Module, ref: nn.Module, rel: float = FLOAT64_RTOL) -> None:
    """Relative error of each parameter's norm, for float64 runs (the module docstring)."""
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        err = (p.detach() - q.detach()).norm() / q.detach().norm().clamp_min(1e-12)
        assert err <= rel, f"{name}: relative error {err:.2e} > {rel}"


def _reference(module: GPTLightningModule, world: int, steps: int, data: TensorDataset) -> nn.Module:
    """One process whose batch is every rank's batch of the step, dealt as Lightning's sampler deals them."""
    ref = copy.deepcopy(module.model)
    opt = torch.optim.SGD(ref.parameters(), lr=LR, momentum=0.9)
    samplers = [DistributedSampler(data, num_replicas=world, rank=r, shuffle=True, seed=0) for r in range(world)]
    for step in range(steps):
        rows = [i for s in samplers for i in list(s)[step * BATCH : (step + 1) * BATCH]]  # within epoch 0
        x, y = data[torch.tensor(rows)]
        lm_loss(ref(x), y).backward()
        opt.step()
        opt.zero_grad()
    return ref


def _parity_with_ddp_and_one_process(rank: int, world: int, tmp: Path) -> None:
    data = lm_dataset(CFG, 10 * world * BATCH)
    ours, theirs = _gpt_module(), _gpt_module()
    ref = _reference(ours, world, 10, data)
    trainer = quiet_fit(ours, "hai_ddp", 10, data, BATCH)
    assert isinstance(trainer.strategy, HaiDDPStrategy)
    assert not isinstance(trainer.strategy.model, DistributedDataParallel), "teardown unwraps the model"
    trainer.save_checkpoint(tmp / "hai.ckpt")
    ddp_trainer = quiet_fit(theirs, "ddp", 10, data, BATCH)
    ddp_trainer.save_checkpoint(tmp / "ddp.ckpt")
    _assert_close(ours.model, ref)
    _assert_close(ours.model, theirs.model)
    hai, ddp = (torch.load(tmp / f"{n}.ckpt", weights_only=False) for n in ("hai", "ddp"))
    assert hai.keys() == ddp.keys() and hai["state_dict"].keys() == ddp["state_dict"].keys()


def _accumulation_matches_ddp(rank: int, world: int, tmp: Path) -> None:
    data = lm_dataset(CFG, 12 * world * BATCH)
    ours, theirs = _gpt_module(), _gpt_module()
    quiet_fit(ours, "hai_ddp", 3, data, BATCH, accumulate_grad_batches=4)
    quiet_fit(theirs, "ddp", 3, data, BATCH, accumulate_grad_batches=4)
    _assert_close(ours.model, theirs.model)


def _resume_gives_same_losses(rank: int, world: int, tmp: Path) -> None:
    # 3 steps an epoch, checkpoint after step 3: Lightning restarts an interrupted epoch's data from its
    # start (with any strategy), so only a checkpoint at an epoch boundary resumes the same batches.
    data = lm_dataset(CFG, 3 * world * BATCH)
    whole, resumed = _Losses(), _Losses()
    saver = ModelCheckpoint(dirpath=tmp / "ckpt", filename="{step}", every_n_train_steps=3, save_top_k=-1)
    first, second = _gpt_module(), _gpt_module()
    quiet_fit(first, "hai_ddp", 6, data, BATCH, callbacks=[whole, saver], enable_checkpointing=True)
    quiet_fit(second, "hai_ddp", 6, data, BATCH, callbacks=[resumed], ckpt_path=tmp / "ckpt" / "step=3.ckpt")
    assert len(resumed.losses) == 3
    assert resumed.losses == whole.losses[3:]  # bit-for-bit
    expected = first.state_dict()
    assert all(torch.equal(v, expected[k]) for k, v in second.state_dict().items())


class _ManualGPT(_SGDGPT):
    def __init__(self, cfg: Any) -> None:
        super().__init__(cfg)
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        opt = self.optimizers()
        x, y = batch
        loss = lm_loss(self(x), y)
        self.manual_backward(loss)
        opt.step()
        opt.zero_grad()
        return loss


def _manual_optimization_matches_ddp(rank: int, world: int, tmp: Path) -> None:
    data = lm_dataset(CFG, 5 * world * BATCH)
    modules = []
    for strategy in ("hai_ddp", "ddp"):
        torch.manual_seed(0)
        module = _ManualGPT(CFG)
        module.configure_model()
        quiet_fit(module, strategy, 5, data, BATCH)
        modules.append(module)
    _assert_close(modules[0].model, modules[1].model)


def _lightning_demo_model_trains(rank: int, world: int, tmp: Path) -> None:
    models = []
    for strategy in ("hai_ddp", "ddp"):
        torch.manual_seed(0)
        model = BoringModel()
        initial = copy.deepcopy(model.layer)
        trainer = L.Trainer(
            strategy=strategy, accelerator="cpu", devices=world, max_steps=5, logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0,
        )  # fmt: skip
        trainer.fit(model)
        assert not torch.equal(model.layer.weight, initial.weight)
        models.append(model)
    _assert_close(models[0], models[1])


@default_dtype(torch.float64)
def _run_all(rank: int, world: int, tmp: str, checks: list[Any]) -> None:
    for check in checks:
        check(rank, world, Path(tmp))
        dist.barrier()


def test_hai_ddp_on_two_processes(tmp_path: Path) -> None:
    checks = [
        _parity_with_ddp_and_one_process,
        _accumulation_matches_ddp,
        _resume_gives_same_losses,
        _manual_optimization_matches_ddp,
        _lightning_demo_model_trains,
    ]
    run_distributed(_run_all, 2, str(tmp_path), checks, timeout=240)


def _two_hosts(rank: int, world: int, tmp: Path) -> None:
    data = lm_dataset(CFG, 4 * world * BATCH)
    ours, theirs = _gpt_module(), _gpt_module()
    ref = _reference(ours, world, 4, data)
    trainer = quiet_fit(ours, "hai_ddp", 4, data, BATCH, devices=2, num_nodes=2)
    assert trainer.strategy.model is ours  # unwrapped after fit
    quiet_fit(theirs, "ddp", 4, data, BATCH, devices=2, num_nodes=2)
    _assert_close(ours.model, ref)
    _assert_close(ours.model, theirs.model)


def test_hai_ddp_on_two_hosts_of_two_ranks(tmp_path: Path) -> None:
    run_distributed(_run_all, 4, str(tmp_path), [_two_hosts], node_ids=["a", "a", "b", "b"], timeout=240)


def _boring_ddp_weights(rank: int, world: int) -> dict[str, list]:
    torch.manual_seed(0)
    model = BoringModel()
    L.Trainer(strategy="ddp", **_BORING).fit(model)
    return {k: v.tolist() for k, v in model.state_dict().items()}  # plain values: tensors would be sent by fd


_BORING: dict[str, Any] = {
    "accelerator": "cpu", "devices": 2, "max_steps": 3, "logger": False, "enable_checkpointing": False,
    "enable_progress_bar": False, "enable_model_summary": False, "limit_val_batches": 0, "num_sanity_val_steps": 0,
    "precision": "64-true",  # float64: the comparison below is at FLOAT64 tolerances
}  # fmt: skip


def test_hai_ddp_spawn_returns_trained_weights(monkeypatch: pytest.MonkeyPatch) -> None:
    """Lightning's spawn launcher starts the processes; the trained weights come back to this one and equal
    Lightning "ddp"'s on the same data. (The reference runs on externally launched ranks: a "ddp_spawn" run
    right after a spawn run in one pytest process intermittently aborted at exit inside torch, 1 run in 3.)"""
    for leaked in ("PL_GLOBAL_SEED", "PL_SEED_WORKERS"):  # an earlier seed_everything() would reseed the spawns
        monkeypatch.delenv(leaked, raising=False)
    torch.manual_seed(0)
    model = BoringModel()
    initial = model.layer.weight.detach().clone()
    trainer = L.Trainer(strategy="hai_ddp_spawn", **_BORING)
    trainer.fit(model)
    assert isinstance(trainer.strategy, HaiDDPStrategy)
    assert not torch.equal(model.layer.weight, initial)
    reference = run_distributed(_boring_ddp_weights, 2)[0]
    for name, value in model.state_dict().items():
        torch.testing.assert_close(
            value, torch.tensor(reference[name], dtype=value.dtype), rtol=FLOAT64_RTOL, atol=FLOAT64_ATOL
        )


@pytest.mark.parametrize("option", [{"static_graph": True}, {"ddp_comm_hook": lambda state, bucket: None}])
def test_torch_ddp_options_are_refused_not_ignored(option: dict[str, Any]) -> None:
    with pytest.raises(TypeError, match=rf"does not take \['{next(iter(option))}'\].*bucket_cap_mb"):
        HaiDDPStrategy(**option)
    HaiDDPStrategy(bucket_cap_mb=10, timeout=timedelta(seconds=30), start_method="spawn")  # Lightning's own: fine


def test_configure_ddp_on_a_cuda_root_device_wraps_without_torch_comm_hooks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Lightning's configure_ddp asserts on CUDA that the model is torch's DDP (to register comm hooks):
    reached on CPU by giving the strategy a cuda:0 device and a stand-in for the engine-backed wrapper."""
    wrapped: list[dict[str, Any]] = []

    class _Wrapper(nn.Module):
        def __init__(self, module: nn.Module, **kwargs: Any) -> None:
            super().__init__()
            self.module = module
            wrapped.append(kwargs)

    monkeypatch.setattr("lightning_haiscale.adapter.ddp_options.DistributedDataParallel", _Wrapper)
    engine = object()
    monkeypatch.setattr("lightning_haiscale.adapter.ddp_options.Communicator", lambda **kwargs: engine)
    strategy = HaiDDPStrategy(parallel_devices=[torch.device("cuda", 0)], bucket_cap_mb=5)
    module = BoringModel()
    strategy.model = module
    strategy.configure_ddp()
    assert isinstance(strategy.model, _Wrapper) and strategy.model.module is module
    assert wrapped == [
        {
            "device_ids": [0],
            "communicator": engine,
            "bucket_cap_mb": 5,
            "find_unused_parameters": False,
            "broadcast_buffers": True,
        }
    ]


def test_takes_ddp_strategy_parameters_in_the_same_positions() -> None:
    """``Trainer(strategy=DDPStrategy(MyAccelerator()))`` is Lightning's documented pattern: so is ours."""
    theirs = [p for p in inspect.signature(DDPStrategy).parameters.values() if p.kind != p.VAR_KEYWORD]
    ours = list(inspect.signature(HaiDDPStrategy).parameters.values())
    assert [(p.name, p.kind, p.default) for p in ours[: len(theirs)]] == [(p.name, p.kind, p.default) for p in theirs]
    accelerator = CPUAccelerator()
    strategy = HaiDDPStrategy(accelerator)
    assert strategy.accelerator is accelerator
    trainer = L.Trainer(strategy=strategy, devices=2, logger=False)
    assert trainer.accelerator is accelerator


@pytest.mark.parametrize(
    ("option", "match"),
    [
        ({"bucket_cap_mb": 0}, r"bucket_cap_mb=0 must be positive"),
        ({"bucket_cap_mb": "big"}, r"bucket_cap_mb='big' \(str\) must be a number"),
        ({"find_unused_parameters": "yes"}, r"find_unused_parameters='yes' \(str\) must be True or False"),
        ({"broadcast_buffers": 1}, r"broadcast_buffers=1 \(int\) must be True or False"),
        ({"timeout": 30}, r"timeout=30 \(int\) must be a datetime.timedelta"),
        ({"timeout": timedelta(0)}, r"timeout=0:00:00 must be positive"),
        ({"start_method": "thread"}, r"start_method='thread' must be one of 'popen', 'spawn'"),
    ],
)
def test_bad_arguments_fail_at_construction(option: dict[str, Any], match: str) -> None:
    with pytest.raises((TypeError, ValueError), match=match):
        HaiDDPStrategy(**option)


def _stalled_rank(rank: int, world: int) -> tuple[str, float]:
    """Rank 1 stalls in its first training step; rank 0 waits for it in the backward's all-reduce."""

    class Stalling(BoringModel):
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            if rank == 1:
                time.sleep(6)
            return super().training_step(batch, batch_idx)

    strategy = HaiDDPStrategy(timeout=timedelta(seconds=2))
    trainer = L.Trainer(strategy=strategy, **{**_BORING, "devices": world, "max_steps": 1})
    start = time.monotonic()
    try:
        trainer.fit(Stalling())
    except Exception as error:  # rank 1 fails too, later, on whatever rank 0 left behind
        return type(error).__name__, time.monotonic() - start
    return "finished", time.monotonic() - start


def test_timeout_reaches_the_engine() -> None:
    """Was: the engine kept its 5-minute default whatever ``timeout`` said."""
    error, elapsed = run_distributed(_stalled_rank, 2, timeout=90)[0]
    assert error == "HFReduceTimeoutError"
    assert elapsed < 6


class _Unused(BoringModel):
    def __init__(self) -> None:
        super().__init__()
        self.unused = nn.Linear(2, 2)


def _unused_parameters_error(rank: int, world: int) -> str:
    trainer = L.Trainer(strategy="hai_ddp", **{**_BORING, "devices": world, "max_steps": 1})
    with pytest.raises(RuntimeError) as info:
        trainer.fit(_Unused())
    return str(info.value)


def test_unused_parameters_error_names_them_and_carries_lightnings_hint() -> None:
    message = run_distributed(_unused_parameters_error, 1)[0]
    assert "['unused.weight', 'unused.bias']" in message and "find_unused_parameters=True" in message
    assert "It looks like your LightningModule has parameters that were not used in producing the loss" in message
    assert "strategy='hai_ddp_find_unused_parameters_true'" in message
    assert L.Trainer(strategy="hai_ddp_find_unused_parameters_true", logger=False).strategy._hai_kwargs[
        "find_unused_parameters"
    ]
