"""All-reduce: the hfreduce engine against gloo and DeepSpeed's shared-memory all-reduce, in the same processes.

    python -m benchmarks.allreduce --world 2 [--min 4K --max 256M] [--json results.json]

For each size (fp32), each rank times gloo's ``all_reduce``, DeepSpeed's CPU shm all-reduce
(``deepspeed.comm.inference_all_reduce``, from the ``[bench]`` extra; its op JIT-builds on first use, about
30 s; the column is skipped with a note where deepspeed is missing or its op does not build), the engine on
an ordinary tensor, and the engine on an ``alloc_buffer`` tensor (zero-copy). Reported: median over
repetitions of the slowest rank's time, algorithm bandwidth (bytes / time), bus bandwidth (x 2(n-1)/n, as
nccl-tests) and the ratios of gloo's and DeepSpeed's time to the engine's.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from lightning.fabric.plugins.environments.lightning import find_free_network_port

from lightning_haiscale.hfreduce import Communicator, simd_level

UNITS = {"K": 2**10, "M": 2**20, "G": 2**30}


def parse_size(text: str) -> int:
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    return int(float(text[:-1]) * UNITS[text[-1]]) if text[-1] in UNITS else int(text)


def human(nbytes: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:g} {unit}"
    return f"{nbytes} B"


def repetitions(nbytes: int, minimum: int) -> int:
    return max(minimum, min(2000, (64 << 20) // max(nbytes, 1)))


def time_op(op, reps: int) -> float:
    """Median over ``reps`` of the slowest rank's seconds for one call of ``op`` (after one warm-up)."""
    op()
    times = []
    for _ in range(reps):
        dist.barrier()
        start = time.perf_counter()
        op()
        elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        times.append(elapsed.item())
    return statistics.median(times)


