"""hai_fsdp against FSDP2 (``ModelParallelStrategy`` + ``fully_shard``) and FSDP1 (``FSDPStrategy`` on the
CPU) on the GPT example, 2 processes: steady samples/s and peak memory per rank, in the same run.

    python -m benchmarks.strategies fsdp [--configs comm,compute] [--strategies hai_fsdp,fsdp2,fsdp1]
    python -m benchmarks.strategies fsdp --configs medium --repeats 1   # GPT-2 Medium (~12 GiB for 2 ranks)
    python -m benchmarks.strategies fsdp --configs compute,medium --repeats 1 --strategies \
        hai_fsdp,fsdp1,hai_fsdp:SHARD_GRAD_OP,fsdp1:SHARD_GRAD_OP,hai_fsdp+ac,fsdp1+ac   # modes, side by side

A strategy name may carry a sharding strategy (``hai_fsdp:SHARD_GRAD_OP``) and ``+ac`` (activation checkpointing of
every Block, by ``activation_checkpointing_policy`` for hai_fsdp, by torch's ``apply_activation_checkpointing`` after
wrapping for FSDP1, as Lightning's ``FSDPStrategy`` applies it); each is compared with hai_fsdp in the same mode,
and checkpointing's memory cut and speed cost with and without it, ours beside FSDP1's.

Each (config, strategy) pair runs in 2 fresh processes, so peak RSS (``ru_maxrss``) is that run's own.
Peak PSS (see [Note: RSS and PSS]) is sampled from ``/proc/self/smaps_rollup`` every 10 ms and at each
phase of the warm-up steps (``--phases`` prints them), and not during the timed steps: walking the page
tables of a multi-GiB process every 10 ms took 37-40% of a rank's CPU (``perf``: ``smaps_account``), more
for the strategy with more memory mapped. The warm-up covers the peak, which comes with the first backward
after the first optimizer step (the second step). All three build the model on the meta device and
materialize it sharded (each its own way), train with AdamW in fp32, and wrap the same units (every
transformer Block; ``medium_units`` also the embedding and the head). Tied embeddings are off: FSDP2's
meta-device materialization (``to_empty``) unties them.

[Note: RSS and PSS]
RSS counts every page a process has mapped, so a shared-memory segment mapped by both ranks (the engine's
staging, torch's libraries) counts once per rank: the ranks' RSS add up to more than the host spends. PSS
divides each shared page among the processes that map it, so the ranks' PSS add up to what the host spends.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import resource
import socket
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.multiprocessing as mp
from torch.utils.data import DataLoader, TensorDataset

from examples.gpt.lightning_module import GPTLightningModule
from examples.gpt.model import GPT, Block, Embeddings, GPTConfig, LMHead, config

MODEL = config("small", n_layer=16, block_size=256, tie_weights=False)  # 113M parameters
MEDIUM = config("medium", vocab_size=50257, block_size=128, tie_weights=False)  # GPT-2 Medium, untied: 406M
WORLD = 2


@dataclass(frozen=True)
class BenchConfig:
    name: str
    batch: int  # sequences per rank
    seq: int  # tokens per sequence
    steps: int  # measured steps
    warmup: int  # steps before measuring
    model: GPTConfig = MODEL
    units: tuple[type[torch.nn.Module], ...] = (Block,)  # the modules every strategy wraps as units


CONFIGS = {
    "comm": BenchConfig("comm", batch=1, seq=32, steps=6, warmup=2),  # little compute: the collectives dominate
    "compute": BenchConfig("compute", batch=4, seq=128, steps=4, warmup=2),  # matmuls dominate
    # issue #15: memory at GPT-2 Medium; the peak comes in the second step, so few steps
    "medium": BenchConfig("medium", batch=1, seq=64, steps=2, warmup=2, model=MEDIUM),
    # the same with the 50257-row embedding and the head as units of their own, in every strategy
    "medium_units": BenchConfig(
        "medium_units", batch=1, seq=64, steps=2, warmup=2, model=MEDIUM, units=(Block, Embeddings, LMHead)
    ),
}


class _FSDP2GPT(GPTLightningModule):
    """FSDP2 needs ``fully_shard`` applied in ``configure_model`` (Lightning's ModelParallelStrategy)."""

    units: tuple[type[torch.nn.Module], ...] = (Block,)

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        if self.model is not None:
            return
        with torch.device("meta"):
            self.model = GPT(self.cfg)
        mesh = self.device_mesh["data_parallel"]
        for module in self.model:
            if isinstance(module, self.units):
                fully_shard(module, mesh=mesh)
        fully_shard(self.model, mesh=mesh)


class _MetaGPT(GPTLightningModule):
    """Built on the meta device for FSDP1, which materializes each unit with ``reset_parameters()``."""

    def configure_model(self) -> None:
        if self.model is None:
            with torch.device("meta"):
                self.model = GPT(self.cfg)


def _variant(name: str) -> tuple[str, str, bool]:
    """``"hai_fsdp:SHARD_GRAD_OP+ac"`` -> (``"hai_fsdp"``, ``"SHARD_GRAD_OP"``, activation checkpointing)."""
    base, ac = name.removesuffix("+ac"), name.endswith("+ac")
    base, _, sharding = base.partition(":")
    return base, sharding or "FULL_SHARD", ac


def _strategy(name: str, units: tuple[type[torch.nn.Module], ...]) -> tuple[Any, type[GPTLightningModule]]:
    """A strategy and its module: ``hai_fsdp``, ``fsdp2`` or ``fsdp1``, with ``:<sharding strategy>`` and ``+ac``
    (activation checkpointing of every Block) where the strategy has them (see :func:`_variant`)."""
    from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    from lightning_haiscale.strategies import HaiFSDPStrategy

    base, sharding, ac = _variant(name)
    checkpointing = {"activation_checkpointing_policy": {Block}} if ac else {}
    if base == "hai_fsdp":
        strategy = HaiFSDPStrategy(auto_wrap_policy=set(units), sharding_strategy=sharding, **checkpointing)
        return strategy, GPTLightningModule
    if base == "fsdp2":
        if ac or sharding != "FULL_SHARD":
            raise ValueError(f"{name}: the fsdp2 baseline runs FULL_SHARD without checkpointing only")
        module_cls = type("_FSDP2GPTUnits", (_FSDP2GPT,), {"units": units})
        return ModelParallelStrategy(data_parallel_size=WORLD, tensor_parallel_size=1), module_cls

    class CPUFSDPStrategy(FSDPStrategy):  # Lightning's "fsdp" refuses accelerator="cpu" otherwise
        def _setup_model(self, model: torch.nn.Module) -> torch.nn.Module:
            from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing
            from torch.distributed.fsdp import FullyShardedDataParallel

            wrapped = FullyShardedDataParallel(
                model, device_id=torch.device("cpu"), sharding_strategy=self.sharding_strategy, **self.kwargs
            )
            if ac:  # as Lightning's FSDPStrategy._setup_model applies it, after wrapping
                apply_activation_checkpointing(wrapped, check_fn=lambda m: isinstance(m, Block))
            return wrapped

    policy = ModuleWrapPolicy(set(units))
    return CPUFSDPStrategy(auto_wrap_policy=policy, use_orig_params=True, sharding_strategy=sharding), _MetaGPT


def _memory_mib() -> dict[str, float]:
    """This process's ``/proc/self/smaps_rollup`` totals in MiB (Rss, Pss, Pss_Shmem, ...)."""
    with open("/proc/self/smaps_rollup") as f:
        lines = f.read().splitlines()[1:]
    return {key.rstrip(":"): int(value) / 1024 for key, value, *_ in (line.split() for line in lines)}


class MemorySampler:
    """Peak Pss (see [Note: RSS and PSS]) of this process, sampled on a thread every ``interval`` seconds."""

    def __init__(self, interval: float = 0.01) -> None:
        self.peak_pss = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(interval,), daemon=True)
        self._thread.start()

    def sample(self) -> dict[str, float]:
        memory = _memory_mib()
        self.peak_pss = max(self.peak_pss, memory["Pss"])
        return memory

    def _run(self, interval: float) -> None:
        while not self._stop.wait(interval):
            self.sample()

    def stop(self) -> float:
        self._stop.set()
        self._thread.join()
        self.sample()
        return self.peak_pss


