"""Hook overhead of ``CPUOffload`` per saved tensor, on CPU, against ``torch.autograd.graph.save_on_cpu()``.

    python -m benchmarks.offload_overhead [--model gpt|mlp] [--json results.json]

A model that saves many small tensors (the tiny GPT of ``examples/gpt`` at batch 1 x 32, or a deep
narrow MLP) runs forward and backward under each column, the columns taking turns step by step (in
alternating order) so that load from other processes hits them alike:

- ``no hooks``: the reference;
- ``ratio 0``: ``CPUOffload(0)``, whose CPU tensors are left alone (nothing to count);
- ``ratio 0 force_copy``: ``CPUOffload(0, force_copy=True)``, every saved activation counted and none
  copied: on CPU, what ratio 0 costs on a GPU;
- ``ratio 0.3 force_copy``: ``CPUOffload(0.3, force_copy=True, min_bytes=0)``, copies included;
- ``save_on_cpu``: ``save_on_cpu()``, which on CPU copies nothing: the cost of a minimal pack/unpack pair;
- ``detach only``: a pack that returns ``t.detach()`` and an unpack that returns it: the least a pair
  that does not leak costs. ``save_on_cpu``'s CPU pack returns the tensor itself, so a saved output
  (``exp``, ``softmax``, ...) whose graph is dropped unused is never freed (its handle and its graph
  node hold each other through autograd's C++); a pair that detaches pays for it.

Reported per column: step time (median), the overhead per saved tensor ((step - no hooks) / the number
of pack hook calls of one step), and that overhead over save_on_cpu's. A second table times the hooks
alone: each column's region entered, its pack hook called on every tensor one forward saves, its unpack
hook on every handle, the region left; best of ``--hook-repeats`` (each on the tensors of a fresh
forward, the columns taking turns in blocks), less the same loop with identity hooks, per saved tensor.
It leaves out autograd and the model, so it moves little when other processes load the machine: the
figure to compare under load.
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
from torch import nn

from examples.gpt.model import GPT, config, lm_loss
from lightning_haiscale.cpu_offload import CPUOffload, reset_offload_stats

PEER = "save_on_cpu"


@dataclass
class Result:
    """One column of the table."""

    name: str
    step_us: float  # median
    overhead_us_per_tensor: float | None = None  # over ``no hooks``
    vs_peer: float | None = None  # overhead per tensor / save_on_cpu's
    achieved_ratio: float | None = None
    spans_counted: int | None = None  # ``stats().tensors_saved``: distinct storages counted
    step_times_us: list[float] = field(default_factory=list)
    hooks_us_per_tensor: float | None = None  # the hooks alone (second table), per saved tensor
    hooks_vs_peer: float | None = None


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gpt", choices=["gpt", "mlp"], help="tiny GPT or a deep narrow MLP")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=32, help="GPT context length")
    p.add_argument("--layers", type=int, default=4, help="GPT blocks or MLP layers")
    p.add_argument("--width", type=int, default=64, help="MLP width")
    p.add_argument("--warmup", type=int, default=20, help="rounds before measuring")
    p.add_argument("--steps", type=int, default=300, help="measured rounds (one step of each column per round)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--hook-repeats", type=int, default=200, help="repeats of the hooks-alone loop (best is kept)")
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = p.parse_args(list(argv))
    if args.steps < 1 or args.warmup < 1 or args.hook_repeats < 1:
        p.error("--steps, --warmup and --hook-repeats must be >= 1 (warm-up lets tagged regions make their plan)")
    return args


def build(args: argparse.Namespace) -> tuple[nn.Module, Callable[[], torch.Tensor]]:
    """The model and a closure computing its loss (the forward that runs inside each column's region)."""
    torch.manual_seed(0)
    if args.model == "gpt":
        model: nn.Module = GPT(config("tiny", n_layer=args.layers))
        idx = torch.randint(0, 256, (args.batch, args.seq))
        targets = torch.roll(idx, -1, dims=1)
        return model, lambda: lm_loss(model(idx), targets)
    layers = [m for _ in range(args.layers) for m in (nn.Linear(args.width, args.width), nn.GELU())]
    model = nn.Sequential(*layers)
    x = torch.randn(args.batch, args.width)
    return model, lambda: model(x).square().mean()


def columns() -> list[tuple[str, Callable[[], Any]]]:
    """(column name, factory of the context manager that wraps each forward)."""
    return [
        ("no hooks", contextlib.nullcontext),
        ("ratio 0", lambda: CPUOffload(0.0, "overhead-0")),
        ("ratio 0 force_copy", lambda: CPUOffload(0.0, "overhead-0-copy", force_copy=True)),
        ("ratio 0.3 force_copy", lambda: CPUOffload(0.3, "overhead-0.3-copy", force_copy=True, min_bytes=0)),
        (PEER, torch.autograd.graph.save_on_cpu),
        ("detach only", lambda: torch.autograd.graph.saved_tensors_hooks(_detach, _identity)),
    ]


def _detach(t: torch.Tensor) -> torch.Tensor:
    return t.detach()


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


def saved_tensors(loss_fn: Callable[[], torch.Tensor]) -> list[torch.Tensor]:
    """What one forward gives the pack hook: every tensor autograd saves, duplicates and parameters included."""
    saved: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss_fn()
    return saved


def _installed_hooks() -> tuple[Callable[[torch.Tensor], Any], Callable[[Any], torch.Tensor]]:
    """The (pack, unpack) pair of the innermost saved-tensor hooks region (torch has no public getter)."""
    return torch._C._autograd._top_saved_tensors_default_hooks(False)


def time_hooks(make_region: Callable[[], Any], make_saved: Callable[[], Sequence[torch.Tensor]], repeats: int) -> float:
    """Best time in µs of: enter a region, pack every tensor one forward saved, unpack every handle, leave.

    Each repeat packs the tensors of a fresh forward (made outside the timed part), as a step does: hooks
    that leave state on a tensor or its storage would otherwise find it there from the previous repeat.
    """
    best = float("inf")
    for _ in range(repeats):
        saved = make_saved()
        start = time.perf_counter()
        with make_region():
            pack, unpack = _installed_hooks()
            handles = [pack(t) for t in saved]
        unpacked = [unpack(h) for h in handles]
        del handles, unpacked  # the handles' release is part of the cost (offloaded ones give back buffers)
        best = min(best, time.perf_counter() - start)
        del saved
    return best * 1e6


def measure_hooks(
    results: Sequence[Result], make_saved: Callable[[], Sequence[torch.Tensor]], repeats: int, blocks: int = 10
) -> None:
    """Fills each hooked column's cost of the hooks alone (over identity hooks) and its ratio to the peer's.

    The columns take turns in ``blocks`` blocks of repeats, in alternating order, so that load from other
    processes hits them alike; each keeps its best time.
    """
    made = dict(columns())

    def identity() -> Any:
        return torch.autograd.graph.saved_tensors_hooks(_identity, _identity)

    timed = [("identity", identity)] + [(r.name, made[r.name]) for r in results[1:]]
    best = {name: float("inf") for name, _ in timed}
    per_block = max(1, repeats // blocks)
    for block in range(max(1, min(blocks, repeats))):
        for name, make_region in timed if block % 2 == 0 else timed[::-1]:
            best[name] = min(best[name], time_hooks(make_region, make_saved, per_block))
    saved = len(make_saved())
    for r in results[1:]:
        r.hooks_us_per_tensor = (best[r.name] - best["identity"]) / saved
    peer = next(r for r in results if r.name == PEER).hooks_us_per_tensor
    for r in results[1:]:
        r.hooks_vs_peer = r.hooks_us_per_tensor / peer if peer and peer > 0 else None


def step(model: nn.Module, loss_fn: Callable[[], torch.Tensor], region: Any) -> None:
    model.zero_grad(set_to_none=False)
    with region:
        loss = loss_fn()
    loss.backward()


def measure(model: nn.Module, loss_fn: Callable[[], torch.Tensor], args: argparse.Namespace) -> list[Result]:
    """Round-robin over the columns; each column's median step time and its last region's statistics."""
    made = columns()
    times: list[list[float]] = [[] for _ in made]
    last: list[Any] = [None] * len(made)
    order = list(enumerate(made))
    for round_ in range(args.warmup + args.steps):
        for i, (_, make_region) in order if round_ % 2 == 0 else order[::-1]:  # no column always follows another
            start = time.perf_counter()
            last[i] = make_region()
            step(model, loss_fn, last[i])
            if round_ >= args.warmup:
                times[i].append((time.perf_counter() - start) * 1e6)
    results = []
    for (name, _), column_times, region in zip(made, times, last, strict=True):
        result = Result(name, statistics.median(column_times), step_times_us=column_times)
        if isinstance(region, CPUOffload):
            stats = region.stats()
            result.achieved_ratio, result.spans_counted = stats.achieved_ratio, stats.tensors_saved
        results.append(result)
    return results


def add_overheads(results: Sequence[Result], saved: int) -> None:
    """Fills the per-tensor overhead (over the first column) and its ratio to save_on_cpu's."""
    base = results[0].step_us
    for r in results[1:]:
        r.overhead_us_per_tensor = (r.step_us - base) / saved
    peer = next(r for r in results if r.name == PEER).overhead_us_per_tensor
    for r in results[1:]:
        r.vs_peer = r.overhead_us_per_tensor / peer if peer and peer > 0 else None


def _fmt(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def format_table(results: Sequence[Result]) -> str:
    """One row per column of the benchmark."""
    header = ["", "step (us, median)", "overhead (us/saved tensor)", "vs save_on_cpu", "achieved ratio", "spans"]
    header += ["hooks alone (us/saved tensor)", "vs save_on_cpu"]
    rows = [
        [
            r.name,
            _fmt(r.step_us, ".0f"),
            _fmt(r.overhead_us_per_tensor, ".2f"),
            _fmt(r.vs_peer, ".2f") + ("x" if r.vs_peer is not None else ""),
            _fmt(r.achieved_ratio, ".3f"),
            _fmt(r.spans_counted, "d"),
            _fmt(r.hooks_us_per_tensor, ".2f"),
            _fmt(r.hooks_vs_peer, ".2f") + ("x" if r.hooks_vs_peer is not None else ""),
        ]
        for r in results
    ]
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]

    def line(cells: Sequence[str]) -> str:
        return " | ".join(
            c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        )

    return "\n".join([line(header), "-+-".join("-" * w for w in widths), *(line(row) for row in rows)])


def main(argv: Sequence[str]) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    model, loss_fn = build(args)
    saved = len(saved_tensors(loss_fn))
    reset_offload_stats()
    results = measure(model, loss_fn, args)
    add_overheads(results, saved)
    measure_hooks(results, lambda: saved_tensors(loss_fn), args.hook_repeats)
    shape = f"context {args.seq}" if args.model == "gpt" else f"width {args.width}"
    setup = (
        f"model={args.model} ({args.layers} layers, batch {args.batch}, {shape}), {saved} saved tensors per step, "
        f"torch {torch.__version__}, {args.threads} thread(s), {args.warmup} warm-up + {args.steps} measured rounds, "
        f"hooks alone: best of {args.hook_repeats}"
    )
    print(setup)
    print(format_table(results))
    by_name = {r.name: r for r in results}
    for name in ("ratio 0 force_copy", "ratio 0"):
        r = by_name[name]
        print(
            f"{name} overhead per saved tensor vs save_on_cpu's: {_fmt(r.vs_peer, '.2f')}x "
            f"(hooks alone: {_fmt(r.hooks_vs_peer, '.2f')}x)"
        )
    if args.json is not None:
        payload = {"setup": setup, "saved_tensors": saved, "results": [asdict(r) for r in results]}
        args.json.write_text(json.dumps(payload, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
