"""Pipelines composed with sharding (issue 35 item 5), side by side in one run on 4 ranks (gloo, CPU): 2 pipelines
of 2 stages, each stage sharded (or replicated) over the 2 pipelines.

    python -m benchmarks.strategy_pp_fsdp [--preset small] [--order abba] [--json rows.json]
    python -m benchmarks.strategies pp_fsdp --preset smoke --order ab   # the tiny GPT: checks the script

Configurations (``--configs``, comma-separated):

- ``pp_fsdp``: ours, the plain composition: ``make_subgroups(pp_size=2)`` gives ``(dp_group, pp_group)``; each
  stage (``partition``) is wrapped in ``lightning_haiscale.fsdp.FullyShardedDataParallel(stage,
  process_group=dp_group, auto_wrap_policy={Block})``, then ``PipeDream(wrapped, chunks, process_group=pp_group)``;
- ``dp_pp``: ours, the same with ``lightning_haiscale.ddp.DistributedDataParallel(stage, process_group=dp_group)``;
- ``titan``: the torchtitan composition (see [Note: the torchtitan-style composition]): FSDP2 ``fully_shard`` of
  every Block and of the stage root over the ``dp`` dimension of ``init_device_mesh("cpu", (2, 2),
  mesh_dim_names=("dp", "pp"))``, then ``torch.distributed.pipelining``'s ``PipelineStage`` and ``Schedule1F1B``
  over the ``pp`` dimension.

All three: the same GPT (``examples/gpt/model.py``, untied head, float32), the same stages (``partition``: the
embedding and the first half of the blocks, then the rest and the head), the same global batch (``2 pipelines x
chunks x rows`` sequences, each pipeline its own rows), ``chunks=4`` microbatches, each microbatch's loss divided
by ``chunks`` (haiscale's ``GPTLoss(chunks)``; torch's schedule with ``scale_grads=False``, as torchtitan), SGD
with momentum 0.9 (so the optimizer has a state to shard). Each stage is built alone (the whole model only on the
meta device) and materialized before wrapping, so no rank ever holds the whole model.

Every configuration runs in 4 fresh processes; ``--order abba`` (default) runs them as A B C C B A and takes each
side's mean step time, so that a load that rises or falls through the run (other jobs on a shared machine) weighs
on all alike; the same-side spread (slowest / fastest run of one configuration - 1, the largest) is the run's noise.

Reported per configuration:

- samples/s: the global batch over the median, over the measured steps, of the slowest rank's step; beside it the
  CPU time of a step (``time.process_time``, every thread of the process: the engine's and gloo's too), the median
  of the busiest rank, a counter that other jobs' load moves far less than wall time;
- peak memory per rank, from the first step on (setup's transient peak left out): peak PSS sampled from
  ``/proc/self/smaps_rollup`` every 10 ms during the warm-up steps (strategy_fsdp.py [Note: RSS and PSS]; the
  peak comes in the second step, once the optimizer state exists; sampling stops before the timed steps, whose
  speed it would cost), and peak RSS (``VmHWM``, reset by ``/proc/self/clear_refs`` after setup, over every step);
- collective calls and bytes per step per rank, over the measured steps: for ours the engine's, counted by a
  :class:`EngineCounter` around the ``Communicator``'s public collectives (every engine of the run); for
  FSDP2 its ``torch.distributed`` calls (``cross_host.CrossHostBytes`` with every rank its own host, so every
  group counts). Bytes: an all-gather's gathered (output) bytes, a reduce-scatter's input, an all-reduce's tensor.
  Beside them the theory of [Note: collectives per step].

[Note: the torchtitan-style composition]
torchtitan (``torchtitan/models/llama3/infra/pipeline.py``, ``parallelize.py``) builds each stage's model part,
wraps it in a ``PipelineStage`` over the ``pp`` mesh's group, applies ``fully_shard`` to the token embedding, to
every transformer block and to ``[norm, output]``, and then to the part itself, over the data-parallel mesh, and
runs a schedule whose loss is divided by the microbatches (``scale_grads=False``). With pipelining enabled its
default ``reshard_after_forward`` policy is ``not pp_enabled``: blocks and embedding keep their gathered parameters
from forward to backward "to avoid per-microbatch all-gathers", ``[norm, output]`` likewise, the root takes
FSDP2's default. torch's ``PipelineStage`` then keeps every FSDP2 unit gathered and its gradient unsharded across
the microbatches (``set_reshard_after_backward(False)``, ``set_requires_gradient_sync(False)``) and reduce-scatters
once, after the last backward (``perform_reduce_grad``). Here: the same, by hand, with the units ours has (every
Block, and the stage root holding the embedding or the head), ``reshard_after_forward=False`` on the Blocks.

[Note: collectives per step]
A stage of ``B`` Blocks (``P_b`` parameters) and a root unit (``P_r``: embedding or head), ``m`` microbatches, ``D``
data-parallel ranks, 4 bytes a parameter. Gathered once per step (torchtitan, and the issue's goal): ``B + 1``
all-gathers of ``4 (P_b + P_r)`` bytes in all, and ``B + 1`` reductions of as many. Gathered per microbatch (each
unit's forward and backward of each microbatch gathers it; the root stays gathered from its forward to its
backward): ``m (2B + 1)`` all-gathers of ``4 m (2 P_b + P_r)`` bytes, one reduction per unit per step (the
microbatches before the last accumulate under ``no_sync``). DP x PP: every gradient all-reduced once per step,
``4 (P_b + P_r)`` bytes: each gradient of 1 MiB or more in place, one call each, the smaller ones packed into
25 MiB buckets (ddp/reducer.py [Note: where gradients live]; the calls as the reducer's own ``plan_buckets``
plans them). The sharded state per rank: parameters, gradients and momentum, ``12 (P_b + P_r) / D`` bytes against
DP x PP's ``12 (P_b + P_r)``: the memory the sharding can save is ``12 (P_b + P_r) (D - 1) / D``.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import socket
import statistics
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from benchmarks.cross_host import CrossHostBytes
from benchmarks.strategy_fsdp import MemorySampler
from examples.gpt.model import GPT, Block, GPTConfig, config, lm_loss
from lightning_haiscale.hfreduce import Communicator, Work

WORLD, PP, DP = 4, 2, 2  # 2 pipelines of 2 stages; a pipeline is 2 consecutive ranks
CHUNKS = 4
BUCKET_CAP_MB = 25  # DistributedDataParallel's default
CONFIGS = {  # name -> what it is, in the tables
    "pp_fsdp": "ours PP x FSDP (PipeDream + FullyShardedDataParallel)",
    "dp_pp": "ours DP x PP (PipeDream + DistributedDataParallel)",
    "titan": "torchtitan-style (FSDP2 fully_shard + Schedule1F1B)",
}


@dataclass(frozen=True)
class Preset:
    model: GPTConfig
    seq: int  # tokens per sequence
    rows: int  # sequences per microbatch
    steps: int  # measured steps
    warmup: int  # steps before measuring (the memory peak comes in the second)


PRESETS = {
    "smoke": Preset(config("tiny", tie_weights=False), seq=32, rows=1, steps=2, warmup=2),  # checks the script
    # 57M parameters (8 x 768, byte vocabulary): 2 fresh 4-process runs of each configuration in a few minutes here
    "small": Preset(config("small", n_layer=8, block_size=256, tie_weights=False), seq=128, rows=1, steps=4, warmup=2),
    # the target size: GPT-2 Medium, untied, 406M parameters (about 10 GiB for the 4 ranks)
    "medium": Preset(
        config("medium", vocab_size=50257, block_size=128, tie_weights=False), seq=64, rows=1, steps=3, warmup=2
    ),
}


class EngineCounter:
    """Counts the engine's collectives issued while :attr:`counting`: calls and bytes by kind (an all-gather's
    output, a reduce-scatter's input, an all-reduce's or broadcast's tensor). :meth:`install` wraps the
    ``Communicator``'s public collectives for this process (a benchmark process of its own): the wrappers build
    their engines themselves, so every engine of the run is counted."""

    _KINDS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast")

    def __init__(self) -> None:
        self.counting = False
        self.calls: dict[str, int] = {}
        self.bytes: dict[str, int] = {}
        self._lock = threading.Lock()

    def install(self) -> EngineCounter:
        for kind in self._KINDS:
            setattr(Communicator, kind, self._counted(kind, getattr(Communicator, kind)))
        return self

    def _counted(self, kind: str, collective: Callable[..., Work | None]) -> Callable[..., Work | None]:
        def counted(comm: Communicator, *args: Any, **kwargs: Any) -> Work | None:
            tensor = args[0] if kind in ("all_reduce", "broadcast", "all_gather") else args[1]  # see the docstring
            self._count(kind, tensor)
            return collective(comm, *args, **kwargs)

        return counted

    def _count(self, kind: str, tensor: torch.Tensor) -> None:
        if self.counting:
            with self._lock:
                self.calls[kind] = self.calls.get(kind, 0) + 1
                self.bytes[kind] = self.bytes.get(kind, 0) + tensor.numel() * tensor.element_size()


# ------------------------------------------------------------------------------------------------ the stages


def build_stage(model: GPTConfig, stage: int) -> nn.Module:
    """This rank's stage of the GPT, materialized alone (the whole model exists only on the meta device), each
    stage with its own seed, initialized as ``GPT`` initializes its modules."""
    from lightning_haiscale.pipeline import partition

    with torch.device("meta"):
        whole = GPT(model)
    part = partition(whole, stage, PP).to_empty(device="cpu")
    torch.manual_seed(stage)
    with torch.no_grad():
        for module in part.modules():
            if hasattr(module, "reset_parameters"):
                module.reset_parameters()  # LayerNorm's ones and zeros; Linear and Embedding are redone below
            GPT._init_weights(module)
    return part


def stage_sizes(part: nn.Module) -> dict[str, int]:
    """Blocks, their parameters, the parameters outside them (the root unit: embedding or head), and the
    all-reduces a DP x PP step issues by the reducer's own plan (see [Note: collectives per step])."""
    from lightning_haiscale.ddp import plan_buckets
    from lightning_haiscale.ddp.reducer import IN_PLACE_BYTES

    blocks = [m for m in part.modules() if isinstance(m, Block)]
    in_blocks = sum(p.numel() for b in blocks for p in b.parameters())
    params = list(part.parameters())
    in_place = [p.numel() * p.element_size() >= IN_PLACE_BYTES for p in params]
    buckets = plan_buckets(params, BUCKET_CAP_MB * 2**20, in_place)
    return {
        "blocks": len(blocks),
        "block_params": in_blocks,
        "root_params": sum(p.numel() for p in params) - in_blocks,
        "ddp_calls": sum(len(b.in_place) + bool(b.params) for b in buckets),
    }


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return lm_loss(logits, targets) / CHUNKS  # haiscale's GPTLoss(chunks): the step's gradient is the batch mean's


