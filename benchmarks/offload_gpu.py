"""Activation offload on one GPU: ``CPUOffload`` at several ratios against ``save_on_cpu(pin_memory=True)``.

    python -m benchmarks.offload_gpu [--json results.json]

GPT-2 Medium (24 layers, d_model 1024, 16 heads, vocab 50257), batch 8, context 1024, bf16 autocast. For
each column: forward (with the loss) inside the region, backward outside it, gradients kept allocated
between steps so the memory before forward is the same for every column. Reported per column: peak CUDA
memory allocated and reserved, peak activation memory (peak allocated minus the memory allocated before
the forward), step time (median of the measured steps after warm-up), and for ``CPUOffload`` the
achieved ratio, bytes offloaded and copy time. A pinned copy-bandwidth probe gives the time floor of
moving those bytes. Two figures say where a column's time goes beyond the copies: the host time of its
forward and of its backward (until each call returns, before the device is synchronized: when their sum
is close to the step, the step is host-bound and the hooks' Python shows), and the CUDA allocator's
device allocations and frees per step (each ``cudaFree`` synchronizes the device). A second pass runs
the columns in turns, step by step, so that clock and thermal drift hit them alike: the step time to
compare between columns. Without CUDA it prints why and exits 0; ``--device cpu --config tiny`` is a smoke run
of the same code with the copy path forced (no memory figures).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from examples.gpt.model import GPT, config, lm_loss
from lightning_haiscale.cpu_offload import CPUOffload, reset_offload_stats
from lightning_haiscale.testing.parity import NOISE_MULTIPLE, noise_tolerance

MiB = 1 << 20
GiB = 1 << 30


@dataclass
class Result:
    """One column of the table."""

    name: str
    step_ms: float
    peak_allocated_mib: float | None = None
    peak_reserved_mib: float | None = None
    activation_mib: float | None = None  # peak allocated minus allocated before forward
    achieved_ratio: float | None = None
    offloaded_mib: float | None = None
    copy_ms: float | None = None
    host_forward_ms: float | None = None  # median time until the forward (region included) returns
    host_backward_ms: float | None = None  # median time until backward() returns, before the sync
    device_allocs_per_step: float | None = None  # cudaMalloc + cudaFree calls of the allocator, per step
    alternating_step_ms: float | None = None  # median step time in the pass where columns take turns
    step_times_ms: list[float] = field(default_factory=list)


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: smoke run, copy path forced")
    p.add_argument("--config", default="medium", help="examples/gpt config name (medium = GPT-2 Medium)")
    p.add_argument("--vocab", type=int, default=50257, help="vocabulary size (GPT-2: 50257)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=1024, help="context length")
    p.add_argument("--ratios", default="0,0.25,0.5,1", help="comma-separated offload ratios")
    p.add_argument("--amp", default="bf16", choices=["bf16", "none"], help="autocast dtype")
    p.add_argument("--warmup", type=int, default=3, help="steps before measuring")
    p.add_argument("--steps", type=int, default=5, help="measured steps (median time)")
    p.add_argument("--min-bytes", type=int, default=None, help="CPUOffload min_bytes (default: its own)")
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = p.parse_args(list(argv))
    args.ratio_values = [float(r) for r in args.ratios.split(",") if r.strip()]
    for ratio in args.ratio_values:
        if not 0.0 <= ratio <= 1.0:
            p.error(f"--ratios: {ratio} is outside [0, 1]")
    if args.steps < 1 or args.warmup < 1:
        p.error("--steps and --warmup must be >= 1 (warm-up also allocates the gradients)")
    return args


def variants(args: argparse.Namespace) -> list[tuple[str, Callable[[], Any]]]:
    """(column name, factory of the context manager that wraps each forward)."""
    options: dict[str, Any] = {"force_copy": args.device == "cpu"}
    if args.min_bytes is not None:
        options["min_bytes"] = args.min_bytes
    columns: list[tuple[str, Callable[[], Any]]] = [("no offload", contextlib.nullcontext)]
    for ratio in args.ratio_values:
        tag = f"bench-offload-{ratio:g}"
        columns.append((f"ratio {ratio:g}", lambda r=ratio, t=tag: CPUOffload(r, t, **options)))
    columns.append(("save_on_cpu", lambda: torch.autograd.graph.save_on_cpu(pin_memory=True)))
    return columns


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _step(model: torch.nn.Module, idx: torch.Tensor, targets: torch.Tensor, region: Any, amp: bool) -> list[float]:
    """One step from a synchronized device; the host clock when the forward, backward and sync returned."""
    model.zero_grad(set_to_none=False)
    with torch.autocast(idx.device.type, dtype=torch.bfloat16, enabled=amp), region:
        loss = lm_loss(model(idx), targets)
    forward = time.perf_counter()
    loss.backward()
    backward = time.perf_counter()
    _sync(idx.device)
    return [forward, backward, time.perf_counter()]


def _device_allocs(device: torch.device) -> int:
    """cudaMalloc plus cudaFree calls of the caching allocator so far (0 off CUDA)."""
    if device.type != "cuda":
        return 0
    stats = torch.cuda.memory_stats(device)
    return stats.get("num_device_alloc", 0) + stats.get("num_device_free", 0)


def measure(name: str, make_region: Callable[[], Any], model, idx, targets, args) -> Result:
    """Runs warm-up and measured steps of one column."""
    device, amp = idx.device, args.amp == "bf16"
    cuda = device.type == "cuda"
    times, host, peaks, reserved, activations = [], [], [], [], []
    regions = []
    for step in range(args.warmup + args.steps):
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        if step == args.warmup:
            allocs = _device_allocs(device)
        _sync(device)
        before = torch.cuda.memory_allocated(device) if cuda else 0
        start = time.perf_counter()
        region = make_region()
        forward, backward, end = _step(model, idx, targets, region, amp)
        if step < args.warmup:
            continue
        times.append((end - start) * 1000)
        host.append(((forward - start) * 1000, (backward - forward) * 1000))
        regions.append(region)
        if cuda:
            peaks.append(torch.cuda.max_memory_allocated(device) / MiB)
            reserved.append(torch.cuda.max_memory_reserved(device) / MiB)
            activations.append((torch.cuda.max_memory_allocated(device) - before) / MiB)
    result = Result(name, statistics.median(times), step_times_ms=times)
    result.host_forward_ms = statistics.median(f for f, _ in host)
    result.host_backward_ms = statistics.median(b for _, b in host)
    result.device_allocs_per_step = (_device_allocs(device) - allocs) / args.steps
    if cuda:
        result.peak_allocated_mib, result.peak_reserved_mib = max(peaks), max(reserved)
        result.activation_mib = max(activations)
    if isinstance(regions[-1], CPUOffload):
        stats = regions[-1].stats()
        result.achieved_ratio = stats.achieved_ratio
        result.offloaded_mib = stats.bytes_offloaded / MiB
        result.copy_ms = stats.copy_seconds * 1000
    return result


def measure_alternating(columns: Sequence[tuple[str, Callable[[], Any]]], model, idx, targets, args) -> list[float]:
    """Median step time (ms) of each column when the columns take turns step by step (after one warm-up round
    each: the sequential pass already warmed them)."""
    amp = args.amp == "bf16"
    times: list[list[float]] = [[] for _ in columns]
    for round_ in range(1 + args.steps):
        for i, (_, make_region) in enumerate(columns):
            _sync(idx.device)
            start = time.perf_counter()
            end = _step(model, idx, targets, make_region(), amp)[-1]
            if round_:
                times[i].append((end - start) * 1000)
    return [statistics.median(t) for t in times]


def copy_bandwidth(device: torch.device, nbytes: int = GiB) -> tuple[float, float]:
    """(device-to-host, host-to-device) GB/s of one pinned copy of ``nbytes``."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    rates = []
    for dst, source in ((host, src), (src, host)):
        dst.copy_(source, non_blocking=True)  # warm-up
        _sync(device)
        start = time.perf_counter()
        dst.copy_(source, non_blocking=True)
        _sync(device)
        rates.append(nbytes / (time.perf_counter() - start) / 1e9)
    return rates[0], rates[1]


