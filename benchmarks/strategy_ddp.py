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
would show if its all-reduce were free.
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
from lightning_haiscale.testing import run_distributed

STRATEGIES = ("ddp", "hai_ddp", "no_comm")


class Throughput(L.Callback):
    """Samples per second over all replicas from step ``warmup`` to the end, on every rank.

    Lightning's ThroughputMonitor averages a rolling window on rank 0 and reports through a logger; the
    benchmark wants the whole post-warm-up span, returned by each spawned rank without a logger.
    """

    def __init__(self, warmup: int) -> None:
        self.warmup = warmup
        self.start: float | None = None
        self.end: float | None = None
        self.samples = 0

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        if self.start is None and trainer.global_step >= self.warmup:
            self.start = time.perf_counter()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, *a: Any):
        if self.start is not None:
            self.samples += batch[0].size(0)
            self.end = time.perf_counter()

    def samples_per_second(self, trainer: L.Trainer) -> float | None:
        if self.start is None or self.end is None or self.end <= self.start:
            return None
        return self.samples * trainer.world_size / (self.end - self.start)


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
        "rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "params_m": sum(p.numel() for p in module.parameters()) / 1e6,
    }


def _measure(name: str, repeats: int) -> dict[str, dict[str, float]]:
    runs: dict[str, list[list[dict[str, float]]]] = {s: [] for s in STRATEGIES}
    for repeat in range(repeats):
        for strategy in STRATEGIES if repeat % 2 == 0 else STRATEGIES[::-1]:
            runs[strategy].append(run_distributed(_worker, 2, strategy, CONFIGS[name], timeout=900))
    return {
        strategy: {
            "samples_per_s": statistics.median(r[0]["samples_per_s"] for r in rs),
            "rss_mib": max(rank["rss_mib"] for r in rs for rank in r),
            "params_m": rs[0][0]["params_m"],
        }
        for strategy, rs in runs.items()
    }


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
          "| ceiling | ddp peak RSS/rank | hai_ddp peak RSS/rank | RSS ratio |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    rows = []
    for name in names:
        bench = CONFIGS[name]
        result = _measure(name, args.repeats)
        ddp, hai, free = result["ddp"], result["hai_ddp"], result["no_comm"]
        ceiling = free["samples_per_s"] / ddp["samples_per_s"]
        print(
            f"| {name} ({bench.model}) | {ddp['params_m']:.1f}M | {bench.batch}x{bench.block} "
            f"| {ddp['samples_per_s']:.2f} | {hai['samples_per_s']:.2f} "
            f"| {hai['samples_per_s'] / ddp['samples_per_s']:.2f}x | {free['samples_per_s']:.2f} | {ceiling:.2f}x "
            f"| {ddp['rss_mib']:.0f} MiB | {hai['rss_mib']:.0f} MiB | {hai['rss_mib'] / ddp['rss_mib']:.2f} |",
            flush=True,
        )
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
            }
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows}, f, indent=1)
    return 0
