"""gpu_check's Trainer and stream-race checks: what a Lightning user runs, on the GPU.

Every strategy fits the pipeline tests' ``Classifier`` (an 8-layer MLP in an ``nn.Sequential``; SGD with
momentum) for a few steps with a validation pass before and after training (Lightning's sanity check runs
the pipelines' evaluation path first), on 1 process and on 2 processes sharing GPU 0 (gloo: NCCL refuses two
ranks on one device; DP x PP on 4), in ``32-true``, ``16-mixed`` and ``bf16-mixed``. Each run is compared with
one plain-PyTorch fp32 process on the same batches: the relative error of every parameter's total change, within
:func:`tolerance` ([Note: fit tolerances]).
``hai_ddp`` also runs with gradient accumulation (``no_sync``) and an unused parameter
(``find_unused_parameters=True``), GPipe with activation checkpointing.

The stream-race mode delays the GPU (``torch.cuda._sleep``) before every engine collective and inside a
backward hook, and runs a step on a non-default stream: a collective that does not wait for the caller's
stream, or a caller that does not wait for the copy back, reads or keeps stale values and fails parity.

Everything takes a device, so the test suite runs the same logic on CPU.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import tempfile
from collections.abc import Callable, Generator, Iterable
from dataclasses import dataclass
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader

import lightning_haiscale  # noqa: F401 - registers the strategies
from lightning_haiscale.hfreduce import Communicator
from lightning_haiscale.strategies import (
    GPipeStrategy,
    HaiDDPStrategy,
    HaiFSDPStrategy,
    Interleaved1F1BStrategy,
    PipeDreamStrategy,
)
from lightning_haiscale.testing import run_distributed
from lightning_haiscale.testing.parity import BATCH, NOISE_MULTIPLE, Classifier, data, reference

STEPS = 4
PRECISIONS = ("32-true", "16-mixed", "bf16-mixed")
# [Note: fit tolerances]
# A fit is compared with one fp32 CPU process by the relative error of each parameter's total change.
# * 32-true: float32 on both sides, only the order of the sums differs (the reduction over ranks, the GPU's kernels),
#   so NOISE_MULTIPLE times the reference's own noise in this measure (:func:`reference_noise`: the reference against
#   itself with each step's batch summed in 2 and in 4 pieces; 3.7e-6 to 7.1e-6 for these cases, so 3.7e-5 to
#   7.1e-5), never under NOISE_MULTIPLE float32 eps. A missing or partial reduction is off by O(1).
# * 16-mixed, bf16-mixed: autocast rounds every matmul's inputs to the format, which no reordering of the fp32
#   reference samples: MIXED_EPS times the format's eps (bf16 7.8e-3, fp16 9.8e-4). Measured on CPU (bf16-mixed,
#   22 fits, RESULTS.md): every fit within 1.9e-2 = 2.4 bf16 eps, so 10 eps leaves 4x; fp16 (GPU only) is held to the
#   same multiple of its own eps. Neither mixed precision has been measured on a GPU yet.
MIXED_EPS = 10
MIXED_DTYPES = {"16-mixed": torch.float16, "bf16-mixed": torch.bfloat16}
# The stream-race worker compares weights (not changes) with one float32 process on the same device: the reference's
# reordering noise for the Classifier is ~1.5e-8 of weights near 1 (testing.parity.measure_noise on reference(5, 8));
# 1e-5 is ~600x it, while a stale or missing reduction changes the average gradient by O(1) (one rank's batch).
RACE_TOLERANCE = 1e-5
SLEEP_CYCLES = 5_000_000  # a few milliseconds of GPU time: longer than the host takes to reach a copy


@dataclass(frozen=True)
class Case:
    """One Trainer fit: a strategy on ``world`` processes; ``dp`` data-parallel replicas read distinct rows."""

    name: str
    world: int
    dp: int
    accumulate: int = 1
    unused_parameter: bool = False

    def strategy(self, device: str) -> L.pytorch.strategies.Strategy:
        common: dict[str, Any] = {
            "parallel_devices": [torch.device(device, 0) if device == "cuda" else torch.device("cpu")] * self.world,
            "process_group_backend": "gloo",
        }
        factories: dict[str, Callable[[], L.pytorch.strategies.Strategy]] = {
            "hai_ddp": lambda: HaiDDPStrategy(find_unused_parameters=self.unused_parameter, **common),
            "hai_fsdp": lambda: HaiFSDPStrategy(**common),
            "hai_gpipe(checkpoint)": lambda: GPipeStrategy(chunks=2, checkpoint="always", **common),
            "hai_pipedream": lambda: PipeDreamStrategy(chunks=2, **common),
            "hai_interleaved_1f1b": lambda: Interleaved1F1BStrategy(chunks=2, **common),
            "hai_pipedream(dp x pp)": lambda: PipeDreamStrategy(chunks=2, pp_size=2, **common),
        }
        return factories[self.name]()

    @property
    def label(self) -> str:
        extra = ", no_sync + find_unused_parameters" if self.unused_parameter else ""
        return f"{self.name} on {self.world} process{'es' if self.world > 1 else ''}{extra}"


def cases(worlds: Iterable[int] = (1, 2, 4)) -> list[Case]:
    """The fit matrix: every strategy on 1 and 2 processes (interleaved needs 2), DP x PP on 4."""
    chosen = []
    for world in worlds:
        if world == 4:
            chosen.append(Case("hai_pipedream(dp x pp)", 4, dp=2))
            continue
        chosen += [Case("hai_ddp", world, dp=world), Case("hai_fsdp", world, dp=world)]
        chosen += [Case("hai_gpipe(checkpoint)", world, dp=1), Case("hai_pipedream", world, dp=1)]
        if world > 1:
            chosen += [
                Case("hai_interleaved_1f1b", world, dp=1),
                Case("hai_ddp", world, dp=world, accumulate=2, unused_parameter=True),
            ]
    return chosen


class _WithUnused(Classifier):
    """The classifier plus a parameter no step uses (hai_ddp must then be told find_unused_parameters)."""

    def __init__(self) -> None:
        super().__init__()
        self.unused = nn.Linear(2, 2)


def fit_error(case: Case, precision: str, device: str) -> float:
    """Fits ``case`` on this process's rank; rank 0 returns the largest relative error of a parameter's change
    against one fp32 process (the other ranks return 0)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    module = _WithUnused() if case.unused_parameter else Classifier()
    initial = {k: v.detach().clone() for k, v in module.state_dict().items()}
    with tempfile.TemporaryDirectory() as tmp:
        trainer = L.Trainer(
            strategy=case.strategy(device),
            accelerator=device,
            devices=1 if device == "cuda" else case.world,  # the strategy names the devices (all GPU 0)
            precision=precision,
            max_steps=STEPS,
            accumulate_grad_batches=case.accumulate,
            limit_val_batches=2,
            num_sanity_val_steps=2,
            val_check_interval=STEPS * case.accumulate,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            default_root_dir=tmp,
        )
        rows = BATCH * STEPS * case.accumulate * case.dp
        trainer.fit(module, DataLoader(data(rows), batch_size=BATCH), DataLoader(data(), batch_size=BATCH))
        state = trainer.strategy.lightning_module_state_dict()  # a collective: rank 0 holds the whole model
    if "val_loss" not in trainer.callback_metrics or not torch.isfinite(trainer.callback_metrics["val_loss"]):
        raise RuntimeError(f"{case.label} {precision}: no finite val_loss after fit")
    if dist.get_rank() != 0:
        return 0.0
    expected, _ = reference(STEPS, BATCH, accumulate=case.accumulate, dp=case.dp, rows=rows)
    return max(_change_error(state[k].cpu().float(), initial[k].float(), v) for k, v in expected.items())