def check_gradients(device: torch.device) -> str:
    """Gradients with offload (small windows: throttling, prefetch, reuse) against a run without, on ``device``.

    Returns a one-line verdict starting with "ok" or "FAILED". Bitwise unless two reference runs already
    differ (CUDA backward kernels may use atomics); then within ``noise_tolerance`` of their difference (a
    multiple of the reference's own run-to-run noise: [Note: parity tolerances] in lightning_haiscale/testing).
    """
    torch.manual_seed(0)
    model = GPT(config("tiny")).to(device)
    idx = torch.randint(0, 256, (4, 256), device=device)
    targets = torch.roll(idx, -1, dims=1)

    def grads(region: Any) -> list[torch.Tensor]:
        model.zero_grad(set_to_none=True)
        with region:
            loss = lm_loss(model(idx), targets)
        loss.backward()
        return [p.grad.clone() for p in model.parameters()]

    want = grads(contextlib.nullcontext())
    noise = max((a - b).abs().max().item() for a, b in zip(grads(contextlib.nullcontext()), want, strict=True))
    exact, atol = noise == 0, noise_tolerance(noise, scale=max(w.abs().max().item() for w in want))
    options = {"min_bytes": 0, "max_inflight_bytes": 1 << 20, "prefetch_bytes": 1 << 20}
    for ratio in (0.3, 1.0):
        for _ in range(3):
            got = grads(CPUOffload(ratio, f"bench-check-{ratio}", force_copy=device.type == "cpu", **options))
            for g, w in zip(got, want, strict=True):
                same = torch.equal(g, w) if exact else torch.allclose(g, w, rtol=0, atol=atol)
                if not same:
                    return f"FAILED at ratio {ratio}: max |diff| {(g - w).abs().max().item():.3e}"
    return "ok (bitwise equal)" if exact else f"ok (within {atol:.1e}: {NOISE_MULTIPLE:g}x the reference runs' noise)"


