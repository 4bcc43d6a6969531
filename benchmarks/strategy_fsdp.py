"""hai_fsdp against FSDP2 (``ModelParallelStrategy`` + ``fully_shard``) and FSDP1 (``FSDPStrategy`` on the
CPU) on the GPT example, 2 processes: steady samples/s and peak RSS per rank, in the same run.

    python -m benchmarks.strategies fsdp [--configs comm,compute] [--strategies hai_fsdp,fsdp2,fsdp1]

Each (config, strategy) pair runs in 2 fresh processes, so peak RSS (``ru_maxrss``) is that run's own.
All three build the model on the meta device and materialize it sharded (each its own way), train
with AdamW in fp32, and wrap every transformer Block as a unit. Tied embeddings are off: FSDP2's
meta-device materialization (``to_empty``) unties them.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import resource
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.multiprocessing as mp
from torch.utils.data import DataLoader, TensorDataset

from examples.gpt.lightning_module import GPTLightningModule
from examples.gpt.model import GPT, Block, GPTConfig, config


@dataclass(frozen=True)
class BenchConfig:
    name: str
    batch: int  # sequences per rank
    seq: int  # tokens per sequence
    steps: int  # measured steps
    warmup: int  # steps before measuring


CONFIGS = {
    "comm": BenchConfig("comm", batch=1, seq=32, steps=6, warmup=2),  # little compute: the collectives dominate
    "compute": BenchConfig("compute", batch=4, seq=128, steps=4, warmup=1),  # matmuls dominate
}
MODEL = config("small", n_layer=16, block_size=256, tie_weights=False)  # 113M parameters
WORLD = 2


class _FSDP2GPT(GPTLightningModule):
    """FSDP2 needs ``fully_shard`` applied in ``configure_model`` (Lightning's ModelParallelStrategy)."""

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        if self.model is not None:
            return
        with torch.device("meta"):
            self.model = GPT(self.cfg)
        mesh = self.device_mesh["data_parallel"]
        for block in self.model:
            if isinstance(block, Block):
                fully_shard(block, mesh=mesh)
        fully_shard(self.model, mesh=mesh)


class _MetaGPT(GPTLightningModule):
    """Built on the meta device for FSDP1, which materializes each unit with ``reset_parameters()``."""

    def configure_model(self) -> None:
        if self.model is None:
            with torch.device("meta"):
                self.model = GPT(self.cfg)


def _strategy(name: str) -> tuple[Any, type[GPTLightningModule]]:
    from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    from lightning_haiscale.strategies import HaiFSDPStrategy

    if name == "hai_fsdp":
        return HaiFSDPStrategy(auto_wrap_policy={Block}), GPTLightningModule
    if name == "fsdp2":
        return ModelParallelStrategy(data_parallel_size=WORLD, tensor_parallel_size=1), _FSDP2GPT

    class CPUFSDPStrategy(FSDPStrategy):  # Lightning's "fsdp" refuses accelerator="cpu" otherwise
        def _setup_model(self, model: torch.nn.Module) -> torch.nn.Module:
            from torch.distributed.fsdp import FullyShardedDataParallel

            return FullyShardedDataParallel(model, device_id=torch.device("cpu"), **self.kwargs)

    return CPUFSDPStrategy(auto_wrap_policy=ModuleWrapPolicy({Block}), use_orig_params=True), _MetaGPT


class _Clock(L.Callback):
    def __init__(self, warmup: int) -> None:
        self.warmup = warmup
        self.start = 0.0
        self.end = 0.0

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == self.warmup:
            self.start = time.perf_counter()
        self.end = time.perf_counter()


def _worker(rank: int, port: int, strategy_name: str, cfg: BenchConfig, model: GPTConfig, results: Any) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(WORLD),
        LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(WORLD), GROUP_RANK="0",
    )  # fmt: skip
    torch.set_num_threads(1)
    torch.manual_seed(0)
    strategy, module_cls = _strategy(strategy_name)
    rows = (cfg.steps + cfg.warmup) * cfg.batch * WORLD
    tokens = torch.randint(0, model.vocab_size, (rows, cfg.seq + 1), generator=torch.Generator().manual_seed(0))
    clock = _Clock(cfg.warmup)
    trainer = L.Trainer(
        strategy=strategy, accelerator="cpu", devices=WORLD, max_steps=cfg.steps + cfg.warmup, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
        num_sanity_val_steps=0, callbacks=[clock],
    )  # fmt: skip
    data = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=cfg.batch)
    trainer.fit(module_cls(model), train_dataloaders=data)
    samples_per_s = cfg.steps * cfg.batch * WORLD / (clock.end - clock.start)
    results.put((rank, samples_per_s, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024))


