"""Hybrid sharding (issue 27 item 4): ``HaiFSDPStrategy(sharding_strategy="HYBRID_SHARD")`` against FSDP2's HSDP
(``fully_shard`` over a 2-D ``DeviceMesh``) and against our own ``FULL_SHARD``, on 2 simulated hosts x 2 ranks
(4 processes, gloo, CPU), side by side in one run: step time, peak PSS per rank, and the bytes that cross hosts.

    python -m benchmarks.strategies hybrid [--configs comm,compute] [--repeats 2] [--smoke] [--json rows.json]
    python -m benchmarks.strategies hybrid --smoke --configs comm --repeats 1   # the tiny GPT: checks the script

Strategies (``--strategies``, comma-separated; ours first):

- ``hai_hybrid``: ``HYBRID_SHARD`` without a mesh: shard within each host (2 ranks, shared memory), replicate
  across the 2 hosts (the engine's hierarchical path);
- ``fsdp2_hsdp``: ``ModelParallelStrategy`` with ``fully_shard`` over ``init_device_mesh("cpu", (2, 2),
  mesh_dim_names=("replicate", "shard"))``: shard groups ranks {0, 1} and {2, 3}, the simulated hosts, as ours;
- ``hai_full``: ``FULL_SHARD`` over all 4 ranks (the engine's hierarchical path for every collective).

Hosts are simulated with ``HFREDUCE_NODE_ID`` (ranks 0, 1 on one host, 2, 3 on the other), set by
``lightning_haiscale.testing.run_distributed`` before the engine starts. Every strategy builds the GPT on the
meta device, wraps every Block as a unit and the whole model as the root, and trains with AdamW in fp32.
Each (config, strategy) run is 4 fresh processes, so peak PSS is that run's own; it is sampled every 10 ms
during the warm-up steps (which hold the peak: see strategy_fsdp.py). Step time is the median over the measured
steps of the slowest rank's step; over ``--repeats`` rounds (order reversed every round) the fastest median
is kept. Bytes across hosts are counted per rank at the ``torch.distributed`` calls of the measured steps (see
cross_host.py [Note: counting bytes across hosts]) and set beside the ring's theory: for the hybrid runs one
all-reduce of the gradient shard over the 2 hosts, ``2 (R - 1) / R * 4P / S`` bytes per rank for ``P``
parameters, ``S = 2`` ranks per shard group and ``R = 2`` replicas (``= 2P``); for ``FULL_SHARD`` two
all-gathers and one reduce-scatter of the rank's shard across hosts, ``3 (H - 1) * 4P / W`` (``= 3P``). The
sharded model state per rank that the shard group's size predicts is ``16P / S`` bytes (fp32 parameter,
gradient and AdamW's two moments).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

from benchmarks.cross_host import CrossHostBytes, full_shard_theory, hybrid_theory
from benchmarks.strategy_fsdp import BenchConfig, MemorySampler, PhaseSampler
from examples.gpt.lightning_module import GPTLightningModule
from examples.gpt.model import GPT, Block, GPTConfig, config
from lightning_haiscale.testing import run_distributed

HOSTS = ("host0", "host0", "host1", "host1")  # HFREDUCE_NODE_ID of each rank
WORLD, REPLICATE, SHARD = len(HOSTS), 2, 2  # 2 hosts x 2 ranks: mesh (replicate, shard)
MODEL = config("small", n_layer=8, block_size=256, tie_weights=False)  # 57M parameters; 437 MiB of state/rank at S=2
CONFIGS = {
    "comm": BenchConfig("comm", batch=1, seq=32, steps=6, warmup=2, model=MODEL),  # collectives dominate
    "compute": BenchConfig("compute", batch=1, seq=128, steps=4, warmup=2, model=MODEL),  # matmuls weigh more
}
STRATEGIES = {  # name -> what it is, in the tables
    "hai_hybrid": "hai_fsdp HYBRID_SHARD",
    "fsdp2_hsdp": "FSDP2 HSDP (fully_shard, 2-D mesh)",
    "hai_full": "hai_fsdp FULL_SHARD",
}
OURS = "hai_hybrid"


class _HSDPGPT(GPTLightningModule):
    """FSDP2's HSDP: ``fully_shard`` of every Block and the root over a (replicate, shard) mesh, in
    ``configure_model`` as Lightning's ModelParallelStrategy expects (its own 1-D data-parallel mesh unused)."""

    def configure_model(self) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        if self.model is not None:
            return
        with torch.device("meta"):
            self.model = GPT(self.cfg)
        mesh = init_device_mesh("cpu", (REPLICATE, SHARD), mesh_dim_names=("replicate", "shard"))
        for module in self.model:
            if isinstance(module, Block):
                fully_shard(module, mesh=mesh)
        fully_shard(self.model, mesh=mesh)


