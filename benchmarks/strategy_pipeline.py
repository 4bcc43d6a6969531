"""Our GPipe / PipeDream / Interleaved1F1B against torch.distributed.pipelining's ScheduleGPipe / Schedule1F1B /
ScheduleInterleaved1F1B on the same GPT stages, 2 processes (gloo): ``python -m benchmarks.strategies pipeline``.

Every (schedule, implementation) runs in a fresh pair of processes, so the first stage's peak RSS is its own; by
default in the order ours, torch, torch, ours (``--order abba``), each side's mean step time, so that a load that
changes through the run (other processes on a shared machine) weighs on both sides alike.
Reported per run: samples/s (median step time after warm-up), the first stage's peak RSS, and the first
stage's peak of activation bytes saved for backward (counted by ``saved_tensors_hooks`` in one extra step).
With ``abba``, the same-side spread (how far the two runs of one implementation are apart) is the run's noise:
the same kernels run on both sides, so a ratio within it says the two are not told apart by this run.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Generator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from examples.gpt.model import GPT, config, lm_loss
from lightning_haiscale.pipeline import GPipe, Interleaved1F1B, PipeDream, partition

PAIRS = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved": "ScheduleInterleaved1F1B"}


class SavedBytes:
    """Live bytes of tensors saved for backward inside ``track()`` (and their peak), deduplicated by storage."""

    def __init__(self) -> None:
        self.live = self.peak = 0
        self.refs: dict[int, int] = {}
        self.enabled = False

    @contextmanager
    def track(self) -> Generator[None, None, None]:
        if not self.enabled:
            yield
            return
        with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda saved: saved.tensor):
            yield

    def _pack(self, t: torch.Tensor) -> Any:
        return _Saved(self, t)


class _Saved:
    def __init__(self, owner: SavedBytes, t: torch.Tensor) -> None:
        self.owner, self.tensor, self.key = owner, t, t.untyped_storage().data_ptr()
        count = owner.refs.get(self.key, 0)
        if count == 0:
            owner.live += t.untyped_storage().nbytes()
            owner.peak = max(owner.peak, owner.live)
        owner.refs[self.key] = count + 1
        self.nbytes = t.untyped_storage().nbytes()

    def __del__(self) -> None:
        self.owner.refs[self.key] -= 1
        if self.owner.refs[self.key] == 0:
            del self.owner.refs[self.key]
            self.owner.live -= self.nbytes


class Tracked(nn.Module):
    """A stage whose forward counts what it saves for backward (used by both implementations alike)."""

    def __init__(self, module: nn.Module, counter: SavedBytes) -> None:
        super().__init__()
        self.module, self.counter = module, counter

    def forward(self, *args: Any) -> Any:
        with self.counter.track():
            return self.module(*args)


def _stages(args: argparse.Namespace, rank: int, counter: SavedBytes) -> list[nn.Module]:
    torch.manual_seed(0)
    gpt = GPT(config(args.config, tie_weights=False, n_layer=args.layers, n_embd=args.width, block_size=args.seq))
    chunks = 2 if args.schedule == "interleaved" else 1
    parts = partition(gpt, rank, 2, num_model_chunks=chunks)
    return [Tracked(p, counter) for p in (parts if isinstance(parts, list) else [parts])]


def _ours(args: argparse.Namespace, stages: list[nn.Module]) -> Callable[[torch.Tensor, torch.Tensor], None]:
    if args.schedule == "interleaved":
        pipe: Any = Interleaved1F1B(stages, args.chunks)
    elif args.schedule == "gpipe":
        pipe = GPipe(stages[0], args.chunks)
    else:
        pipe = PipeDream(stages[0], args.chunks)
    return lambda x, y: pipe.forward_backward(x, criterion=lm_loss, labels=(y,))


def _torch(
    args: argparse.Namespace, stages: list[nn.Module], rank: int
) -> Callable[[torch.Tensor, torch.Tensor], None]:
    from torch.distributed import pipelining

    num_stages = 2 * len(stages)
    pipe_stages = [
        pipelining.PipelineStage(s, rank + 2 * k, num_stages, torch.device("cpu")) for k, s in enumerate(stages)
    ]
    cls = getattr(pipelining, PAIRS[args.schedule])
    schedule = cls(pipe_stages if len(pipe_stages) > 1 else pipe_stages[0], args.chunks, loss_fn=lm_loss)

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        if rank == 0:  # rank 0 holds the first (virtual) stage, rank 1 the last
            schedule.step(x)
        else:
            schedule.step(target=y, losses=[])

    return step


def _worker(rank: int, args: argparse.Namespace, port: int, results: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(args.threads)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(minutes=5))
        counter = SavedBytes()
        stages = _stages(args, rank, counter)
        step = _ours(args, stages) if args.impl == "ours" else _torch(args, stages, rank)
        params = [p for s in stages for p in s.parameters()]
        opt = torch.optim.SGD(params, lr=1e-3)
        g = torch.Generator().manual_seed(0)
        x = torch.randint(0, 256, (args.batch, args.seq), generator=g)
        y = torch.randint(0, 256, (args.batch, args.seq), generator=g)
        times = []
        for i in range(args.warmup + args.steps + 1):
            counter.enabled = i == args.warmup + args.steps  # one extra, untimed step counts saved bytes
            dist.barrier()
            start = time.perf_counter()
            opt.zero_grad()
            step(x, y)
            opt.step()
            dist.barrier()
            if args.warmup <= i < args.warmup + args.steps:
                times.append(time.perf_counter() - start)
        rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        results.put((rank, statistics.median(times), rss_mib, counter.peak / 2**20, None))
    except BaseException:
        results.put((rank, 0.0, 0.0, 0.0, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_pair(args: argparse.Namespace) -> dict[str, float]:
    """One (schedule, implementation) on 2 fresh processes; rank 0's (first stage's) numbers."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, args, port, results)) for r in range(2)]
    for p in procs:
        p.start()
    rows = [results.get(timeout=1200) for _ in range(2)]
    for p in procs:
        p.join()
    for rank, _, _, _, error in rows:
        if error:
            raise RuntimeError(f"rank {rank} failed:\n{error}")
    first = next(r for r in rows if r[0] == 0)
    out = {"samples_s": args.batch / first[1], "rss_mib": first[2], "saved_mib": first[3], "step_s": first[1]}
    return out


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="benchmarks/strategies.py pipeline", description=__doc__)
    parser.add_argument("--schedules", default="gpipe,1f1b,interleaved")
    parser.add_argument("--config", default="tiny")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--chunks", type=int, default=8)
    parser.add_argument("--steps", type=int, default=10, help="measured steps per run (median)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--order",
        choices=("abba", "ab"),
        default="abba",
        help="abba: ours, torch, torch, ours (each a fresh pair; each side's mean step time), so a load that "
        "rises or falls through the run weighs on both alike; ab: ours then torch, once",
    )
    parser.add_argument("--json", default=None, help="also write the rows here (benchmarks/report.py reads them)")
    args = parser.parse_args(argv)
    print(f"GPT {args.layers} layers x {args.width} wide, batch {args.batch} x {args.seq} tokens, chunks {args.chunks}")
    columns = ["schedule", "ours samples/s", "torch samples/s", "ratio", "ours RSS MiB", "torch RSS MiB"]
    columns += ["ours saved MiB", "torch saved MiB", "same-side spread"]
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    saved, rows = {}, []
    for schedule in args.schedules.split(","):
        runs: dict[str, list[dict[str, float]]] = {"ours": [], "torch": []}
        for impl in ("ours", "torch", "torch", "ours") if args.order == "abba" else ("ours", "torch"):
            runs[impl].append(run_pair(argparse.Namespace(**vars(args), schedule=schedule, impl=impl)))
        res = {impl: _combine(r) for impl, r in runs.items()}
        saved[schedule] = res["ours"]["saved_mib"]
        rows.append(_json_row(args, schedule, res, spread(runs)))
        ratio = res["ours"]["samples_s"] / res["torch"]["samples_s"]
        print(
            f"| {schedule} vs {PAIRS[schedule]} | {res['ours']['samples_s']:.2f} | {res['torch']['samples_s']:.2f} | "
            f"{ratio:.2f}x | {res['ours']['rss_mib']:.0f} | {res['torch']['rss_mib']:.0f} | "
            f"{res['ours']['saved_mib']:.1f} | {res['torch']['saved_mib']:.1f} | {spread(runs):.1%} |",
            flush=True,
        )
    if "gpipe" in saved and "1f1b" in saved:
        share = saved["1f1b"] / saved["gpipe"]
        print(f"first-stage activation peak, PipeDream / GPipe at chunks={args.chunks}: {share:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows}, f, indent=1)
    return 0


def _combine(runs: list[dict[str, float]]) -> dict[str, float]:
    """One implementation's runs: the mean step time, the highest peak RSS, the saved-activation peak."""
    step = statistics.fmean(r["step_s"] for r in runs)
    rss = max(r["rss_mib"] for r in runs)
    return {
        "samples_s": runs[0]["samples_s"] * runs[0]["step_s"] / step,
        "rss_mib": rss,
        "saved_mib": runs[0]["saved_mib"],
        "step_s": step,
    }


def spread(runs: dict[str, list[dict[str, float]]]) -> float:
    """How far apart two runs of the same implementation are in this run (slowest / fastest step - 1, the larger
    side's): the noise a ratio between the implementations is to be read against. 0 with one run per side."""
    return max(max(r["step_s"] for r in side) / min(r["step_s"] for r in side) - 1 for side in runs.values())


def _json_row(
    args: argparse.Namespace, schedule: str, res: dict[str, dict[str, float]], noise: float
) -> dict[str, Any]:
    ours = {"gpipe": "GPipe", "1f1b": "PipeDream", "interleaved": "Interleaved1F1B"}[schedule]
    return {
        "technique": "pipeline, 2 stages",
        "config": f"GPT {args.layers}x{args.width}, batch {args.batch}x{args.seq}, chunks {args.chunks}",
        "ours": ours,
        "peer": f"torch {PAIRS[schedule]}",
        "metric": "samples/s",
        "ours_value": res["ours"]["samples_s"],
        "peer_value": res["torch"]["samples_s"],
        "ours_rss_mib": res["ours"]["rss_mib"],
        "peer_rss_mib": res["torch"]["rss_mib"],
        "spread": noise,
    }


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