class PhaseSampler(L.Callback):
    """Rss / Pss / Pss_Shmem (MiB) at each phase of the first ``steps`` steps: where the memory goes. The
    sampler stops after them, so that it does not slow the steps timed after them."""

    def __init__(self, sampler: MemorySampler, steps: int) -> None:
        self.sampler = sampler
        self.steps = steps
        self.rows: list[str] = []

    def _record(self, trainer: L.Trainer, phase: str) -> None:
        if trainer.global_step < self.steps:
            m = self.sampler.sample()
            self.rows.append(
                f"step {trainer.global_step} {phase}: Rss {m['Rss']:.0f}, Pss {m['Pss']:.0f}, "
                f"Pss_Shmem {m['Pss_Shmem']:.0f}, Anonymous {m['Anonymous']:.0f}"
            )

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        self._record(trainer, "start")

    def on_before_backward(self, trainer: L.Trainer, *args: Any) -> None:
        self._record(trainer, "after forward")

    def on_after_backward(self, trainer: L.Trainer, *args: Any) -> None:
        self._record(trainer, "after backward")

    def on_before_optimizer_step(self, trainer: L.Trainer, *args: Any) -> None:
        self._record(trainer, "before step")

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self._record(trainer, "after step")
        if trainer.global_step == self.steps:
            self.sampler.stop()


