"""One GPU validation run: the CUDA paths of every technique on one NVIDIA GPU, in under 8 minutes.

    python -m benchmarks.gpu_check [--only engine,offload] [--json PATH]

Two processes share the one GPU (gloo process group; the engine does the reductions). Checks: the engine's
CUDA all-reduce (one host, and two simulated hosts: the hierarchical path); plain hai_ddp and PipeDream
parity; a Lightning Trainer fit of every strategy on 1 and 2 processes (DP x PP on 4) in 32-true, 16-mixed
and bf16-mixed, with the pipelines' evaluation, Interleaved1F1B, GPipe with checkpointing, no_sync and
find_unused_parameters (``benchmarks/gpu_fit.py``); hai_fsdp's sharding strategies, ``cpu_offload`` and activation
checkpointing under bf16-mixed; PP x FSDP (2 pipelines of 2 sharded stages, 4 processes) under bf16-mixed; a
stream-race mode (GPU sleeps before collectives and in a backward hook, a step on a non-default stream); the
suite's ``pytest -m gpu`` tests; the offload benchmark. Prints one table and exits non-zero on any mismatch.
Without a GPU it says so and exits 0. The parity checks take a device, so the test suite runs them on CPU too
(the script's own logic is tested where no GPU is).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from benchmarks import gpu_fit
from lightning_haiscale.hfreduce import Communicator
from lightning_haiscale.strategies import HaiFSDPStrategy, PipeDreamStrategy
from lightning_haiscale.testing import run_distributed
from lightning_haiscale.testing.parity import FLOAT64_RTOL, default_dtype

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Row:
    check: str
    ok: bool
    detail: str


def _gathered_sum(x: torch.Tensor, world: int) -> torch.Tensor:
    cpu = x.cpu()
    parts = [torch.empty_like(cpu) for _ in range(world)]
    dist.all_gather(parts, cpu)
    wide = torch.float32 if cpu.dtype in (torch.float16, torch.bfloat16) else cpu.dtype
    acc = parts[0].to(wide).clone()
    for p in parts[1:]:
        acc += p.to(wide)
    return acc.to(cpu.dtype)


def _engine_worker(rank: int, world: int) -> dict:
    torch.cuda.set_device(0)
    comm = Communicator()
    mismatches = []
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for n in (0, 7, 4097, 1_000_003, 16 << 20):
            g = torch.Generator().manual_seed(rank * 31 + n)
            x = torch.randn(n, generator=g).to(dtype).cuda()
            expected = _gathered_sum(x, world)
            comm.all_reduce(x)
            if not torch.equal(x.cpu(), expected):
                mismatches.append(f"{dtype} n={n}")
    xs = [torch.randn(1 << 16, device="cuda") for _ in range(20)]
    expected = [_gathered_sum(x, world) for x in xs]
    works = [comm.all_reduce(x, async_op=True) for x in xs]
    for w in works:
        w.wait()
    if not all(torch.equal(x.cpu(), e) for x, e in zip(xs, expected, strict=True)):
        mismatches.append("async")
    timings = {}
    big = torch.randn(16 << 20, device="cuda")  # 64 MiB
    for name, op in (("engine", lambda: comm.all_reduce(big)), ("gloo", lambda: dist.all_reduce(big))):
        op()
        times = []
        for _ in range(5):
            torch.cuda.synchronize()
            dist.barrier()
            start = time.perf_counter()
            op()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        timings[name] = statistics.median(times)
    comm.close()
    return {"mismatches": mismatches, **timings}


def check_engine() -> list[Row]:
    results = run_distributed(_engine_worker, 2, timeout=300)
    mismatches = sorted({m for r in results for m in r["mismatches"]})
    engine, gloo = max(r["engine"] for r in results), max(r["gloo"] for r in results)
    return [
        Row(
            "engine CUDA all_reduce == ordered sum (fp32/bf16/fp16, 0..16M, async)",
            not mismatches,
            ", ".join(mismatches) or "bitwise equal",
        ),
        Row(
            "engine CUDA all_reduce 64 MiB vs gloo (2 ranks, 1 GPU)",
            True,
            f"engine {engine * 1e3:.1f} ms, gloo {gloo * 1e3:.1f} ms, ratio {gloo / engine:.1f}x",
        ),
    ]


@default_dtype(torch.float64)  # then FLOAT64_RTOL: rounding cannot decide it ([Note: parity tolerances])
def _ddp_worker(rank: int, world: int, device: str) -> float:
    """hai_ddp's plain layer on ``device`` (CUDA: both ranks on device 0) against one process on the whole batch."""
    from examples.gpt.model import GPT, config, lm_loss
    from lightning_haiscale.ddp import DistributedDataParallel

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(0)
    model = GPT(config("tiny")).to(device)
    reference = copy.deepcopy(model)
    ddp = DistributedDataParallel(model, device_ids=[0] if device == "cuda" else None)
    # SGD: AdamW would normalize the float noise of gradients that are zero in exact arithmetic (the
    # attention key bias) into full-size updates, hiding real differences behind spurious ones.
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    for _ in range(5):
        tokens = torch.randint(0, 256, (2 * world, 65), generator=g).to(device)
        x, y = tokens[:, :-1], tokens[:, 1:]
        mine = slice(2 * rank, 2 * rank + 2)
        lm_loss(ddp(x[mine]), y[mine]).backward()
        opt.step()
        opt.zero_grad()
        lm_loss(reference(x), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    ddp.reducer.stop()
    return max(
        ((p - q).norm() / q.norm()).item() for p, q in zip(model.parameters(), reference.parameters(), strict=True)
    )


def check_ddp(device: str = "cuda", node_ids: list[str] | None = None) -> list[Row]:
    error = max(run_distributed(_ddp_worker, 2, device, node_ids=node_ids, timeout=300))
    hosts = " on 2 simulated hosts (hierarchical path)" if node_ids else ""
    check = f"hai_ddp {device} parity vs one process{hosts} (tiny GPT, 5 SGD steps, float64)"
    return [Row(check, error < FLOAT64_RTOL, f"max rel err {error:.1e}")]


def _hierarchical_engine_worker(rank: int, world: int) -> list[str]:
    torch.cuda.set_device(0)
    comm = Communicator()
    mismatches = []
    for n in (7, 4097, 3 << 20):
        x = torch.randn(n, generator=torch.Generator().manual_seed(rank * 7 + n)).cuda()
        expected = _gathered_sum(x, world)
        comm.all_reduce(x)
        # float32 sums of randn values (|x| < ~5) in the engine's cross-host order: 1e-6 is ~8 float32 eps of them
        if not torch.allclose(x.cpu(), expected, rtol=1e-6, atol=1e-6):
            mismatches.append(f"all_reduce n={n}")
    out = torch.full((world * 5,), float("nan"), device="cuda")
    comm.all_gather(out, torch.full((5,), float(rank), device="cuda"))
    if not torch.equal(out.cpu(), torch.arange(world).repeat_interleave(5).float()):
        mismatches.append("all_gather")
    piece = torch.empty(5, device="cuda")
    comm.reduce_scatter(piece, torch.arange(world * 5, dtype=torch.float32, device="cuda"))
    if not torch.equal(piece.cpu(), torch.arange(rank * 5, rank * 5 + 5).float() * world):
        mismatches.append("reduce_scatter")
    comm.close()
    return mismatches


def check_hierarchical() -> list[Row]:
    """The engine's cross-host path with CUDA tensors: 2 ranks on GPU 0 posing as 2 hosts (HFREDUCE_NODE_ID)."""
    hosts = ["a", "b"]
    found = run_distributed(_hierarchical_engine_worker, 2, node_ids=hosts, timeout=300)
    mismatches = sorted({m for r in found for m in r})
    rows = [Row("engine CUDA collectives across 2 simulated hosts", not mismatches, ", ".join(mismatches) or "ok")]
    return rows + check_ddp("cuda", node_ids=hosts)


def check_fit(device: str = "cuda") -> list[Row]:
    """Trainer fits of every strategy, every precision, on 1, 2 and 4 processes sharing the GPU."""
    return [Row(*row) for row in gpu_fit.fit_rows(device, (1, 2, 4), gpu_fit.PRECISIONS)]


def check_race(device: str = "cuda") -> list[Row]:
    return [Row(*row) for row in gpu_fit.race_rows(device)]


@default_dtype(torch.float64)  # then FLOAT64_RTOL: rounding cannot decide it ([Note: parity tolerances])
def _pipeline_worker(rank: int, world: int, device: str) -> float:
    """A 2-stage PipeDream on ``device`` (CUDA: both stages on device 0) against one process on the whole batch."""
    from examples.gpt.model import GPT, config, lm_loss
    from lightning_haiscale.pipeline import PipeDream, partition

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(0)
    seq = GPT(config("tiny", tie_weights=False)).to(device)
    reference = copy.deepcopy(seq)
    stage = partition(seq, rank, world)
    names = {id(p): n for n, p in seq.named_parameters()}
    pipe = PipeDream(stage, chunks=4)
    opt = torch.optim.SGD(stage.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        tokens = torch.randint(0, 256, (8, 65), generator=g).to(device)
        x, y = tokens[:, :-1], tokens[:, 1:]
        pipe.forward_backward(x, criterion=lambda out, y: lm_loss(out, y) / 4, labels=(y,))  # 4 chunks
        opt.step()
        opt.zero_grad()
        lm_loss(reference(x), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    ref = dict(reference.named_parameters())
    return max(((p - ref[names[id(p)]]).norm() / ref[names[id(p)]].norm()).item() for p in stage.parameters())


def check_pipeline(device: str = "cuda") -> list[Row]:
    error = max(run_distributed(_pipeline_worker, 2, device, timeout=300))
    check = f"PipeDream 2 stages on {device} vs one process (tiny GPT, chunks 4, float64)"
    return [Row(check, error < FLOAT64_RTOL, f"max rel err {error:.1e}")]


@dataclass(frozen=True)
class FSDPModeCase(gpu_fit.Case):
    """A Trainer fit of hai_fsdp with some of Lightning's ``FSDPStrategy`` keywords (``options``)."""

    options: tuple[tuple[str, Any], ...] = ()

    def strategy(self, device: str) -> Any:
        devices = [torch.device(device, 0) if device == "cuda" else torch.device("cpu")] * self.world
        units = {"auto_wrap_policy": {nn.Sequential}}  # each Linear + Tanh pair is a unit
        return HaiFSDPStrategy(parallel_devices=devices, process_group_backend="gloo", **units, **dict(self.options))

    @property
    def label(self) -> str:
        options = ", ".join(f"{k}={v.__name__ if callable(v) else repr(v)}" for k, v in self.options)
        return f"hai_fsdp({options}) on {self.world} processes"


def _pairs(module: nn.Module, recurse: bool, nonwrapped_numel: int) -> bool:
    """The classifier's (Linear, Tanh) pairs, each a unit: checkpointed as Lightning's guide advises (the same
    modules as the wrap policy's units)."""
    return recurse or (isinstance(module, nn.Sequential) and isinstance(module[-1], nn.Tanh))


def fsdp_mode_cases(world: int = 2, device: str = "cuda") -> list[FSDPModeCase]:
    """Each sharding strategy (hybrid as 2 replicas of 1 shard, so the replicate engine runs), activation
    checkpointing, and on CPU ``cpu_offload`` (no effect there; on CUDA see :func:`check_fsdp_modes`)."""
    options: list[tuple[tuple[str, Any], ...]] = [
        (("sharding_strategy", "FULL_SHARD"),),
        (("sharding_strategy", "SHARD_GRAD_OP"),),
        (("sharding_strategy", "NO_SHARD"),),
        (("sharding_strategy", "HYBRID_SHARD"), ("device_mesh", (world, 1))),
        (("activation_checkpointing_policy", _pairs),),
    ]
    if device == "cpu":
        options.append((("cpu_offload", True),))
    return [FSDPModeCase("hai_fsdp", world, dp=world, options=o) for o in options]


def _fsdp_modes_worker(rank: int, world: int, device: str, precision: str) -> list[tuple[str, float]]:
    if device == "cuda":
        torch.cuda.set_device(0)
    cases = fsdp_mode_cases(world, device)
    return [(c.label, gpu_fit.fit_error(c, precision, device), gpu_fit.tolerance(c, precision)) for c in cases]


def _cpu_offload_worker(rank: int, world: int) -> str:
    """``cpu_offload=True`` on CUDA: the wrapper refuses it (not built) when the Trainer sets the model up."""
    torch.cuda.set_device(0)
    case = FSDPModeCase("hai_fsdp", world, dp=world, options=(("cpu_offload", True),))
    try:
        gpu_fit.fit_error(case, "bf16-mixed", "cuda")
    except NotImplementedError as error:
        return f"refused: {str(error)[:100]}"
    return "trained"


def check_fsdp_modes(device: str = "cuda", precision: str = "bf16-mixed") -> list[Row]:
    """hai_fsdp's sharding strategies and activation checkpointing (and ``cpu_offload`` on CPU): Trainer fits on 2
    processes sharing the GPU, each against one fp32 process (``gpu_fit``'s tolerance for ``precision``). On CUDA,
    ``cpu_offload=True`` must be refused with its reason until it is built, never run on the device silently."""
    results = run_distributed(_fsdp_modes_worker, 2, device, precision, timeout=420)[0]
    rows = [
        Row(f"Trainer fit {label}, {precision} on {device}", error < limit, f"max rel err {error:.1e}")
        for label, error, limit in results
    ]
    if device == "cuda":
        outcome = run_distributed(_cpu_offload_worker, 2, timeout=300)[0]
        refused = outcome.startswith("refused")
        rows.append(Row("hai_fsdp(cpu_offload=True) on cuda: refused until built", refused, outcome))
    return rows


@dataclass(frozen=True)
class PPFSDPCase(gpu_fit.Case):
    """PP x FSDP in the Trainer (issue 35 item 6): 2 pipelines of 2 stages, each stage sharded over the 2
    pipelines, every Linear a unit."""

    def strategy(self, device: str) -> Any:
        devices = [torch.device(device, 0) if device == "cuda" else torch.device("cpu")] * self.world
        return PipeDreamStrategy(
            chunks=2, pp_size=2, data_parallel="fsdp", auto_wrap_policy={nn.Linear},
            parallel_devices=devices, process_group_backend="gloo",
        )  # fmt: skip

    @property
    def label(self) -> str:
        return f"hai_pipedream(pp x fsdp, pp_size=2) on {self.world} processes"


def _pp_fsdp_worker(rank: int, world: int, device: str, precision: str) -> tuple[str, float, float]:
    if device == "cuda":
        torch.cuda.set_device(0)
    case = PPFSDPCase("hai_pipedream(pp x fsdp)", world, dp=world // 2)
    return case.label, gpu_fit.fit_error(case, precision, device), gpu_fit.tolerance(case, precision)


def check_pp_fsdp(device: str = "cuda", precision: str = "bf16-mixed") -> list[Row]:
    """PP x FSDP (``PipeDreamStrategy(data_parallel="fsdp")``) fitted on 4 processes sharing the GPU, against one
    fp32 process (``gpu_fit``'s tolerance for ``precision``): sharded stages, the engine's CUDA gathers and
    reduce-scatters under a pipeline, bf16 autocast per microbatch."""
    label, error, limit = run_distributed(_pp_fsdp_worker, 4, device, precision, timeout=420)[0]
    detail = f"max rel err of the change {error:.1e} (tolerance {limit:.1e})"
    return [Row(f"Trainer fit {label}, {precision} on {device}", error < limit, detail)]


def check_gpu_tests() -> list[Row]:
    """The test suite's GPU-only tests (hai_fsdp CUDA parity, offload's CUDA paths)."""
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "tests"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        check=False,
    )
    tail = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else proc.stderr[-500:]
    if proc.returncode != 0:
        print(proc.stdout[-6000:])
    label = "pytest -m gpu tests (hai_fsdp CUDA parity, engine staging, CUDA double accumulation, offload)"
    return [Row(label, proc.returncode == 0, tail)]


def check_offload() -> list[Row]:
    out = Path("/tmp/offload_gpu.json")
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.offload_gpu", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=480,
        cwd=ROOT,
        check=False,
    )
    print(proc.stdout)
    if proc.returncode != 0:
        return [Row("offload benchmark (GPT-2 Medium, B8 T1024, bf16)", False, proc.stderr[-2000:])]
    return [Row("offload benchmark (GPT-2 Medium, B8 T1024, bf16)", True, f"table above; json {out}")]


CHECKS: dict[str, Callable[[], list[Row]]] = {
    "engine": check_engine,
    "ddp": check_ddp,
    "pipeline": check_pipeline,
    "hierarchical": check_hierarchical,
    "fit": check_fit,
    "fsdp_modes": check_fsdp_modes,
    "pp_fsdp": check_pp_fsdp,
    "race": check_race,
    "gpu_tests": check_gpu_tests,
    "offload": check_offload,
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default=",".join(CHECKS), help=f"comma-separated subset of {list(CHECKS)}")
    parser.add_argument("--json", type=Path, help="also write the rows as JSON here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; nothing to check")
        return 0
    print(f"GPU: {torch.cuda.get_device_name(0)}; torch {torch.__version__}; {os.cpu_count()} CPU cores")
    rows: list[Row] = []
    for name in args.only.split(","):
        start = time.monotonic()
        try:
            found = CHECKS[name]()
        except Exception as error:  # one failed check must not hide the others
            found = [Row(name, False, f"{type(error).__name__}: {str(error)[-1500:]}")]
        rows += found
        print(f"[{name}] {time.monotonic() - start:.0f} s", flush=True)
        _print_rows(found)
        if args.json:  # after every check: a run stopped at its time limit keeps what it found
            args.json.write_text(json.dumps([asdict(r) for r in rows], indent=1))
    print("\nAll checks:")
    _print_rows(rows)
    return 0 if all(r.ok for r in rows) else 1


def _print_rows(rows: list[Row]) -> None:
    print("| check | ok | detail |\n|---|---|---|")
    for row in rows:
        print(f"| {row.check} | {'yes' if row.ok else 'NO'} | {row.detail} |", flush=True)


if __name__ == "__main__":
    sys.exit(main())