def time_small(op, reps: int) -> float:
    """Mean seconds per call over a tight loop of ``reps`` calls: for latency-bound sizes."""
    for _ in range(10):
        op()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(reps):
        op()
    elapsed = torch.tensor([(time.perf_counter() - start) / reps], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return elapsed.item()


def deepspeed_all_reduce(world: int) -> tuple[Callable[[torch.Tensor], object] | None, str]:
    """DeepSpeed's shared-memory all-reduce on every rank, or None on every rank, and a line saying which.
    Collective: the ranks agree, so none waits in DeepSpeed's op for a rank that could not build it."""
    os.environ["LOCAL_SIZE"] = str(world)  # DeepSpeed takes its shm path only when every rank is local
    try:
        import deepspeed
        import deepspeed.comm as ds_comm

        with contextlib.redirect_stdout(io.StringIO()):  # its build and init chatter
            deepspeed.init_distributed(dist_backend="gloo")
        if getattr(ds_comm.comm.cdb, "shm_comm_op", None) is None:
            raise RuntimeError("its CPU shm op did not build")
        probe = torch.arange(1024, dtype=torch.float32) * (dist.get_rank() + 1)
        ds_comm.inference_all_reduce(probe)
        if not torch.equal(probe, torch.arange(1024, dtype=torch.float32) * (world * (world + 1) // 2)):
            raise RuntimeError("its all-reduce gave a wrong sum")
        note = f"DeepSpeed {deepspeed.__version__} shm all-reduce (deepspeed.comm.inference_all_reduce)"
    except Exception as error:  # missing, failed to build, or wrong: the column is skipped, not the benchmark
        ds_comm, note = None, f"DeepSpeed column skipped: {type(error).__name__}: {error}"
    ok: list[object] = [None] * world
    dist.all_gather_object(ok, ds_comm is not None)
    if ds_comm is None or not all(ok):
        return None, note if ds_comm is None else "DeepSpeed column skipped: its op failed on another rank"
    return ds_comm.inference_all_reduce, note


def worker(rank: int, world: int, port: int, sizes: list[int], min_reps: int, out: Path) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    comm = Communicator()
    deepspeed, note = deepspeed_all_reduce(world)
    rows = []
    for nbytes in sizes:
        numel = nbytes // 4
        plain = torch.randn(numel)
        shared = comm.alloc_buffer(numel)
        shared.copy_(plain)
        reps = repetitions(nbytes, min_reps)
        timer = time_small if nbytes <= 64 << 10 else time_op
        gloo = timer(lambda t=plain: dist.all_reduce(t), reps)
        engine = timer(lambda t=plain: comm.all_reduce(t), reps)
        zero_copy = timer(lambda t=shared: comm.all_reduce(t), reps)
        ds = timer(lambda t=plain: deepspeed(t), reps) if deepspeed is not None else None
        rows.append(
            {
                "bytes": nbytes,
                "reps": reps,
                "gloo_s": gloo,
                "engine_s": engine,
                "buffer_s": zero_copy,
                "deepspeed_s": ds,
            }
        )
        del shared
    comm.close()
    if rank == 0:
        out.write_text(json.dumps({"rows": rows, "deepspeed": note}))
    dist.destroy_process_group()


def table(rows: list[dict], world: int) -> str:
    bus = 2 * (world - 1) / world
    ds = any(r.get("deepspeed_s") for r in rows)
    lines = [
        "| size | gloo | " + ("DeepSpeed shm | " if ds else "") + "engine | engine, alloc_buffer "
        "| engine algbw / busbw GB/s | buffer algbw / busbw GB/s | engine / buffer vs gloo "
        + ("| engine / buffer vs DeepSpeed " if ds else "")
        + "|",
        "|---:" * (9 if ds else 7) + "|",
    ]

    def fmt(s: float) -> str:
        return f"{s * 1e6:.1f} µs" if s < 1e-3 else f"{s * 1e3:.2f} ms"

    for r in rows:
        alg_e, alg_b = r["bytes"] / r["engine_s"] / 1e9, r["bytes"] / r["buffer_s"] / 1e9
        peer = r.get("deepspeed_s")
        lines.append(
            f"| {human(r['bytes'])} | {fmt(r['gloo_s'])} | "
            + (f"{fmt(peer)} | " if ds else "")
            + f"{fmt(r['engine_s'])} | {fmt(r['buffer_s'])} "
            f"| {alg_e:.2f} / {alg_e * bus:.2f} | {alg_b:.2f} / {alg_b * bus:.2f} "
            f"| {r['gloo_s'] / r['engine_s']:.1f}x / {r['gloo_s'] / r['buffer_s']:.1f}x "
            + (f"| {peer / r['engine_s']:.2f}x / {peer / r['buffer_s']:.2f}x " if ds else "")
            + "|"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=2, help="processes on this host (default 2)")
    parser.add_argument("--min", default="4K", help="smallest message (default 4K)")
    parser.add_argument("--max", default="256M", help="largest message (default 256M)")
    parser.add_argument("--reps", type=int, default=5, help="least repetitions per size (median; default 5)")
    parser.add_argument("--json", type=Path, help="also write the rows as JSON here")
    args = parser.parse_args()
    sizes, size = [], parse_size(args.min)
    while size <= parse_size(args.max):
        sizes.append(size)
        size *= 4
    out = Path(f"/tmp/allreduce-{os.getpid()}.json")
    mp.spawn(worker, args=(args.world, find_free_network_port(), sizes, args.reps, out), nprocs=args.world)
    result = json.loads(out.read_text())
    rows = result["rows"]
    out.unlink()
    print(
        f"all_reduce fp32, {args.world} processes, 1 thread each; {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} cores, SIMD {simd_level()}, torch {torch.__version__}"
    )
    print(result["deepspeed"])
    print(table(rows, args.world))
    if args.json:
        args.json.write_text(
            json.dumps({"world": args.world, "rows": rows, "deepspeed": result["deepspeed"]}, indent=1)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