class _Clock(L.Callback):
    """Wall time and this process's CPU time (every thread's: the engine's too) of the measured steps; CPU
    time per step is a counter that other jobs' load barely moves."""

    def __init__(self, warmup: int) -> None:
        self.warmup = warmup
        self.start = self.end = self.cpu_start = self.cpu_end = 0.0

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == self.warmup:
            self.start, self.cpu_start = time.perf_counter(), time.process_time()
        self.end, self.cpu_end = time.perf_counter(), time.process_time()


def _worker(rank: int, port: int, strategy_name: str, cfg: BenchConfig, model: GPTConfig, results: Any) -> None:
    sampler = MemorySampler()
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(WORLD),
        LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(WORLD), GROUP_RANK="0",
    )  # fmt: skip
    torch.set_num_threads(1)
    torch.manual_seed(0)
    strategy, module_cls = _strategy(strategy_name, cfg.units)
    rows = (cfg.steps + cfg.warmup) * cfg.batch * WORLD
    tokens = torch.randint(0, model.vocab_size, (rows, cfg.seq + 1), generator=torch.Generator().manual_seed(0))
    clock = _Clock(cfg.warmup)
    phases = PhaseSampler(sampler, steps=cfg.warmup)
    trainer = L.Trainer(
        strategy=strategy, accelerator="cpu", devices=WORLD, max_steps=cfg.steps + cfg.warmup, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
        num_sanity_val_steps=0, callbacks=[phases, clock],  # the sampler stops before the clock starts
    )  # fmt: skip
    data = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=cfg.batch)
    trainer.fit(module_cls(model), train_dataloaders=data)
    samples_per_s = cfg.steps * cfg.batch * WORLD / (clock.end - clock.start)
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    cpu = f"CPU {(clock.cpu_end - clock.cpu_start) / cfg.steps:.3f} s/step (rank {rank}, every thread)"
    results.put((rank, samples_per_s, peak_rss, sampler.stop(), [*phases.rows, cpu]))


@dataclass(frozen=True)
class Memory:
    """Peak memory of one 2-process run, MiB (see [Note: RSS and PSS])."""

    rss: float  # peak RSS of the larger rank (ru_maxrss)
    pss: float  # peak PSS of the larger rank (sampled)
    host_pss: float  # the ranks' peak PSS added up: at most what the host spent at its peak
    phases: list[str]  # rank 0's memory at each phase of the first steps


def run_one(strategy_name: str, cfg: BenchConfig, model: GPTConfig | None = None) -> tuple[float, float]:
    """(samples/s, peak RSS MiB of the larger rank) of one 2-process run (``model``: default ``cfg.model``)."""
    speed, memory = run_one_memory(strategy_name, cfg, model)
    return speed, memory.rss


def run_one_memory(strategy_name: str, cfg: BenchConfig, model: GPTConfig | None = None) -> tuple[float, Memory]:
    """(samples/s, peak memory) of one 2-process run (``model``: default ``cfg.model``)."""
    model = cfg.model if model is None else model
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
    out.sort(key=lambda o: o[0])
    memory = Memory(max(o[2] for o in out), max(o[3] for o in out), sum(o[3] for o in out), out[0][4])
    return min(o[1] for o in out), memory


Measured = tuple[float, float, float, float]  # samples/s, peak RSS, peak PSS, host PSS (MiB)