def _change_error(final: torch.Tensor, initial: torch.Tensor, expected: torch.Tensor) -> float:
    wanted = expected - initial
    return ((final - initial - wanted).norm() / wanted.norm().clamp_min(1e-12)).item()


@functools.cache
def reference_noise(accumulate: int, dp: int) -> float:
    """The fp32 reference's own noise in the fits' measure: the largest relative error of a parameter's change
    between the reference and itself with each step's batch summed in 2 and in 4 pieces."""
    rows = BATCH * STEPS * accumulate * dp
    initial = Classifier().state_dict()
    base, _ = reference(STEPS, BATCH, accumulate=accumulate, dp=dp, rows=rows)
    noise = 0.0
    for pieces in (2, 4):
        other, _ = reference(STEPS, BATCH, accumulate=accumulate, dp=dp, rows=rows, microbatches=pieces)
        noise = max(noise, *(_change_error(other[k], initial[k], v) for k, v in base.items()))
    return noise


def tolerance(case: Case, precision: str) -> float:
    """The largest relative error of a parameter's change that ``case`` may show in ``precision`` ([Note: fit
    tolerances])."""
    if precision in MIXED_DTYPES:
        return MIXED_EPS * torch.finfo(MIXED_DTYPES[precision]).eps
    return NOISE_MULTIPLE * max(reference_noise(case.accumulate, case.dp), torch.finfo(torch.float32).eps)