def run_one(strategy_name: str, cfg: BenchConfig, model: GPTConfig) -> tuple[float, float]:
    """(samples/s, peak RSS MiB of the larger rank) of one 2-process run."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=_worker, args=(r, port, strategy_name, cfg, model, results)) for r in range(WORLD)]
    for p in procs:
        p.start()
    out = []
    while len(out) < WORLD:
        try:
            out.append(results.get(timeout=5))
        except queue.Empty:
            if any(p.exitcode not in (None, 0) for p in procs):
                for p in procs:
                    p.kill()
                raise RuntimeError(f"{strategy_name} on {cfg.name}: a rank failed") from None
    for p in procs:
        p.join()
    return min(o[1] for o in out), max(o[2] for o in out)


def _measure(names: list[str], cfg: BenchConfig, model: GPTConfig, repeats: int) -> dict[str, tuple[float, float]]:
    """Best samples/s and highest peak RSS of each strategy over ``repeats`` rounds; the order of the
    strategies is reversed every round, so load from other jobs on the machine hits them alike."""
    best: dict[str, tuple[float, float]] = {}
    for round_ in range(repeats):
        for name in names if round_ % 2 == 0 else names[::-1]:
            speed, rss = run_one(name, cfg, model)
            print(f"  round {round_}: {cfg.name} {name}: {speed:.3f} samples/s, {rss:.0f} MiB", flush=True)
            old = best.get(name, (0.0, 0.0))
            best[name] = (max(old[0], speed), max(old[1], rss))
    return best


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="benchmarks/strategies.py fsdp", description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default="comm,compute")
    parser.add_argument("--strategies", default="hai_fsdp,fsdp2,fsdp1")
    parser.add_argument("--repeats", type=int, default=2, help="rounds per config (best samples/s is kept)")
    parser.add_argument("--smoke", action="store_true", help="the tiny GPT: checks the script, measures nothing")
    parser.add_argument("--json", type=Path, help="also write the rows here, for benchmarks/report.py")
    args = parser.parse_args(argv)
    names = args.strategies.split(",")
    model = config("tiny", tie_weights=False) if args.smoke else MODEL
    params = sum(p.numel() for p in GPT(model).parameters())
    print(f"GPT {params / 1e6:.1f}M parameters, {WORLD} processes, fp32 AdamW, units = Blocks", flush=True)
    rows, records = [], []
    for cfg_name in args.configs.split(","):
        cfg = CONFIGS[cfg_name]
        measured = _measure(names, cfg, model, args.repeats)
        hai = measured.get("hai_fsdp", (float("nan"), float("nan")))
        for name, (speed, rss) in measured.items():
            label = f"{cfg.name} (B={cfg.batch}, T={cfg.seq})"
            if name != "hai_fsdp":
                records.append(_record(f"GPT {params / 1e6:.0f}M, {label}", name, hai, (speed, rss)))
            rows.append(f"| {label} | {name} | {speed:.2f} | {rss:.0f} | {hai[0] / speed:.2f}x | {hai[1] / rss:.2f}x |")
    header = "| config | strategy | samples/s | peak RSS/rank (MiB) | hai_fsdp samples/s ratio | hai_fsdp RSS ratio |"
    print("\n" + header + "\n|---|---|---|---|---|---|\n" + "\n".join(rows))
    if args.json is not None:
        args.json.write_text(json.dumps({"rows": records}, indent=1))
    return 0


def _record(label: str, peer: str, hai: tuple[float, float], theirs: tuple[float, float]) -> dict[str, Any]:
    return {
        "technique": "hai_fsdp",
        "config": label,
        "ours": "hai_fsdp",
        "peer": {"fsdp2": "FSDP2 (ModelParallelStrategy)", "fsdp1": "FSDP1 (FSDPStrategy on CPU)"}.get(peer, peer),
        "metric": "samples/s",
        "ours_value": hai[0],
        "peer_value": theirs[0],
        "ours_rss_mib": hai[1],
        "peer_rss_mib": theirs[1],
    }


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