def _measure(names: list[str], cfg: BenchConfig, model: GPTConfig, repeats: int, phases: bool) -> dict[str, Measured]:
    """Best samples/s and highest peak memory of each strategy over ``repeats`` rounds; the order of the
    strategies is reversed every round, so load from other jobs on the machine hits them alike."""
    best: dict[str, Measured] = {}
    for round_ in range(repeats):
        for name in names if round_ % 2 == 0 else names[::-1]:
            speed, mem = run_one_memory(name, cfg, model)
            print(
                f"  round {round_}: {cfg.name} {name}: {speed:.3f} samples/s, peak RSS {mem.rss:.0f} MiB, "
                f"peak PSS {mem.pss:.0f} MiB (host {mem.host_pss:.0f})",
                flush=True,
            )
            if phases:
                print("\n".join(f"    {row}" for row in mem.phases), flush=True)
            old = best.get(name, (0.0, 0.0, 0.0, 0.0))
            best[name] = (max(old[0], speed), max(old[1], mem.rss), max(old[2], mem.pss), max(old[3], mem.host_pss))
    return best


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="benchmarks/strategies.py fsdp", description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default="comm,compute", help=f"of {', '.join(CONFIGS)}")
    parser.add_argument("--strategies", default="hai_fsdp,fsdp2,fsdp1")
    parser.add_argument("--repeats", type=int, default=2, help="rounds per config (best samples/s is kept)")
    parser.add_argument("--smoke", action="store_true", help="the tiny GPT: checks the script, measures nothing")
    parser.add_argument("--phases", action="store_true", help="print rank 0's memory at each phase of 2 steps")
    parser.add_argument("--json", type=Path, help="also write the rows here, for benchmarks/report.py")
    args = parser.parse_args(argv)
    names = args.strategies.split(",")
    rows, records = [], []
    for cfg_name in args.configs.split(","):
        cfg = CONFIGS[cfg_name]
        model = config("tiny", tie_weights=False) if args.smoke else cfg.model
        params = sum(p.numel() for p in GPT(model).parameters())
        units = ", ".join(u.__name__ for u in cfg.units)
        print(f"GPT {params / 1e6:.1f}M parameters, {WORLD} processes, fp32 AdamW, units: {units}", flush=True)
        measured = _measure(names, cfg, model, args.repeats, args.phases)
        label = f"{cfg.name} (B={cfg.batch}, T={cfg.seq})"
        records += _records(f"GPT {params / 1e6:.0f}M, {label}", measured)
        for name, values in measured.items():
            ours = measured.get(_ours(name), (float("nan"),) * 4)
            speed, rss, pss, host = values
            rows.append(
                f"| {label} | {name} | {speed:.2f} | {rss:.0f} | {pss:.0f} | {host:.0f} | {ours[0] / speed:.2f}x "
                f"| {ours[1] / rss:.2f}x | {ours[2] / pss:.2f}x |"
            )
    header = (
        "| config | strategy | samples/s | peak RSS/rank (MiB) | peak PSS/rank (MiB) | host PSS (MiB) "
        "| hai_fsdp samples/s ratio | hai_fsdp RSS ratio | hai_fsdp PSS ratio |"  # against the same mode's hai_fsdp
    )
    print("\n" + header + "\n|---|---|---|---|---|---|---|---|---|\n" + "\n".join(rows))
    if args.json is not None:
        args.json.write_text(json.dumps({"rows": records}, indent=1))
    return 0


_PEERS = {"fsdp2": "FSDP2 (ModelParallelStrategy)", "fsdp1": "FSDP1 (FSDPStrategy on CPU)"}


def _ours(name: str) -> str:
    """The hai_fsdp run of the same mode as ``name`` (``"fsdp1:SHARD_GRAD_OP"`` -> ``"hai_fsdp:SHARD_GRAD_OP"``)."""
    base, _, _ = _variant(name)
    return "hai_fsdp" + name[len(base) :]


def _records(config: str, measured: dict[str, Measured]) -> list[dict[str, Any]]:
    """Each peer run against hai_fsdp in the same mode (samples/s, peak memory); and, for each strategy measured
    with and without activation checkpointing, what checkpointing costs it and saves it, ours beside FSDP1's."""
    rows = []
    for name, theirs in measured.items():
        ours = measured.get(_ours(name))
        if ours is None or name == _ours(name):
            continue
        base, sharding, ac = _variant(name)
        mode = "" if (sharding, ac) == ("FULL_SHARD", False) else f" {sharding}{' + checkpointing' if ac else ''}"
        rows.append(_record(f"{config}{mode}", _PEERS.get(base, base), ours, theirs))
    if all(n in measured for n in ("hai_fsdp", "hai_fsdp+ac", "fsdp1", "fsdp1+ac")):
        (hai, hai_ac), (peer, peer_ac) = [(measured[n], measured[f"{n}+ac"]) for n in ("hai_fsdp", "fsdp1")]
        for metric, ours_value, peer_value in (
            ("activation checkpointing: peak PSS cut (x)", hai[2] / hai_ac[2], peer[2] / peer_ac[2]),
            ("activation checkpointing: samples/s kept (x)", hai_ac[0] / hai[0], peer_ac[0] / peer[0]),
        ):
            rows.append({"technique": "hai_fsdp", "config": config, "ours": "hai_fsdp", "peer": _PEERS["fsdp1"],
                         "metric": metric, "ours_value": ours_value, "peer_value": peer_value})  # fmt: skip
    return rows


def _record(config: str, peer: str, hai: Measured, theirs: Measured) -> dict[str, Any]:
    return {
        "technique": "hai_fsdp",
        "config": config,
        "ours": "hai_fsdp",
        "peer": peer,
        "metric": "samples/s",
        "ours_value": hai[0],
        "peer_value": theirs[0],
        "ours_rss_mib": hai[1],
        "peer_rss_mib": theirs[1],
        "ours_pss_mib": hai[2],
        "peer_pss_mib": theirs[2],
    }


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
