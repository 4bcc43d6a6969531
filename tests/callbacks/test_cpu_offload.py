"""``CPUOffloadCallback`` in real Trainer runs, with the copy path forced on CPU.

Reference: the same Trainer run without the callback. Offload only moves saved bytes, so the trained
parameters must be bitwise equal.
"""

from __future__ import annotations

import ast
import contextlib
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import Logger
from lightning.pytorch.strategies import SingleDeviceStrategy
from torch.utils.data import DataLoader, TensorDataset

import lightning_haiscale
from examples.gpt.model import GPT, config, lm_loss
from lightning_haiscale import CPUOffloadCallback
from lightning_haiscale.cpu_offload import CPUOffload, offload_stats
from lightning_haiscale.strategies import PipeDreamStrategy
from tests.distributed import run_distributed
from tests.saved_hooks import installed_hooks

OPTIONS = {"min_bytes": 0, "force_copy": True}


def _hooks_active() -> bool:
    return installed_hooks() is not None


class GPTModule(pl.LightningModule):
    def __init__(self, manual: bool = False, fail_at: int | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = GPT(config("tiny", n_layer=2))
        self.automatic_optimization = not manual
        self.fail_at = fail_at
        self.hooks_in_forward: list[bool] = []
        self.hooks_after_backward: list[bool] = []

    def training_step(self, batch, batch_idx):
        if batch_idx == self.fail_at:
            raise RuntimeError("planned failure")
        idx, targets = batch
        loss = lm_loss(self.model(idx), targets)
        self.hooks_in_forward.append(_hooks_active())
        if self.automatic_optimization:
            return loss
        optimizer = self.optimizers()
        optimizer.zero_grad()
        self.manual_backward(loss)
        optimizer.step()
        return None

    def on_after_backward(self) -> None:
        self.hooks_after_backward.append(_hooks_active())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(1)
        idx = torch.randint(0, 256, (8, 64), generator=g)
        return DataLoader(TensorDataset(idx, torch.roll(idx, -1, dims=1)), batch_size=2)


class MemoryLogger(Logger):
    def __init__(self) -> None:
        super().__init__()
        self.metrics: list[dict[str, float]] = []

    @property
    def name(self) -> str:
        return "memory"

    @property
    def version(self) -> int:
        return 0

    def log_metrics(self, metrics, step=None) -> None:
        self.metrics.append(dict(metrics))

    def log_hyperparams(self, params, *args, **kwargs) -> None:
        pass


def _fit(module, callbacks=(), strategy="auto", devices=1, max_steps=3):
    logger = MemoryLogger()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_steps=max_steps,
        callbacks=list(callbacks),
        logger=logger,
        log_every_n_steps=1,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    trainer.fit(module)
    return [p.detach().clone() for p in module.parameters()], logger.metrics


def _assert_same_parameters(got, want) -> None:
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w), (g - w).abs().max()


@pytest.mark.parametrize("bad", [-0.5, 1.5, float("nan")])
def test_bad_ratio_raises_at_construction(bad):
    with pytest.raises(ValueError, match="offload_ratio"):
        CPUOffloadCallback(bad)


def test_bad_option_raises_at_construction():
    with pytest.raises(ValueError, match="min_bytes"):
        CPUOffloadCallback(0.5, min_bytes=-1)


@pytest.mark.parametrize("manual", [False, True], ids=["automatic", "manual"])
def test_brackets_exactly_the_forward_and_logs(manual):
    want, _ = _fit(GPTModule(manual))
    callback = CPUOffloadCallback(0.5, **OPTIONS)
    module = GPTModule(manual)
    got, metrics = _fit(module, [callback])
    _assert_same_parameters(got, want)
    assert module.hooks_in_forward == [True] * 3
    assert module.hooks_after_backward == [False] * 3
    assert not _hooks_active()
    ratios = [m["cpu_offload/achieved_ratio"] for m in metrics if "cpu_offload/achieved_ratio" in m]
    assert len(ratios) == 3 and all(abs(r - 0.5) < 0.15 for r in ratios)
    assert all(m["cpu_offload/bytes_offloaded"] > 0 for m in metrics if "cpu_offload/bytes_offloaded" in m)
    assert offload_stats(callback.tag).entries == 3