Step = Callable[[torch.Tensor, torch.Tensor], None]


def _ours(name: str, part: nn.Module) -> tuple[Step, list[nn.Parameter], EngineCounter]:
    from lightning_haiscale.ddp import DistributedDataParallel
    from lightning_haiscale.fsdp import FullyShardedDataParallel
    from lightning_haiscale.pipeline import PipeDream, make_subgroups

    dp_group, pp_group = make_subgroups(pp_size=PP, timeout=timedelta(minutes=30))
    comm = EngineCounter().install()
    timeout = timedelta(minutes=30)
    if name == "pp_fsdp":
        wrapped: nn.Module = FullyShardedDataParallel(
            part, process_group=dp_group, auto_wrap_policy={Block}, timeout=timeout
        )
    else:
        engine = Communicator(dp_group, timeout=timeout)
        wrapped = DistributedDataParallel(
            part, process_group=dp_group, bucket_cap_mb=BUCKET_CAP_MB, communicator=engine
        )
    pipe = PipeDream(wrapped, CHUNKS, process_group=pp_group)

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        pipe.forward_backward(x, criterion=_loss, labels=(y,))

    return step, list(wrapped.parameters()), comm


def _titan(part: nn.Module) -> tuple[Step, list[nn.Parameter]]:
    """[Note: the torchtitan-style composition]."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    mesh = init_device_mesh("cpu", (DP, PP), mesh_dim_names=("dp", "pp"))  # pp innermost: rank = dp * PP + pp
    for module in part.modules():
        if isinstance(module, Block):
            fully_shard(module, mesh=mesh["dp"], reshard_after_forward=False)  # torchtitan's default under PP
    fully_shard(part, mesh=mesh["dp"])
    stage_index = mesh["pp"].get_local_rank()
    stage = PipelineStage(part, stage_index, PP, torch.device("cpu"), group=mesh.get_group("pp"))
    schedule = Schedule1F1B(stage, CHUNKS, loss_fn=_loss, scale_grads=False)

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        if stage_index == 0:
            schedule.step(x)
        else:
            schedule.step(target=y, losses=[])

    return step, list(part.parameters())


# ------------------------------------------------------------------------------------------------ one run


def _peak_rss_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM")) / 1024


def _reset_peak_rss() -> None:
    """Sets ``VmHWM`` to the present RSS (Linux ``clear_refs`` 5), so the peak after it is the steps' own."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _worker(rank: int, name: str, preset: Preset) -> dict[str, Any]:
    stage = rank % PP
    part = build_stage(preset.model, stage)
    sizes = stage_sizes(part)
    comm, torch_calls = None, None
    if name == "titan":
        torch_calls = CrossHostBytes([f"rank{r}" for r in range(WORLD)]).install()  # every group counts
        step, params = _titan(part)
    else:
        step, params, comm = _ours(name, part)
    opt = torch.optim.SGD(params, lr=1e-3, momentum=0.9)
    batch = CHUNKS * preset.rows  # each pipeline's share of the global batch
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, preset.model.vocab_size, (DP * batch, preset.seq + 1), generator=g)
    mine = tokens[(rank // PP) * batch : (rank // PP + 1) * batch]
    x, y = mine[:, :-1].contiguous(), mine[:, 1:].contiguous()
    dist.barrier()
    _reset_peak_rss()
    sampler = MemorySampler()
    times, cpu = [], []
    for i in range(preset.warmup + preset.steps):
        measured = i >= preset.warmup
        if comm is not None:
            comm.counting = measured
        if torch_calls is not None:
            torch_calls.counting = measured
        if i == preset.warmup:
            peak_pss = sampler.stop()
        dist.barrier()
        start, cpu_start = time.perf_counter(), time.process_time()
        opt.zero_grad()
        step(x, y)
        opt.step()
        if measured:
            times.append(time.perf_counter() - start)
            cpu.append(time.process_time() - cpu_start)
    dist.barrier()
    result = {"step_s": times, "cpu_s": cpu, "peak_pss_mib": peak_pss, "peak_rss_mib": _peak_rss_mib(), **sizes}
    result["calls"], result["bytes"] = _per_step(comm, torch_calls, preset.steps)
    return result


def _per_step(
    comm: EngineCounter | None, torch_calls: CrossHostBytes | None, steps: int
) -> tuple[dict[str, float], dict[str, float]]:
    """Calls and bytes per step by kind (an all-gather's gathered bytes: its input times the group's size)."""
    if comm is not None:
        return {k: v / steps for k, v in comm.calls.items()}, {k: v / steps for k, v in comm.bytes.items()}
    if torch_calls is None:
        return {}, {}
    torch_calls.uninstall()
    tally = torch_calls.tally
    scale = {"all_gather": DP}
    nbytes = {k: v * scale.get(k, 1) / steps for k, v in tally.payload.items()}
    return {k: v / steps for k, v in tally.calls.items()}, nbytes


def _entry(rank: int, port: int, name: str, preset: Preset, results: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=timedelta(minutes=30))
        results.put((rank, _worker(rank, name, preset), None))
    except BaseException:
        results.put((rank, None, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_once(name: str, preset: Preset, timeout: float = 3600) -> list[dict[str, Any]]:
    """One configuration on 4 fresh processes; each rank's result, by rank."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_entry, args=(r, port, name, preset, results), daemon=True) for r in range(WORLD)]
    for p in procs:
        p.start()
    deadline, out = time.monotonic() + timeout, {}
    try:
        while len(out) < WORLD:
            try:
                rank, value, error = results.get(timeout=5)
            except queue.Empty:
                if time.monotonic() > deadline or any(p.exitcode not in (None, 0) for p in procs):
                    raise RuntimeError(f"{name}: a rank died or the run passed {timeout:.0f} s") from None
                continue
            if error:
                raise RuntimeError(f"{name}: rank {rank} failed:\n{error}")
            out[rank] = value
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return [out[r] for r in range(WORLD)]


# ------------------------------------------------------------------------------------------------ results


@dataclass
class Result:
    """One configuration over its runs: each run's median step, the highest peaks, rank 0/1's collectives."""

    step_s: list[float] = field(default_factory=list)
    cpu_s: list[float] = field(default_factory=list)  # each run's median CPU time per step of the busiest rank
    pss_mib: list[float] = field(default_factory=lambda: [0.0] * WORLD)
    rss_mib: list[float] = field(default_factory=lambda: [0.0] * WORLD)
    ranks: list[dict[str, Any]] = field(default_factory=list)  # the last run's

    def add(self, ranks: list[dict[str, Any]]) -> float:
        median = statistics.median(max(s) for s in zip(*(r["step_s"] for r in ranks), strict=True))
        self.step_s.append(median)
        self.cpu_s.append(max(statistics.median(r["cpu_s"]) for r in ranks))
        self.pss_mib = [max(a, r["peak_pss_mib"]) for a, r in zip(self.pss_mib, ranks, strict=True)]
        self.rss_mib = [max(a, r["peak_rss_mib"]) for a, r in zip(self.rss_mib, ranks, strict=True)]
        self.ranks = ranks
        return median

    @property
    def mean_step_s(self) -> float:
        return statistics.fmean(self.step_s)

    def spread(self) -> float:
        return max(self.step_s) / min(self.step_s) - 1


def theory(r: dict[str, Any], name: str) -> dict[str, str]:
    """[Note: collectives per step] for one rank's stage, as text by kind."""
    b, pb, pr = r["blocks"], r["block_params"], r["root_params"]
    mb = 2**20
    if name == "dp_pp":
        return {"all_reduce": f"{r['ddp_calls']} / {4 * (pb + pr) / mb:.0f} MiB"}
    once = f"{b + 1} / {4 * (pb + pr) / mb:.0f} MiB"
    per_microbatch = f"{CHUNKS * (2 * b + 1)} / {4 * CHUNKS * (2 * pb + pr) / mb:.0f} MiB"
    return {"all_gather": f"once a step {once}; per microbatch {per_microbatch}", "reduce": once}


def _collectives(r: dict[str, Any]) -> str:
    kinds = sorted(r["calls"])
    return ", ".join(f"{k} {r['calls'][k]:g} / {r['bytes'][k] / 2**20:.0f} MiB" for k in kinds) or "none"


def _print_table(preset_name: str, global_batch: int, results: dict[str, Result]) -> None:
    print(f"\n| config ({preset_name}) | samples/s | mean median step (s) | peak PSS/rank MiB (ranks 0-3) "
          "| peak RSS/rank MiB (ranks 0-3) | same-side spread | CPU s/step (busiest rank) |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for name, res in results.items():
        print(
            f"| {CONFIGS[name]} | {global_batch / res.mean_step_s:.3f} | {res.mean_step_s:.2f} "
            f"| {' / '.join(f'{v:.0f}' for v in res.pss_mib)} | {' / '.join(f'{v:.0f}' for v in res.rss_mib)} "
            f"| {res.spread():.1%} | {statistics.fmean(res.cpu_s):.2f} |"
        )
    print("\nCollectives per step per rank, measured (calls / bytes) and in theory ([Note: collectives per step]):")
    print("| config | rank | measured | theory (calls / bytes) |\n|---|---|---|---|")
    for name, res in results.items():
        for rank in (0, 1):  # one rank of each stage; ranks 2, 3 mirror them
            r = res.ranks[rank]
            text = "; ".join(f"{k}: {v}" for k, v in theory(r, name).items())
            print(f"| {name} | {rank} (stage {rank % PP}) | {_collectives(r)} | {text} |")


def _ratios(results: dict[str, Result], global_batch: int) -> list[str]:
    lines = []
    ours = results.get("pp_fsdp")
    if ours is None:
        return lines
    if "titan" in results:
        titan = results["titan"]
        speed = titan.mean_step_s / ours.mean_step_s
        memory = max(ours.pss_mib) / max(titan.pss_mib)
        rss = max(ours.rss_mib) / max(titan.rss_mib)
        lines.append(f"ours PP x FSDP / torchtitan-style: speed {speed:.2f}x (goal >= 1.0x), peak PSS per rank "
                     f"{memory:.2f}x (goal <= 0.8x), peak RSS {rss:.2f}x")  # fmt: skip
    if "dp_pp" in results:
        ddp = results["dp_pp"]
        r = ours.ranks[0]
        saving = 12 * (r["block_params"] + r["root_params"]) * (DP - 1) / DP / 2**20
        cut, speed = max(ddp.pss_mib) - max(ours.pss_mib), ddp.mean_step_s / ours.mean_step_s
        lines.append(f"ours PP x FSDP / DP x PP: peak PSS per rank {max(ours.pss_mib) / max(ddp.pss_mib):.2f}x "
                     f"({abs(cut):.0f} MiB {'less' if cut >= 0 else 'more'}; the sharded state's share, "
                     f"12 P (D-1)/D of stage 0: {saving:.0f} MiB), speed {speed:.2f}x")  # fmt: skip
    return lines


def _records(label: str, global_batch: int, results: dict[str, Result], noise: float) -> list[dict[str, Any]]:
    ours = results.get("pp_fsdp")
    rows = []
    for peer in ("titan", "dp_pp"):
        if ours is None or peer not in results:
            continue
        theirs = results[peer]
        rows.append({
            "technique": "PP x FSDP, 2 stages x 2 shards", "config": label, "ours": CONFIGS["pp_fsdp"],
            "peer": CONFIGS[peer], "metric": "samples/s", "ours_value": global_batch / ours.mean_step_s,
            "peer_value": global_batch / theirs.mean_step_s, "ours_pss_mib": max(ours.pss_mib),
            "peer_pss_mib": max(theirs.pss_mib), "ours_rss_mib": max(ours.rss_mib),
            "peer_rss_mib": max(theirs.rss_mib), "spread": noise,
        })  # fmt: skip
    return rows


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="benchmarks/strategy_pp_fsdp.py", description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small", choices=sorted(PRESETS))
    parser.add_argument("--configs", default=",".join(CONFIGS), help=f"of {', '.join(CONFIGS)}")
    parser.add_argument("--order", choices=("abba", "ab"), default="abba",
                        help="abba: A B C C B A, each a fresh run; ab: each once")  # fmt: skip
    parser.add_argument("--json", type=Path, help="also write the rows here, for benchmarks/report.py")
    args = parser.parse_args(argv)
    names = args.configs.split(",")
    if unknown := sorted(set(names) - set(CONFIGS)):
        parser.error(f"--configs: unknown {unknown}; choose from {sorted(CONFIGS)}")
    preset = PRESETS[args.preset]
    with torch.device("meta"):
        params = sum(p.numel() for p in GPT(preset.model).parameters())
    global_batch = DP * CHUNKS * preset.rows
    label = (f"GPT {params / 1e6:.0f}M ({preset.model.n_layer} x {preset.model.n_embd}), batch {global_batch} x "
             f"{preset.seq}, chunks {CHUNKS}, fp32 SGD")  # fmt: skip
    print(f"{label}; {WORLD} ranks: {DP} pipelines x {PP} stages (gloo, CPU)", flush=True)
    results = {name: Result() for name in names}
    for name in names + names[::-1] if args.order == "abba" else names:
        ranks = run_once(name, preset)
        median = results[name].add(ranks)
        pss = ", ".join(f"{r['peak_pss_mib']:.0f}" for r in ranks)
        print(f"  {name}: median step {median:.2f} s, peak PSS per rank [{pss}] MiB; rank 0 per step: "
              f"{_collectives(ranks[0])}; rank 1: {_collectives(ranks[1])}", flush=True)  # fmt: skip
    _print_table(args.preset, global_batch, results)
    print("\n" + "\n".join(_ratios(results, global_batch)))
    noise = max(r.spread() for r in results.values())
    if args.json is not None:
        args.json.write_text(json.dumps({"rows": _records(label, global_batch, results, noise)}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