def _fit_worker(
    rank: int, world: int, device: str, precisions: tuple[str, ...], race: bool, names: set[str] | None
) -> list[tuple]:
    if device == "cuda":
        torch.cuda.set_device(0)
    results = []
    with stream_race() if race else contextlib.nullcontext():
        for case in (c for c in cases((world,)) if names is None or c.name in names):
            for precision in precisions:
                results.append((case.label, precision, fit_error(case, precision, device), tolerance(case, precision)))
    return results


def fit_rows(
    device: str,
    worlds: Iterable[int],
    precisions: tuple[str, ...],
    race: bool = False,
    names: set[str] | None = None,
) -> list[tuple]:
    """``(check, ok, detail)`` per fit of the matrix on ``device`` (only the strategies in ``names``, if given)."""
    rows = []
    for world in worlds:
        results = run_distributed(_fit_worker, world, device, precisions, race, names, timeout=420)[0]
        for label, precision, error, limit in results:
            check = f"Trainer fit {label}, {precision}{' (stream race)' if race else ''} on {device}"
            rows.append((check, error < limit, f"max rel err of the change {error:.1e} (tolerance {limit:.1e})"))
    return rows


# ------------------------------------------------------------------------------------------- stream race


@contextlib.contextmanager
def stream_race() -> Generator[None, None, None]:
    """Delays the GPU before every engine collective (on the caller's current stream), so a copy that does not
    wait for that stream reads the value from before the delay."""
    names = ("all_reduce", "reduce_scatter", "all_gather", "broadcast")
    originals = {name: getattr(Communicator, name) for name in names}
    for name, original in originals.items():
        setattr(Communicator, name, _delayed(original))
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(Communicator, name, original)


def _delayed(collective: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(collective)
    def delayed(comm: Communicator, *args: Any, **kwargs: Any) -> Any:
        if any(torch.is_tensor(a) and a.is_cuda for a in args):
            torch.cuda._sleep(SLEEP_CYCLES)
        return collective(comm, *args, **kwargs)

    return delayed


def _sleep_in_backward(module: nn.Module) -> None:
    """A backward hook that delays the GPU in the middle of backward, while earlier buckets are in flight."""
    if next(module.parameters()).is_cuda:
        module.register_full_backward_hook(lambda *_: torch.cuda._sleep(SLEEP_CYCLES))


def _race_worker(rank: int, world: int, device: str) -> float:
    """Plain hai_ddp under the race: sleeps before collectives and in a backward hook, the last step on a
    non-default stream; relative error against one process."""
    from lightning_haiscale.ddp import DistributedDataParallel

    if device == "cuda":
        torch.cuda.set_device(0)
    torch.backends.cuda.matmul.allow_tf32 = False
    model = Classifier().net.to(device)
    ref = copy.deepcopy(model)
    _sleep_in_backward(model[3])
    ddp = DistributedDataParallel(model, device_ids=[0] if device == "cuda" else None, bucket_cap_mb=0.001)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ddp, ref)]
    x, y = data(8 * world * 3).tensors
    side = torch.cuda.Stream() if device == "cuda" else None
    with stream_race():
        for step in range(3):
            rows = slice(8 * world * step, 8 * world * (step + 1))
            xs, ys = x[rows].to(device), y[rows].to(device)
            mine = slice(8 * rank, 8 * rank + 8)
            on_side = torch.cuda.stream(side) if side is not None and step == 2 else contextlib.nullcontext()
            with on_side:
                nn.functional.cross_entropy(ddp(xs[mine]), ys[mine]).backward()
                opts[0].step()
                opts[0].zero_grad()
            if side is not None:
                torch.cuda.current_stream().wait_stream(side)
            nn.functional.cross_entropy(ref(xs), ys).backward()
            opts[1].step()
            opts[1].zero_grad()
    ddp.reducer.stop()
    return max(((p - q).norm() / q.norm()).item() for p, q in zip(model.parameters(), ref.parameters(), strict=True))


def race_rows(device: str) -> list[tuple]:
    """The plain hai_ddp race, then hai_fsdp and the pipelines fitted under it (32-true, 2 processes)."""
    error = max(run_distributed(_race_worker, 2, device, timeout=300))
    rows = [
        (
            f"stream race: hai_ddp on {device} (sleeps, non-default stream)",
            error < RACE_TOLERANCE,
            f"max rel err {error:.1e} (tolerance {RACE_TOLERANCE:.0e})",
        )
    ]
    return rows + fit_rows(device, (2,), ("32-true",), race=True)