def test_exception_leaves_no_hook():
    with pytest.raises(RuntimeError, match="planned failure"):
        _fit(GPTModule(fail_at=1), [CPUOffloadCallback(0.5, **OPTIONS)])
    assert not _hooks_active()


class BracketingStrategy(SingleDeviceStrategy):
    """Stands in for a pipeline strategy: it exposes ``forward_context`` and records it at each training step."""

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self.forward_context = contextlib.nullcontext
        self.seen: list[Any] = []

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        self.seen.append(self.forward_context)
        return super().training_step(*args, **kwargs)


def test_strategy_with_a_forward_context_gets_it_filled_in():
    """The callback sets a pipeline strategy's forward_context for the fit, restores it after, and leaves the
    strategy's steps alone (it brackets each microbatch's forward itself)."""
    callback = CPUOffloadCallback(0.5, **OPTIONS)
    module, strategy = GPTModule(), BracketingStrategy(torch.device("cpu"))
    _fit(module, [callback], strategy=strategy, max_steps=1)
    assert module.hooks_in_forward == [False]
    assert strategy.seen == [callback.offload_context] and strategy.forward_context is contextlib.nullcontext
    context = callback.offload_context()
    assert isinstance(context, CPUOffload) and context is not callback.offload_context()
    with context:
        assert _hooks_active()
    assert context.tag == callback.tag and context.offload_ratio == 0.5


def test_pipeline_strategies_never_import_the_callback():
    """Was: strategies/pipeline.py imported CPUOffloadCallback to look for it in trainer.callbacks."""
    root = Path(lightning_haiscale.__file__).parent / "strategies"
    for path in root.glob("pipeline*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                assert not (node.module or "").startswith("lightning_haiscale.callbacks"), path.name
            if isinstance(node, ast.Import):
                assert not any(a.name.startswith("lightning_haiscale.callbacks") for a in node.names), path.name
    assert PipeDreamStrategy().forward_context is contextlib.nullcontext  # without a callback: a null context


def _ddp_worker(rank: int, world_size: int, strategy: str) -> bool:
    want, _ = _fit(GPTModule(), strategy=strategy, devices=world_size)
    module, callback = GPTModule(), CPUOffloadCallback(0.3, **OPTIONS)
    got, _ = _fit(module, [callback], strategy=strategy, devices=world_size)
    _assert_same_parameters(got, want)
    offloaded = offload_stats(callback.tag).bytes_offloaded > 0
    return offloaded and all(module.hooks_in_forward) and not any(module.hooks_after_backward)


@pytest.mark.parametrize("strategy", ["hai_ddp", "hai_fsdp", "ddp"])
def test_under_data_parallel_strategies_on_two_processes(strategy):
    assert run_distributed(_ddp_worker, 2, strategy) == [True, True]


def test_bad_tag_raises_at_construction():
    with pytest.raises(TypeError, match=r"tag=3 must be a string"):
        CPUOffloadCallback(0.5, tag=3)


def test_warns_once_when_it_will_offload_nothing():
    """Was: an INFO line nobody saw; on the CPU without force_copy the callback does nothing."""
    with pytest.warns(UserWarning, match=r"CPUOffloadCallback\(0.3\) will offload nothing.*force_copy=True") as seen:
        _fit(GPTModule(), [CPUOffloadCallback(0.3)], max_steps=2)
    assert sum("will offload nothing" in str(w.message) for w in seen) == 1
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*will offload nothing")
        _fit(GPTModule(), [CPUOffloadCallback(0.3, force_copy=True)], max_steps=1)
