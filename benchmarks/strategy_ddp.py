"""hai_ddp vs Lightning's "ddp" (gloo) on the GPT example, side by side in one run.

    flock /tmp/lhs-bench.lock python -m benchmarks.strategies ddp [--configs compute,comm,comm_adamw] [--repeats 1]

Every (config, strategy) pair trains in 2 fresh processes with one thread each, on the same data and
steps; samples/s is measured after the warm-up steps, peak RSS is each rank's ``ru_maxrss``. Configs:

- ``compute``: GPT ``tiny`` (0.9M parameters), batch 8 x 256 tokens per rank: the step is compute.
- ``comm``: GPT ``small`` (85M parameters), batch 1 x 16 tokens per rank, SGD: little compute per step,
  so the gradient all-reduce (340 MB) makes most of it.
- ``comm_adamw``: the same with the example's AdamW, whose update of 85M parameters costs about as much
  as gloo's all-reduce and is the same on both sides: the realistic, less communication-bound case.

Pairs run interleaved (ddp, hai_ddp, then hai_ddp, ddp, ...) so that load from other jobs on a shared
machine hits both sides alike; samples/s is the median over repeats, RSS the maximum.

A third run, ``no_comm``, is Lightning's ddp with the model left unwrapped: the same processes, data
and steps with no gradient all-reduce at all (the replicas drift apart; it trains nothing useful). Its
samples/s over ddp's is the ceiling of any communication engine on that config: the speed-up hai_ddp
would show if its all-reduce were free. From the three step times of the same run, ``comm removed`` is
the share of ddp's communication time that hai_ddp removes: (ddp - hai_ddp) / (ddp - no_comm).

[Note: the floor of a shared core]
Each rank has one core here, so hai_ddp's reduction (the engine's worker thread, plus any copy on the
backward thread) cannot run beside backward: it takes turns with it, and every millisecond of its CPU adds
to the step however well it overlaps. The benchmark measures that cost in the same run: the engine
thread's CPU time per step (``hfreduce.engine_cpu_seconds``, from ``/proc/self/task/<tid>/schedstat``)
plus the backward thread's copy time (``Reducer.stats``). ``floor step = no_comm step + reduction CPU`` is
the fastest step such a reduction allows, and ``share the floor allows = (ddp - floor step) / (ddp -
no_comm)`` the most of ddp's communication time it can remove. ``hai_ddp above the floor`` (hai_ddp's
step minus the floor step) is what is not the reduction itself: waiting, scheduling, Python per hook.
JSON keys per row: ``cpu_ms`` (process CPU per step of each strategy), ``reduction_cpu_ms``,
``floor_step_ms``, ``floor_share``, ``slack_ms``.

For hai_ddp the reducer's counters (``Reducer.stats``) are printed per step after the warm-up: time the
backward thread spent copying gradients into shared buckets, time the end of backward waited for the
all-reduces, megabytes copied and reduced in place, all-reduces launched during backward and at its end.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import time
from dataclasses import dataclass
from typing import Any

import lightning as L
import torch
from lightning.pytorch.strategies import DDPStrategy
from torch import nn

from examples.gpt.data import GPTDataModule
from examples.gpt.lightning_module import GPTLightningModule
from examples.gpt.model import config
from lightning_haiscale.ddp import DistributedDataParallel
from lightning_haiscale.ddp.reducer import ReducerStats
from lightning_haiscale.hfreduce import engine_cpu_seconds
from lightning_haiscale.testing import run_distributed

STRATEGIES = ("ddp", "hai_ddp", "no_comm")


def _per_step(stats: ReducerStats, steps: int) -> dict[str, float]:
    return {
        "copy_ms": stats.copy_seconds / steps * 1e3,
        "wait_ms": stats.wait_seconds / steps * 1e3,
        "copied_mb": stats.copied_bytes / steps / 1e6,
        "in_place_mb": stats.in_place_bytes / steps / 1e6,
        "overlapped": stats.overlapped / steps,
        "at_end": stats.at_end / steps,
    }


def _clocks() -> tuple[float, float, float, float]:
    """(wall, process CPU, this thread's CPU, the engine threads' CPU), in seconds."""
    return time.perf_counter(), time.process_time(), time.thread_time(), engine_cpu_seconds()


class Throughput(L.Callback):
    """Samples per second over all replicas from step ``warmup`` to the end, on every rank, and CPU time
    per step: the whole process's, the training thread's and the engine's worker thread's.

    Lightning's ThroughputMonitor averages a rolling window on rank 0 and reports through a logger; the
    benchmark wants the whole post-warm-up span, returned by each spawned rank without a logger.
    """

    def __init__(self, warmup: int) -> None:
        self.warmup = warmup
        self.first: tuple[float, ...] | None = None
        self.last: tuple[float, ...] | None = None
        self.samples = 0
        self.steps = 0
        self.phases: dict[str, float] = {}

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        if self.first is None and trainer.global_step >= self.warmup:
            self.first = _clocks()
            if isinstance(trainer.strategy.model, DistributedDataParallel):
                trainer.strategy.model.reducer.stats = ReducerStats()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, *a: Any):
        if self.first is not None:
            self.samples += batch[0].size(0)
            self.steps += 1
            self.last = _clocks()

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if isinstance(trainer.strategy.model, DistributedDataParallel) and self.steps:
            self.phases = _per_step(trainer.strategy.model.reducer.stats, self.steps)

    def per_step_ms(self) -> dict[str, float]:
        """Wall-clock and CPU milliseconds per step after the warm-up (NaN without a measured step)."""
        if self.first is None or self.last is None or not self.steps:
            return dict.fromkeys(("step_ms", "cpu_ms", "main_cpu_ms", "engine_cpu_ms"), float("nan"))
        wall, cpu, main, engine = ((b - a) / self.steps * 1e3 for a, b in zip(self.first, self.last, strict=True))
        return {"step_ms": wall, "cpu_ms": cpu, "main_cpu_ms": main, "engine_cpu_ms": engine}

    def samples_per_second(self, trainer: L.Trainer) -> float | None:
        if self.first is None or self.last is None or self.last[0] <= self.first[0]:
            return None
        return self.samples * trainer.world_size / (self.last[0] - self.first[0])


@dataclass(frozen=True)
class BenchConfig:
    model: str
    batch: int
    block: int
    steps: int
    warmup: int
    optimizer: str = "adamw"


CONFIGS = {
    "compute": BenchConfig("tiny", batch=8, block=256, steps=40, warmup=5),
    "comm": BenchConfig("small", batch=1, block=16, steps=12, warmup=3, optimizer="sgd"),
    "comm_adamw": BenchConfig("small", batch=1, block=16, steps=12, warmup=3),
}


class _SGDModule(GPTLightningModule):
    """The GPT module with plain SGD, so that the optimizer step does not hide the communication."""

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


class _NoCommStrategy(DDPStrategy):
    """Lightning's ddp without the DDP wrapper: no gradient synchronization, the step's compute alone."""

    def _setup_model(self, model: nn.Module) -> nn.Module:  # type: ignore[override]
        return model


def _worker(rank: int, world: int, strategy: str, bench: BenchConfig) -> dict[str, float]:
    import lightning_haiscale  # noqa: F401  (registers "hai_ddp" in the spawned process)

    torch.manual_seed(0)
    module_class = _SGDModule if bench.optimizer == "sgd" else GPTLightningModule
    module = module_class(config(bench.model, block_size=bench.block))
    data = GPTDataModule(block_size=bench.block, batch_size=bench.batch, max_bytes=1 << 20)
    throughput = Throughput(bench.warmup)
    trainer = L.Trainer(
        strategy=_NoCommStrategy() if strategy == "no_comm" else strategy,
        accelerator="cpu",
        devices=world,
        max_steps=bench.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        callbacks=[throughput],
    )
    trainer.fit(module, datamodule=data)
    return {
        "samples_per_s": throughput.samples_per_second(trainer) or float("nan"),
        **throughput.per_step_ms(),
        "rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "params_m": sum(p.numel() for p in module.parameters()) / 1e6,
        **{f"phase_{k}": v for k, v in throughput.phases.items()},
    }


def _measure(name: str, repeats: int) -> dict[str, dict[str, float]]:
    runs: dict[str, list[list[dict[str, float]]]] = {s: [] for s in STRATEGIES}
    for repeat in range(repeats):
        for strategy in STRATEGIES if repeat % 2 == 0 else STRATEGIES[::-1]:
            runs[strategy].append(run_distributed(_worker, 2, strategy, CONFIGS[name], timeout=900))
    return {  # rank 0's figures, median over repeats; RSS the largest of any rank
        strategy: {
            **{k: statistics.median(r[0][k] for r in rs) for k in rs[0][0]},
            "rss_mib": max(rank["rss_mib"] for r in rs for rank in r),
        }
        for strategy, rs in runs.items()
    }


def _floor(result: dict[str, dict[str, float]]) -> dict[str, float]:
    """The step a reduction of hai_ddp's measured cost allows, and the share of ddp's communication time
    removed at that step: see [Note: the floor of a shared core]."""
    ddp, hai, free = (result[s]["step_ms"] for s in STRATEGIES)
    reduction = result["hai_ddp"]["engine_cpu_ms"] + result["hai_ddp"].get("phase_copy_ms", 0.0)
    floor_step = free + reduction
    gap = ddp - free
    return {
        "reduction_cpu_ms": reduction,
        "floor_step_ms": floor_step,
        "floor_share": (ddp - floor_step) / gap if gap else float("nan"),
        "slack_ms": hai - floor_step,  # hai_ddp's step above the floor: what is not the reduction itself
    }


def _print_phases(phases: list[tuple[str, dict[str, dict[str, float]], dict[str, float]]]) -> None:
    print("\nhai_ddp per step (rank 0, median over repeats; Reducer.stats):\n")
    print("| config | copy into buckets | wait at end of backward | copied | reduced in place "
          "| all-reduces during / at end of backward |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    for name, result, _ in phases:
        p = {k.removeprefix("phase_"): v for k, v in result["hai_ddp"].items() if k.startswith("phase_")}
        print(
            f"| {name} | {p['copy_ms']:.1f} ms | {p['wait_ms']:.1f} ms | {p['copied_mb']:.1f} MB "
            f"| {p['in_place_mb']:.1f} MB | {p['overlapped']:.0f} / {p['at_end']:.0f} |",
            flush=True,
        )
    print("\nCPU per step and the floor of a shared core (rank 0, ms; [Note: the floor of a shared core]):\n")
    print("| config | process CPU ddp / hai_ddp / no-comm | hai_ddp training thread / engine thread "
          "| reduction CPU | floor step | share the floor allows | hai_ddp above the floor |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for name, result, floor in phases:
        cpu, hai = (result[s]["cpu_ms"] for s in STRATEGIES), result["hai_ddp"]
        print(
            f"| {name} | {' / '.join(f'{c:.0f}' for c in cpu)} | {hai['main_cpu_ms']:.0f} / {hai['engine_cpu_ms']:.1f} "
            f"| {floor['reduction_cpu_ms']:.1f} | {floor['floor_step_ms']:.0f} | {floor['floor_share']:.0%} "
            f"| {floor['slack_ms']:.0f} |",
            flush=True,
        )


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="benchmarks/strategies.py ddp", description=__doc__)
    p.add_argument("--configs", default="compute,comm,comm_adamw", help=f"comma-separated, of {sorted(CONFIGS)}")
    p.add_argument("--json", default=None, help="also write the rows here (for benchmarks/report.py)")
    p.add_argument("--repeats", type=int, default=2, help="runs per pair (median samples/s, max RSS)")
    args = p.parse_args(argv)
    names = args.configs.split(",")
    unknown = sorted(set(names) - set(CONFIGS))
    if unknown:
        p.error(f"--configs: unknown {unknown}; choose from {sorted(CONFIGS)}")
    print("| config | params | batch/rank | ddp samples/s | hai_ddp samples/s | speed-up | no-comm samples/s "
          "| ceiling | step ms ddp / hai_ddp / no-comm | comm removed | ddp peak RSS/rank | hai_ddp peak RSS/rank "
          "| RSS ratio |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    rows, phases = [], []
    for name in names:
        bench = CONFIGS[name]
        result = _measure(name, args.repeats)
        ddp, hai, free = result["ddp"], result["hai_ddp"], result["no_comm"]
        ceiling = free["samples_per_s"] / ddp["samples_per_s"]
        gap = ddp["step_ms"] - free["step_ms"]  # ddp's communication time
        removed = (ddp["step_ms"] - hai["step_ms"]) / gap if gap else float("nan")
        print(
            f"| {name} ({bench.model}) | {ddp['params_m']:.1f}M | {bench.batch}x{bench.block} "
            f"| {ddp['samples_per_s']:.2f} | {hai['samples_per_s']:.2f} "
            f"| {hai['samples_per_s'] / ddp['samples_per_s']:.2f}x | {free['samples_per_s']:.2f} | {ceiling:.2f}x "
            f"| {ddp['step_ms']:.0f} / {hai['step_ms']:.0f} / {free['step_ms']:.0f} | {removed:.0%} "
            f"| {ddp['rss_mib']:.0f} MiB | {hai['rss_mib']:.0f} MiB | {hai['rss_mib'] / ddp['rss_mib']:.2f} |",
            flush=True,
        )
        hai_phases = {k.removeprefix("phase_"): v for k, v in hai.items() if k.startswith("phase_")}
        floor = _floor(result)
        phases.append((name, result, floor))
        rows.append(
            {
                "technique": "hai_ddp",
                "config": f"{name}: {bench.model} {bench.batch}x{bench.block} (no-comm ceiling {ceiling:.2f}x)",
                "ours": "hai_ddp",
                "peer": "ddp (gloo)",
                "metric": "samples/s",
                "ours_value": hai["samples_per_s"],
                "peer_value": ddp["samples_per_s"],
                "ceiling_value": free["samples_per_s"],  # no_comm: the ceiling of any engine (benchmarks/report.py)
                "ours_rss_mib": hai["rss_mib"],
                "peer_rss_mib": ddp["rss_mib"],
                "step_ms": {s: result[s]["step_ms"] for s in STRATEGIES},
                "comm_removed": removed,
                "hai_ddp_phases": hai_phases,
                "cpu_ms": {s: result[s]["cpu_ms"] for s in STRATEGIES},  # process CPU per step, rank 0
                **floor,  # reduction_cpu_ms, floor_step_ms, floor_share, slack_ms
            }
        )
    _print_phases(phases)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows}, f, indent=1)
    return 0
