"""``CPUOffloadCallback``: activation offload around each training forward, for any LightningModule.

[Note: bracketing the forward]
The region is entered in ``on_train_batch_start`` and left in ``on_before_backward``, so it covers
exactly the forward (``training_step`` and the loss), under automatic and manual optimization
(``manual_backward`` calls ``on_before_backward``) and under DDP-style strategies (``hai_ddp``,
``hai_fsdp``), whose forward runs inside ``training_step``. ``on_train_batch_end`` and
``on_exception`` leave it too, for steps that skip backward or fail, so no hook outlives the step.
Under manual optimization only the forward before the first ``manual_backward`` of a step is covered.

Pipeline strategies run backward before ``on_before_backward``, inside ``training_step``. They expose
a ``forward_context`` hook instead (entered around every training microbatch's forward): in ``setup``
this callback sets it to ``offload_context`` (a fresh ``CPUOffload`` with the same ratio, tag and
options per microbatch) and then leaves each step alone; ``teardown`` puts the strategy's own back.
Only the callback knows the strategy: the strategy never looks for callbacks.
"""

from __future__ import annotations

import itertools
import logging
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from typing_extensions import override

from lightning_haiscale.cpu_offload import CPUOffload, check_ratio
from lightning_haiscale.cpu_offload.stats import region_record

__all__ = ["CPUOffloadCallback"]

log = logging.getLogger(__name__)
_PRIVATE_TAGS = itertools.count()


class CPUOffloadCallback(Callback):
    """Offloads ``offload_ratio`` of each training forward's saved activations to host memory.

    Logs ``cpu_offload/achieved_ratio`` and ``cpu_offload/bytes_offloaded`` (per step, all regions of
    the step together) to the Trainer's loggers; ``offload_stats(callback.tag)`` has the rest.

    Args:
        offload_ratio: fraction in [0, 1]; anything else raises ``TypeError`` (not a number: ``"0.5"``,
            ``True``) or ``ValueError`` (out of range) here, before training.
        tag: the region's name (default: one private to this callback).
        **offload_options: passed to ``CPUOffload`` (``min_bytes``, ``max_inflight_bytes``,
            ``prefetch_bytes``, ``force_copy``, ``pool``).
    """

    def __init__(self, offload_ratio: float, tag: str | None = None, **offload_options: Any) -> None:
        self.offload_ratio = check_ratio(offload_ratio)
        if tag is not None and not isinstance(tag, str):
            raise TypeError(f"tag={tag!r} must be a string naming the region, or None for one private to the callback")
        self.tag = tag if tag is not None else f"CPUOffloadCallback-{next(_PRIVATE_TAGS)}"
        self._options = offload_options
        CPUOffload(self.offload_ratio, None, **offload_options)  # rejects bad options now, not mid-fit
        self._region: CPUOffload | None = None
        self._totals_at_start = (0, 0)
        self._told_idle = False
        self._strategy_context: Any = None  # the strategy's forward_context before setup; None: it has none

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Fills in a pipeline strategy's ``forward_context``; says once, on rank 0, when the run will offload
        nothing (activations on the CPU are left alone)."""
        if hasattr(trainer.strategy, "forward_context"):
            self._strategy_context = trainer.strategy.forward_context
            trainer.strategy.forward_context = self.offload_context
        if trainer.strategy.root_device.type != "cuda" and not self._options.get("force_copy", False):
            rank_zero_warn(
                f"CPUOffloadCallback({self.offload_ratio}) will offload nothing: the run's activations are on "
                f"{trainer.strategy.root_device.type}, not a CUDA device. Train on a GPU, or pass force_copy=True to "
                "exercise the mechanism on the CPU (for testing: it copies and gains nothing)"
            )

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._strategy_context is not None:
            trainer.strategy.forward_context, self._strategy_context = self._strategy_context, None

    def offload_context(self) -> CPUOffload:
        """A fresh context manager for one forward region (same ratio, tag and options)."""
        return CPUOffload(self.offload_ratio, self.tag, **self._options)

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._totals_at_start = self._totals()
        if self._strategy_context is None:  # no pipeline strategy brackets the microbatches' forwards
            self._region = self.offload_context().__enter__()

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        self._leave()

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._leave()
        self._log(pl_module)

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._leave()

    def _leave(self) -> None:
        if self._region is not None:
            region, self._region = self._region, None
            region.__exit__(None, None, None)

    def _totals(self) -> tuple[int, int]:
        stats = region_record(self.tag).stats  # counters only: reading copy times would wait for the GPU
        return (stats.total_bytes_saved, stats.total_bytes_offloaded)

    def _log(self, pl_module: pl.LightningModule) -> None:
        saved, offloaded = (now - before for now, before in zip(self._totals(), self._totals_at_start, strict=True))
        if saved == 0:
            if not self._told_idle:
                log.info("CPUOffloadCallback: no device activations saved this step (CPU tensors need force_copy)")
                self._told_idle = True
            return
        metrics = {"cpu_offload/achieved_ratio": offloaded / saved, "cpu_offload/bytes_offloaded": float(offloaded)}
        for name, value in metrics.items():
            pl_module.log(name, value, on_step=True, on_epoch=False, batch_size=1)