def _fmt(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def _ratio_cells(values: Sequence[float | None], base: float | None) -> list[str]:
    return ["n/a" if v is None or not base else f"{v / base:.2f}x" for v in values]


def format_table(results: Sequence[Result]) -> str:
    """Rows are metrics, columns are the runs; overheads and cuts are relative to the first column."""
    base = results[0]
    rows: list[tuple[str, list[str]]] = [
        ("step time (ms, median)", [_fmt(r.step_ms, ".1f") for r in results]),
        ("step time vs no offload", _ratio_cells([r.step_ms for r in results], base.step_ms)),
        ("host time forward (ms)", [_fmt(r.host_forward_ms, ".1f") for r in results]),
        ("host time backward (ms)", [_fmt(r.host_backward_ms, ".1f") for r in results]),
        ("device allocs+frees/step", [_fmt(r.device_allocs_per_step, ".1f") for r in results]),
    ]
    if base.alternating_step_ms:
        rows.append(("step, columns alternating (ms)", [_fmt(r.alternating_step_ms, ".1f") for r in results]))
        rows.append(
            ("  vs no offload", _ratio_cells([r.alternating_step_ms for r in results], base.alternating_step_ms))
        )
    rows += [
        ("peak allocated (MiB)", [_fmt(r.peak_allocated_mib, ".0f") for r in results]),
        ("peak reserved (MiB)", [_fmt(r.peak_reserved_mib, ".0f") for r in results]),
        ("peak activations (MiB)", [_fmt(r.activation_mib, ".0f") for r in results]),
    ]
    if base.activation_mib:
        cuts = [
            None if r.activation_mib is None else 100 * (1 - r.activation_mib / base.activation_mib) for r in results
        ]
        rows.append(("activation cut (%)", [_fmt(c, ".1f") for c in cuts]))
    rows += [
        ("achieved ratio", [_fmt(r.achieved_ratio, ".3f") for r in results]),
        ("offloaded (MiB)", [_fmt(r.offloaded_mib, ".1f") for r in results]),
        ("copy time d2h+h2d (ms)", [_fmt(r.copy_ms, ".1f") for r in results]),
    ]
    header = ["", *(r.name for r in results)]
    widths = [max(len(header[0]), *(len(name) for name, _ in rows))]
    widths += [max(len(header[i + 1]), *(len(cells[i]) for _, cells in rows)) for i in range(len(results))]
    lines = [
        " | ".join(h.ljust(w) if i == 0 else h.rjust(w) for i, (h, w) in enumerate(zip(header, widths, strict=True)))
    ]
    lines.append("-+-".join("-" * w for w in widths))
    for name, cells in rows:
        lines.append(" | ".join([name.ljust(widths[0]), *(c.rjust(w) for c, w in zip(cells, widths[1:], strict=True))]))
    return "\n".join(lines)


def target_lines(results: Sequence[Result]) -> list[str]:
    """The issue's GPU targets, checked against this run (only where the columns exist)."""
    by_name = {r.name: r for r in results}
    base, half, full, peer = (by_name.get(n) for n in ("no offload", "ratio 0.5", "ratio 1", "save_on_cpu"))
    lines = []
    zero = by_name.get("ratio 0")
    if base and zero:
        alternating = base.alternating_step_ms is not None and zero.alternating_step_ms is not None
        ours, theirs = (
            (zero.alternating_step_ms, base.alternating_step_ms) if alternating else (zero.step_ms, base.step_ms)
        )
        which = "columns alternating" if alternating else "sequential pass"
        lines.append(f"target ratio 0 within 5% of no offload ({which}): {ours / theirs:.3f}x: {ours <= 1.05 * theirs}")
    if base and half and base.activation_mib and half.activation_mib is not None:
        cut = 1 - half.activation_mib / base.activation_mib
        overhead = half.step_ms / base.step_ms - 1
        ok = cut >= 0.40 and overhead <= 0.15
        lines.append(f"target ratio 0.5: activation cut {cut:.1%} (>= 40%), overhead {overhead:+.1%} (<= 15%): {ok}")
    if full and peer:
        lines.append(
            f"target ratio 1 faster than save_on_cpu(pin_memory=True): {full.step_ms:.1f} ms vs "
            f"{peer.step_ms:.1f} ms ({peer.step_ms / full.step_ms:.2f}x): {full.step_ms < peer.step_ms}"
        )
    return lines


def main(argv: Sequence[str]) -> int:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("offload_gpu: no CUDA device here; this benchmark needs a GPU (use --device cpu for a smoke run)")
        return 0
    device = torch.device(args.device)
    verdict = check_gradients(device)
    print(f"gradient check (tiny GPT, ratios 0.3 and 1, with vs without offload): {verdict}", flush=True)
    torch.manual_seed(0)
    cfg = config(args.config, vocab_size=args.vocab, block_size=max(args.seq, config(args.config).block_size))
    model = GPT(cfg).to(device)
    idx = torch.randint(0, args.vocab, (args.batch, args.seq), device=device)
    targets = torch.roll(idx, -1, dims=1)
    reset_offload_stats()
    results = []
    columns = variants(args)
    for name, make_region in columns:
        if device.type == "cuda":
            torch.cuda.empty_cache()
        try:
            results.append(measure(name, make_region, model, idx, targets, args))
        except torch.cuda.OutOfMemoryError:  # report the column as failed, keep the others
            results.append(Result(name, float("nan")))
        print(f"  measured {name}: {results[-1].step_ms:.1f} ms", flush=True)
    alive = [(r, c) for r, c in zip(results, columns, strict=True) if r.step_ms == r.step_ms]  # not NaN (OOM)
    try:
        for (r, _), ms in zip(
            alive, measure_alternating([c for _, c in alive], model, idx, targets, args), strict=True
        ):
            r.alternating_step_ms = ms
    except torch.cuda.OutOfMemoryError:  # the columns' caches together did not fit: the sequential figures stand
        print("  alternating pass: out of memory, skipped", flush=True)
    setup = (
        f"GPT config={args.config} ({sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters, "
        f"vocab {args.vocab}), batch {args.batch}, context {args.seq}, autocast {args.amp}, device {device} "
        f"({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu, copy path forced'}), "
        f"torch {torch.__version__}, {args.warmup} warm-up + {args.steps} measured steps"
    )
    print(setup)
    print(format_table(results))
    bandwidth = copy_bandwidth(device) if device.type == "cuda" else None
    if bandwidth is not None:
        print(
            f"pinned copy bandwidth, 1 GiB: device-to-host {bandwidth[0]:.1f} GB/s, "
            f"host-to-device {bandwidth[1]:.1f} GB/s"
        )
        for r in results:
            if r.offloaded_mib:
                floor = r.offloaded_mib * MiB / 1e9 * (1 / bandwidth[0] + 1 / bandwidth[1]) * 1000
                print(
                    f"  {r.name}: {r.offloaded_mib:.0f} MiB out and back: >= {floor:.0f} ms of copy time at that rate"
                )
    for line in target_lines(results):
        print(line)
    if args.json is not None:
        payload = {"setup": setup, "bandwidth_gbps": bandwidth, "results": [asdict(r) for r in results]}
        payload["gradient_check"] = verdict
        args.json.write_text(json.dumps(payload, indent=2))
    return 0 if verdict.startswith("ok") else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