def _strategy(name: str) -> tuple[Any, type[GPTLightningModule]]:
    from lightning.pytorch.strategies import ModelParallelStrategy

    from lightning_haiscale.strategies import HaiFSDPStrategy

    if name == "fsdp2_hsdp":
        return ModelParallelStrategy(data_parallel_size=WORLD, tensor_parallel_size=1), _HSDPGPT
    sharding = {"hai_hybrid": "HYBRID_SHARD", "hai_full": "FULL_SHARD"}[name]
    return HaiFSDPStrategy(auto_wrap_policy={Block}, sharding_strategy=sharding), GPTLightningModule


class _Steps(L.Callback):
    """Each step's wall time, and the bytes across hosts counted only over the steps after the warm-up."""

    def __init__(self, warmup: int, counter: CrossHostBytes) -> None:
        self.warmup = warmup
        self.counter = counter
        self.times: list[float] = []
        self._start = 0.0

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        self.counter.counting = trainer.global_step >= self.warmup
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step > self.warmup:  # global_step counts this step already
            self.times.append(time.perf_counter() - self._start)

    def on_train_end(self, trainer: L.Trainer, *args: Any) -> None:
        self.counter.counting = False


def _worker(rank: int, world: int, name: str, cfg: BenchConfig, model: GPTConfig) -> dict[str, Any]:
    sampler = MemorySampler()
    counter = CrossHostBytes(HOSTS).install()
    torch.manual_seed(0)
    strategy, module_cls = _strategy(name)
    rows = (cfg.steps + cfg.warmup) * cfg.batch * world
    tokens = torch.randint(0, model.vocab_size, (rows, cfg.seq + 1), generator=torch.Generator().manual_seed(0))
    steps, phases = _Steps(cfg.warmup, counter), PhaseSampler(sampler, steps=cfg.warmup)
    trainer = L.Trainer(
        strategy=strategy, accelerator="cpu", devices=world // REPLICATE, num_nodes=REPLICATE,
        max_steps=cfg.steps + cfg.warmup, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0, callbacks=[phases, steps],
    )  # fmt: skip
    data = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=cfg.batch)
    trainer.fit(module_cls(model), train_dataloaders=data)
    counter.uninstall()
    tally, measured = counter.tally, len(steps.times)
    return {
        "step_s": steps.times,
        "peak_pss_mib": sampler.stop(),
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "sent_per_step": tally.total_sent() / measured,
        "payload_per_step": {k: v / measured for k, v in tally.payload.items()},
        "calls_per_step": {k: v / measured for k, v in tally.calls.items()},
        "control_per_step": tally.control_bytes / measured,
        "phases": phases.rows,
    }


@dataclass
class Result:
    """One strategy on one config: the fastest median step of the rounds, the highest peaks."""

    step_ms: float = float("inf")
    pss_mib: list[float] | None = None  # peak PSS of each rank
    rss_mib: float = 0.0  # peak RSS of the larger rank
    sent_mb: float = 0.0  # bytes sent across hosts per rank per step (the larger rank), MB
    detail: dict[str, Any] | None = None  # rank 0's payload and calls per step by collective

    def add(self, ranks: list[dict[str, Any]]) -> None:
        self.step_ms = min(self.step_ms, _median_step_ms(ranks))
        pss = [r["peak_pss_mib"] for r in ranks]
        self.pss_mib = pss if self.pss_mib is None else [max(a, b) for a, b in zip(self.pss_mib, pss, strict=True)]
        self.rss_mib = max(self.rss_mib, *(r["peak_rss_mib"] for r in ranks))
        self.sent_mb = max(r["sent_per_step"] for r in ranks) / 1e6
        keys = ("payload_per_step", "calls_per_step", "control_per_step")
        self.detail = {k: ranks[0][k] for k in keys}


def _median_step_ms(ranks: list[dict[str, Any]]) -> float:
    """The median over the measured steps of the slowest rank's time for that step."""
    return statistics.median(max(step) for step in zip(*(r["step_s"] for r in ranks), strict=True)) * 1e3


def _theory_mb(name: str, params: int) -> float:
    if name == "hai_full":
        return full_shard_theory(params, WORLD, REPLICATE) / 1e6
    return hybrid_theory(params, SHARD, REPLICATE) / 1e6


def _measure(names: list[str], cfg: BenchConfig, model: GPTConfig, repeats: int, phases: bool) -> dict[str, Result]:
    results = {name: Result() for name in names}
    for round_ in range(repeats):
        for name in names if round_ % 2 == 0 else names[::-1]:
            ranks = run_distributed(_worker, WORLD, name, cfg, model, node_ids=HOSTS, timeout=1800)
            results[name].add(ranks)
            pss = ", ".join(f"{rank['peak_pss_mib']:.0f}" for rank in ranks)
            print(
                f"  round {round_}: {cfg.name} {name}: median step {_median_step_ms(ranks):.0f} ms, peak PSS per "
                f"rank [{pss}] MiB, across hosts {results[name].sent_mb:.2f} MB sent/rank/step; rank 0 per step: "
                f"{results[name].detail}",
                flush=True,
            )
            if phases:
                print("\n".join(f"    {row}" for row in ranks[0]["phases"]), flush=True)
    return results


