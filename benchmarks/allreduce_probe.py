"""Where an all-reduce's time goes: counters beside the timings of ``benchmarks/allreduce.py``.

    python -m benchmarks.allreduce_probe calls          # one process: the cost of each step of a 4 KiB call
    python -m benchmarks.allreduce_probe pair [--bytes 4096]   # 2 ranks: engine, alloc_buffer, DeepSpeed, floor
    python -m benchmarks.allreduce_probe cache          # 2 ranks: alloc_buffer warm vs last-level cache evicted

``pair`` also times the floor of an all-reduce of an ordinary tensor in place: every rank reads its input and
writes its result at least once, so a pass over the tensor that does only that (``mul_(1)``, on both ranks at
once) bounds the time from below; its time over the engine's is the share of the engine's time that memory
traffic alone needs, and DeepSpeed's time over it is the largest lead over DeepSpeed this machine allows.

Wall-clock on a shared machine is noise; run under ``chrt -r 10`` to give the ranks the cores (as on a quiet
machine) and read the counters: voluntary context switches (a futex sleep or a woken thread), page faults.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time
import timeit

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from lightning.fabric.plugins.environments.lightning import find_free_network_port

from benchmarks.allreduce import deepspeed_all_reduce
from lightning_haiscale.hfreduce import Communicator


def _init(rank: int, world: int, port: int) -> Communicator:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    return Communicator()


def _switches() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw


def calls(port: int) -> None:
    """Best of 5 x 20000 calls per step, one rank (no peer to wait for), with context switches per call."""
    from lightning_haiscale.hfreduce.communicator import _check_tensor
    from lightning_haiscale.hfreduce.dtypes import engine_dtype

    comm = _init(0, 1, port)
    t = torch.randn(1024)
    native, address, dtype = comm._backend.native, t.data_ptr(), engine_dtype(t.dtype)
    steps = {
        "comm.all_reduce(t)": lambda: comm.all_reduce(t),
        "engine call (native.all_reduce)": lambda: native.all_reduce(address, address, 1024, dtype, 1.0, True),
        "argument check (_check_tensor)": lambda: _check_tensor(t, "tensor"),
        "tensor.device.type": lambda: t.device.type,
        "tensor.is_cuda": lambda: t.is_cuda,
    }
    for name, step in steps.items():
        step()
        before = _switches()
        best = min(timeit.repeat(step, number=20000, repeat=5)) / 20000
        print(f"{name:34s} {best * 1e6:6.2f} µs, {(_switches() - before) / 1e5:.3f} voluntary switches per call")
    comm.close()


def _pair(rank: int, world: int, port: int, nbytes: int, reps: int, batches: int, out: mp.Queue) -> None:
    comm = _init(rank, world, port)
    deepspeed, _ = deepspeed_all_reduce(world)
    plain, shared = torch.randn(nbytes // 4), comm.alloc_buffer(nbytes // 4)
    ops = {"engine": lambda: comm.all_reduce(plain), "alloc_buffer": lambda: comm.all_reduce(shared)}
    ops["floor"] = lambda: plain.mul_(1.0)  # read the input, write the result: what every rank must do
    if deepspeed is not None:
        ops["deepspeed"] = lambda: deepspeed(plain)
    rows = {}
    for name, op in ops.items():
        for _ in range(10):
            op()
        means, switches, faults = [], 0, 0
        for _ in range(batches):
            dist.barrier()
            r0, start = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
            for _ in range(reps):
                op()
            mean = torch.tensor([(time.perf_counter() - start) / reps], dtype=torch.float64)
            r1 = resource.getrusage(resource.RUSAGE_SELF)
            switches, faults = switches + r1.ru_nvcsw - r0.ru_nvcsw, faults + r1.ru_minflt - r0.ru_minflt
            dist.all_reduce(mean, op=dist.ReduceOp.MAX)
            means.append(mean.item())
        rows[name] = (min(means), statistics.median(means), switches / (reps * batches), faults / (reps * batches))
    out.put((rank, rows))
    comm.close()


def _cache(rank: int, world: int, port: int, calls: int, out: mp.Queue) -> None:
    comm = _init(rank, world, port)
    scratch = torch.ones((512 << 20) // 4)  # larger than the last-level cache: reading it evicts the buffer
    rows = {}
    for mib in (16, 64, 256):
        shared = comm.alloc_buffer((mib << 20) // 4)
        shared.fill_(1.0)
        for mode in ("warm", "evicted"):
            comm.all_reduce(shared)
            times, faults = [], 0
            for _ in range(calls):
                if mode == "evicted":
                    scratch.sum()
                comm.barrier()
                r0, start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.perf_counter()
                comm.all_reduce(shared)
                times.append(time.perf_counter() - start)
                faults += resource.getrusage(resource.RUSAGE_SELF).ru_minflt - r0
            rows[(mib, mode)] = (times, faults / calls)
        del shared
    out.put((rank, rows))
    comm.close()


def _spawn(target, *args) -> dict:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = find_free_network_port()
    procs = [ctx.Process(target=target, args=(rank, 2, port, *args, out)) for rank in range(2)]
    for p in procs:
        p.start()
    results = dict(out.get() for _ in procs)
    for p in procs:
        p.join()
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("probe", choices=["calls", "pair", "cache"])
    parser.add_argument("--bytes", type=int, default=4096, help="pair: message size (default 4096)")
    parser.add_argument("--reps", type=int, default=200, help="pair: calls per timed batch")
    parser.add_argument("--batches", type=int, default=20, help="pair: batches (min and median reported)")
    parser.add_argument("--calls", type=int, default=10, help="cache: calls per size and mode")
    args = parser.parse_args()
    if args.probe == "calls":
        calls(find_free_network_port())
        return 0
    if args.probe == "pair":
        res = _spawn(_pair, args.bytes, args.reps, args.batches)
        print(f"{args.bytes} B: slowest rank's mean per call over {args.reps} calls; per call and rank: voluntary")
        print("context switches, page faults")
        for name in res[0]:
            counters = " | ".join(f"{res[r][name][2]:.3f} / {res[r][name][3]:.3f}" for r in (0, 1))
            print(f"{name:12s} min {res[0][name][0] * 1e6:9.2f} µs  median {res[0][name][1] * 1e6:9.2f} µs  {counters}")
        median = {name: row[1] for name, row in res[0].items()}
        print(f"floor / engine: {median['floor'] / median['engine']:.2f} (the share memory traffic alone needs)")
        if "deepspeed" in median:
            print(f"DeepSpeed / floor: {median['deepspeed'] / median['floor']:.2f}x (the largest lead it allows)")
        return 0
    res = _spawn(_cache, args.calls)
    for key in res[0]:
        times = [max(a, b) * 1e3 for a, b in zip(res[0][key][0], res[1][key][0], strict=True)]
        mib, mode = key
        print(
            f"{mib:4d} MiB alloc_buffer, {mode:8s}: median {statistics.median(times):7.2f} ms (min {min(times):.2f}, "
            f"max {max(times):.2f}); per 64 MiB {statistics.median(times) * 64 / mib:.2f} ms; "
            f"page faults per call {res[0][key][1]:.1f} / {res[1][key][1]:.1f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