def _table(label: str, params: int, results: dict[str, Result]) -> list[str]:
    ours = results.get(OURS)
    lines = []
    for name, r in results.items():
        theory = _theory_mb(name, params)
        shard = WORLD if name == "hai_full" else SHARD
        pss = r.pss_mib or [float("nan")]
        versus = f"{ours.step_ms / r.step_ms:.2f}x | {max(ours.pss_mib or pss) / max(pss):.2f}x" if ours else "|"
        lines.append(
            f"| {label} | {STRATEGIES[name]} | {r.step_ms:.0f} | {' / '.join(f'{p:.0f}' for p in pss)} "
            f"| {16 * params / shard / 2**20:.0f} | {versus} | {r.sent_mb:.2f} | {theory:.2f} "
            f"| {r.sent_mb / theory:.3f} |"
        )
    return lines


def _records(label: str, params: int, results: dict[str, Result]) -> list[dict[str, Any]]:
    """Our HYBRID_SHARD against each other strategy, as benchmarks/report.py reads rows (steps/s: higher is
    better), with the bytes across hosts per rank per step beside the theory."""
    ours = results.get(OURS)
    rows = []
    for name, theirs in results.items():
        if ours is None or name == OURS:
            continue
        rows.append({
            "technique": "hai_fsdp HYBRID_SHARD", "config": label, "ours": STRATEGIES[OURS],
            "peer": STRATEGIES[name], "metric": "steps/s (median step)",
            "ours_value": 1e3 / ours.step_ms, "peer_value": 1e3 / theirs.step_ms,
            "ours_rss_mib": ours.rss_mib, "peer_rss_mib": theirs.rss_mib,
            "ours_pss_mib": max(ours.pss_mib or [0]), "peer_pss_mib": max(theirs.pss_mib or [0]),
            "ours_cross_host_mb": ours.sent_mb, "peer_cross_host_mb": theirs.sent_mb,
            "ours_cross_host_theory_mb": _theory_mb(OURS, params),
            "peer_cross_host_theory_mb": _theory_mb(name, params),
        })  # fmt: skip
    return rows


HEADER = (
    "| config | strategy | median step (ms) | peak PSS per rank (MiB, ranks 0-3) | sharded state/rank, theory "
    "(MiB) | hai_hybrid step-time ratio (ours / this) | hai_hybrid peak PSS ratio | sent across hosts "
    "(MB/rank/step) | theory (MB) | measured / theory |\n|---|---|---|---|---|---|---|---|---|---|"
)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="benchmarks/strategies.py hybrid", description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default="comm,compute", help=f"of {', '.join(CONFIGS)}")
    parser.add_argument("--strategies", default=",".join(STRATEGIES), help=f"of {', '.join(STRATEGIES)}")
    parser.add_argument("--repeats", type=int, default=2, help="rounds per config (fastest median step is kept)")
    parser.add_argument("--smoke", action="store_true", help="the tiny GPT: checks the script, measures nothing")
    parser.add_argument("--phases", action="store_true", help="print rank 0's memory at each phase of 2 steps")
    parser.add_argument("--json", type=Path, help="also write the rows here, for benchmarks/report.py")
    args = parser.parse_args(argv)
    names, configs = args.strategies.split(","), args.configs.split(",")
    for given, known, flag in ((names, STRATEGIES, "--strategies"), (configs, CONFIGS, "--configs")):
        if unknown := sorted(set(given) - set(known)):
            parser.error(f"{flag}: unknown {unknown}; choose from {sorted(known)}")
    lines, records = [], []
    for cfg_name in configs:
        cfg = CONFIGS[cfg_name]
        model = config("tiny", tie_weights=False) if args.smoke else cfg.model
        params = sum(p.numel() for p in GPT(model).parameters())
        print(f"GPT {params / 1e6:.1f}M parameters, {len(HOSTS) // REPLICATE} ranks x {REPLICATE} simulated "
              f"hosts, fp32 AdamW, units: Block", flush=True)  # fmt: skip
        results = _measure(names, cfg, model, args.repeats, args.phases)
        label = f"GPT {params / 1e6:.0f}M, {cfg.name} (B={cfg.batch}, T={cfg.seq}), 2 hosts x 2"
        lines += _table(label, params, results)
        records += _records(label, params, results)
    print("\n" + HEADER + "\n" + "\n".join(lines))
    if args.json is not None:
        args.json.write_text(json.dumps({"rows": records}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
