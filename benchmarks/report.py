"""``make bench``: every technique beside its peer in one run; writes RESULTS.md's summary and results.png.

    python -m benchmarks.report [--quick] [--only allreduce,ddp,fsdp,fsdp_medium,fsdp_modes,hybrid,pipeline,
    pp_fsdp,pipeline_split,offload_hooks,offload]

Each benchmark runs as its own subprocess (its log under ``benchmarks/logs/``) and writes rows as JSON:
``technique, config, ours, peer, metric, ours_value, peer_value`` (higher is better) and, where measured,
``ours_rss_mib, peer_rss_mib``, ``ours_pss_mib, peer_pss_mib`` (peak memory per rank) and ``ceiling_value``
(the metric of a run with no communication at all: the ceiling of the ratio), ``floor_share`` and
``reduction_cpu_ms`` (the share of the peer's communication time a reduction of the measured CPU cost allows),
``ours_cross_host_mb, peer_cross_host_mb`` with ``ours_cross_host_theory_mb, peer_cross_host_theory_mb`` (bytes
sent across hosts per rank per step, measured and in theory) and ``spread`` (how far two runs
of the same implementation in this run are apart: the noise to read the ratio against). The report is data-driven: a
row a benchmark adds shows up in the table and the chart as it is, and an optional column appears when some
row fills it. The summary table replaces the block between the report markers at the top of RESULTS.md;
the detailed sections below it are kept. The chart needs matplotlib (``pip install .[bench]``); without it
the table is still written.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning
import torch
from tqdm import tqdm

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "RESULTS.md"
BEGIN, END = "<!-- report:begin -->", "<!-- report:end -->"


@dataclass(frozen=True)
class Run:
    name: str
    args: list[str]
    expected_s: int  # for the progress bar only
    needs_cuda: bool = False


def runs(quick: bool) -> list[Run]:
    repeats = ["--repeats", "1"] if quick else []
    chosen = [
        Run("allreduce", ["allreduce", "--world", "2", "--min", "4K", "--max", "64M"], 15),
        Run("ddp", ["strategies", "ddp", *repeats], 110 if quick else 200),
        Run("fsdp", ["strategies", "fsdp", *repeats], 150 if quick else 280),
        Run("hybrid", ["strategies", "hybrid", *repeats], 240 if quick else 480),  # issue 27: 2 hosts x 2 ranks
        Run("pipeline", ["strategies", "pipeline"], 55),
        Run("pp_fsdp", ["strategies", "pp_fsdp", *(["--order", "ab"] if quick else [])], 210 if quick else 420),
        Run("pipeline_split", ["pipeline_split"], 240),
        Run("offload_hooks", ["offload_overhead"], 12),
        Run("offload", ["offload_gpu"], 120, needs_cuda=True),
    ]
    if "medium" in importlib.import_module("benchmarks.strategy_fsdp").CONFIGS:  # GPT-2 Medium: memory at size
        chosen.insert(3, Run("fsdp_medium", ["strategies", "fsdp", "--configs", "medium", "--repeats", "1"], 300))
        modes = "hai_fsdp,fsdp1,hai_fsdp:SHARD_GRAD_OP,fsdp1:SHARD_GRAD_OP,hai_fsdp+ac,fsdp1+ac"  # issue 24 item 3
        fsdp_modes = ["strategies", "fsdp", "--configs", "compute,medium", "--repeats", "1", "--strategies", modes]
        chosen.insert(4, Run("fsdp_modes", fsdp_modes, 900))
    return chosen


def run_one(run: Run, logs: Path) -> list[dict]:
    """Runs one benchmark with a progress bar of its expected duration; returns its JSON rows."""
    out, log = logs / f"{run.name}.json", logs / f"{run.name}.log"
    cmd = [sys.executable, "-m", f"benchmarks.{run.args[0]}", *run.args[1:], "--json", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(HERE.parent)}
    start = time.monotonic()
    with log.open("w") as sink, tqdm(total=run.expected_s, desc=run.name, unit="s", leave=True) as bar:
        proc = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT, env=env, cwd=HERE.parent)
        while proc.poll() is None:
            time.sleep(1)
            bar.update(min(1, bar.total - bar.n))
        bar.set_postfix_str(f"{time.monotonic() - start:.0f} s, exit {proc.returncode}")
    if proc.returncode != 0 or not out.exists():
        print(f"{run.name}: failed (exit {proc.returncode}); see {log}", file=sys.stderr)
        return []
    data = json.loads(out.read_text())
    converters = {
        "allreduce": allreduce_rows,
        "offload_hooks": offload_hook_rows,
        "offload": offload_gpu_rows,
        "pipeline_split": pipeline_split_rows,
    }
    try:
        return converters[run.name](data) if run.name in converters else data["rows"]
    except (KeyError, IndexError, TypeError, ZeroDivisionError) as error:  # one benchmark's new shape: keep the rest
        print(f"{run.name}: could not read {out} ({error!r}); its rows are left out", file=sys.stderr)
        return []


_PEERS = {"gloo": "gloo", "deepspeed": "DeepSpeed shm"}  # a size row's "<peer>_s" column -> its name here


def allreduce_rows(data: dict) -> list[dict]:
    """The engine against each peer column of the all-reduce benchmark (``<peer>_s``: gloo, and DeepSpeed's
    shm all-reduce where it built): latency at 4 KiB, bandwidth at 1 MiB (when measured) and at the largest
    size, and at the largest size on an ``alloc_buffer`` tensor. A peer that did not run (``None``) is left out."""
    sizes = data["rows"]
    small, large = sizes[0], sizes[-1]
    middle = [r for r in sizes[1:-1] if r["bytes"] == 1 << 20]
    peers = [key[: -len("_s")] for key in small if key.endswith("_s") and key not in ("engine_s", "buffer_s")]
    rows = []
    for peer in peers:
        name = _PEERS.get(peer, peer)

        def row(config: str, metric: str, ours: float, theirs: float | None, name: str = name) -> dict | None:
            if theirs is None:
                return None
            return {"technique": "hfreduce all_reduce", "config": config, "ours": "engine", "peer": name,
                    "metric": metric, "ours_value": ours, "peer_value": theirs}  # fmt: skip

        def gbps(size: dict, key: str) -> float | None:
            return None if size.get(key) is None else size["bytes"] / size[key] / 1e9

        candidates = [row("4 KiB fp32", "calls/s", 1 / small["engine_s"], _inverse(small.get(f"{peer}_s")))]
        for size in [*middle, large]:
            label = f"{size['bytes'] / 2**20:g} MiB fp32"
            candidates.append(row(label, "GB/s", gbps(size, "engine_s"), gbps(size, f"{peer}_s")))
        if large.get("buffer_s") is not None:
            label = f"{large['bytes'] / 2**20:g} MiB fp32, alloc_buffer"
            candidates.append(row(label, "GB/s", gbps(large, "buffer_s"), gbps(large, f"{peer}_s")))
        rows += [r for r in candidates if r is not None]
    return rows


def _inverse(seconds: float | None) -> float | None:
    return None if seconds is None else 1 / seconds


def offload_hook_rows(data: dict) -> list[dict]:
    """The offload hooks' cost per saved tensor at ratio 0 (force_copy: the CPU image of a GPU run) against
    save_on_cpu's, as saved tensors per µs: in the step, and timed alone (``hooks_us_per_tensor``, the figure
    that holds under load), where the benchmark measured it. A cost at or below zero (noise) gives no row."""
    by_name = {r["name"]: r for r in data["results"]}
    ours, peer = by_name["ratio 0 force_copy"], by_name["save_on_cpu"]
    rows = []
    for field, how in (("overhead_us_per_tensor", "in the step"), ("hooks_us_per_tensor", "hooks alone")):
        if (ours.get(field) or 0) > 0 and (peer.get(field) or 0) > 0:
            rows.append({"technique": "CPU offload hooks",
                         "config": f"tiny GPT, {data['saved_tensors']} saved tensors, ratio 0, {how}",
                         "ours": "CPUOffload", "peer": "save_on_cpu", "metric": "tensors/µs of hook time",
                         "ours_value": 1 / ours[field], "peer_value": 1 / peer[field]})  # fmt: skip
    return rows


def offload_gpu_rows(data: dict) -> list[dict]:
    """The GPU offload benchmark's step speed: ratio 0 against no offload (the hooks' cost when nothing moves)
    and ratio 1 against ``save_on_cpu`` (everything moved), as steps/s; from the pass where the columns take
    turns when it ran (what the benchmark checks its target on). A column that failed is left out."""
    alternating = all(r.get("alternating_step_ms") for r in data["results"])  # one pass for every column
    times = {r["name"]: r["alternating_step_ms" if alternating else "step_ms"] for r in data["results"]}
    speed = {name: 1000 / ms for name, ms in times.items() if ms == ms}  # not NaN
    model = data["setup"].split("), ")[0] + ")" if "), " in data["setup"] else data["setup"]  # "GPT config=... (...)"
    rows = []
    for ours, peer in (("ratio 0", "no offload"), ("ratio 1", "save_on_cpu")):
        if ours in speed and peer in speed:
            rows.append({"technique": "CPU offload (GPU)", "config": f"{model}, {ours}",
                         "ours": f"CPUOffload {ours}", "peer": peer, "metric": "steps/s",
                         "ours_value": speed[ours], "peer_value": speed[peer]})  # fmt: skip
    return rows


def pipeline_split_rows(data: dict) -> list[dict]:
    """The unmodified GPT-2's pipeline against torch's traced one and against our Sequential path of the same
    layers, as samples/s; the spread is the larger of the two sides' (each ran twice in the run)."""
    c, rates, spread = data["config"], data["samples_per_s"], data["spread"]
    config = f"GPT-2 {c['layers']}x{c['width']}, 2 stages, 1F1B, {c['chunks']} microbatches of {c['batch']} rows"
    return [
        {"technique": "pipeline, unmodified model", "config": config, "ours": "PipeDream(partition(model))",
         "peer": peer, "metric": "samples/s", "ours_value": rates["ours"], "peer_value": rates[side],
         "spread": max(spread["ours"], spread[side])}
        for side, peer in (("torch", "torch pipelining (traced)"), ("ours_seq", "our nn.Sequential path"))
    ]  # fmt: skip


def ratio(row: dict) -> float:
    """Ours over the peer (values are rates: higher is better)."""
    return row["ours_value"] / row["peer_value"]


def ceiling_ratio(row: dict) -> float | None:
    """The ratio no implementation can pass on this config (``ceiling_value``: hai_ddp's no-communication run)."""
    return row["ceiling_value"] / row["peer_value"] if row.get("ceiling_value") else None


def comm_removed(row: dict) -> float | None:
    """The share of the peer's communication time that ours removes: (peer - ours) / (peer - ceiling), in time
    per sample (1 / each rate), from the same run. ``None`` without a ceiling, or when communication is under
    ``COMM_BOUND`` of the peer's step: a compute-bound config, where the share would be a ratio of noise."""
    if not row.get("ceiling_value"):
        return None
    peer, ours, free = (1 / row[k] for k in ("peer_value", "ours_value", "ceiling_value"))
    return (peer - ours) / (peer - free) if peer - free >= COMM_BOUND * peer else None


COMM_BOUND = 0.1  # the least share of the peer's step spent communicating for comm_removed to be shown


def _floor(row: dict) -> str:
    """The share a reduction that costs what it measured (``reduction_cpu_ms`` a step, on a core that also
    computes) allows: (peer - floor step) / (peer - ceiling), shown where the share removed is."""
    if comm_removed(row) is None or row.get("floor_share") is None:
        return ""
    return f"{row['floor_share']:.0%} ({row['reduction_cpu_ms']:.0f} ms CPU a step)"


def _cross_host(row: dict) -> str:
    """MB sent across hosts per rank per step, ours / peer, each with its theory in parentheses."""
    keys = ("ours_cross_host_mb", "ours_cross_host_theory_mb", "peer_cross_host_mb", "peer_cross_host_theory_mb")
    if any(row.get(k) is None for k in keys):
        return ""
    ours, ours_theory, peer, peer_theory = (row[k] for k in keys)
    return f"{ours:.1f} ({ours_theory:.1f}) / {peer:.1f} ({peer_theory:.1f}) MB"


def _memory(row: dict, kind: str) -> str:
    ours, peer = row.get(f"ours_{kind}_mib"), row.get(f"peer_{kind}_mib")
    return f"{ours:.0f} / {peer:.0f} MiB ({ours / peer:.2f})" if ours and peer else ""


# Columns shown only when some row fills them: (header, cell of a row, "" when it has none).
_OPTIONAL_COLUMNS = (
    ("no-comm ceiling", lambda r: f"{c:.2f}x" if (c := ceiling_ratio(r)) else ""),
    ("share of the peer's comm time removed", lambda r: f"{s:.0%}" if (s := comm_removed(r)) is not None else ""),
    ("share the reduction's own CPU allows", lambda r: _floor(r)),
    ("peak RSS/rank ours / peer", lambda r: _memory(r, "rss")),
    ("peak PSS/rank ours / peer", lambda r: _memory(r, "pss")),
    ("same-side spread", lambda r: f"{r['spread']:.0%}" if r.get("spread") is not None else ""),
    ("sent across hosts/rank/step ours / peer (theory)", _cross_host),
)


def machine_line() -> str:
    """CPU model, cores, torch and Lightning versions, and the date: what a reader needs to compare runs."""
    return (
        f"{cpu_model()}, {os.cpu_count()} cores; torch {torch.__version__}, Lightning {lightning.__version__}; "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"
    )


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return " ".join(line.split(":", 1)[1].split())
    except OSError:
        pass
    return platform.processor() or platform.machine()


def summary(rows: list[dict], command: str) -> str:
    columns = [(head, cell) for head, cell in _OPTIONAL_COLUMNS if any(cell(r) for r in rows)]
    lines = [
        BEGIN,
        "## Summary (written by `make bench`)",
        "",
        f"Machine: {machine_line()}.",
        f"Command: `{command}`. Higher is better; ratio = ours / peer; the ceiling is the ratio of a run with no "
        "communication at all, and the share of the peer's communication time removed is (peer - ours) / "
        f"(peer - ceiling) in step time, where communication is at least {COMM_BOUND:.0%} of the peer's step "
        "(memory: ours / peer, lower is better). The share the reduction's own CPU allows is that share for a "
        "step of the no-communication run plus the CPU time the reduction itself took (ranks that own one core "
        "each cannot hide it behind compute). The same-side spread is how far apart two runs of one "
        "implementation are in this run (slowest / fastest - 1): a ratio within it is noise. Sent across hosts: "
        "the MB each rank sends to the other (simulated) host per step, measured at its torch.distributed calls "
        "(benchmarks/cross_host.py), with the ring's theory in parentheses.",
        "",
        "| technique | config | ours | peer | metric | ours | peer | ratio |" + "".join(f" {h} |" for h, _ in columns),
        "|---|---|---|---|---|---:|---:|---:|" + "---|" * len(columns),
    ]
    for r in rows:
        lines.append(
            f"| {r['technique']} | {r['config']} | {r['ours']} | {r['peer']} | {r['metric']} "
            f"| {r['ours_value']:.3g} | {r['peer_value']:.3g} | {ratio(r):.2f}x |"
            + "".join(f" {cell(r)} |" for _, cell in columns)
        )
    lines += ["", "![results](results.png)", END]
    return "\n".join(lines)


def write_results(block: str) -> None:
    text = RESULTS.read_text() if RESULTS.exists() else "# Benchmark results\n"
    if BEGIN in text:
        head, rest = text.split(BEGIN, 1)
        text = head + block + rest.split(END, 1)[1]
    else:
        first, _, rest = text.partition("\n\n")
        text = f"{first}\n\n{block}\n\n{rest}"
    RESULTS.write_text(text)


def chart(rows: list[dict], path: Path) -> bool:
    """Writes :func:`figure` to ``path``; ``False`` without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing (pip install .[bench]): table written, chart skipped", file=sys.stderr)
        return False
    fig = figure(rows)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def figure(rows: list[dict]) -> Any:
    """One bar per row, ours / peer on a log scale (the peer is the 1x line), with the ceiling drawn where one
    exists; a second panel, peer / ours peak memory per rank, for the rows that measured it."""
    import matplotlib.pyplot as plt

    memory = [r for r in rows if r.get("ours_rss_mib") and r.get("peer_rss_mib")]
    widths = [max(1, len(rows)), max(1, len(memory))] if memory else [1]
    size = (max(9, 0.75 * (len(rows) + len(memory))), 6.5)
    fig, axes = plt.subplots(1, len(widths), figsize=size, gridspec_kw={"width_ratios": widths}, squeeze=False)
    _speed_panel(axes[0][0], rows)
    if memory:
        _memory_panel(axes[0][1], memory)
    fig.suptitle("lightning-haiscale against its peers, side by side in one run (higher is better)")
    fig.text(0.5, 0.93, f"Machine: {machine_line()}", ha="center", fontsize=8)
    fig.tight_layout(rect=(0, 0, 1, 0.92))
    return fig


def _label(row: dict) -> str:
    return textwrap.fill(f"{row['ours']} vs {row['peer']}: {row['config']}", 30)


def _log_axis(ax: Any, ylabel: str) -> None:
    import matplotlib.ticker

    ax.axhline(1.0, color="black", linewidth=0.8)  # the peer
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}x"))
    ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_ylabel(ylabel)
    low, high = ax.get_ylim()
    ax.set_ylim(min(low, 0.5), max(high, 2.0) * 1.6)  # room for the labels above the bars


def _bars(ax: Any, x: list[float], ratios: list[float], **style: Any) -> Any:
    """Bars from the 1x line (the peer) to each ratio: up when ours is ahead, down when behind."""
    return ax.bar(x, [r - 1 for r in ratios], bottom=1.0, **style)


def _speed_panel(ax: Any, rows: list[dict]) -> None:
    x = list(range(len(rows)))
    ceilings = [ceiling_ratio(r) for r in rows]
    with_ceiling = [i for i, c in enumerate(ceilings) if c]
    if with_ceiling:
        _bars(ax, with_ceiling, [ceilings[i] for i in with_ceiling], width=0.75, fill=False, edgecolor="#30638e",
              linestyle="--", label="no-communication ceiling")  # fmt: skip
    _bars(ax, x, [ratio(r) for r in rows], width=0.5, color="#d1495b", label="ours / peer")
    for i, r in enumerate(rows):
        text = f"{ratio(r):.2f}x"
        if ceilings[i]:
            text += f"\nceiling {ceilings[i]:.2f}x"
        if (share := comm_removed(r)) is not None:
            text += f"\n{share:.0%} of comm\nremoved"
            if r.get("floor_share") is not None:
                text += f"\n(floor {r['floor_share']:.0%})"
        top = max(ratio(r), ceilings[i] or 0, 1.0)
        ax.annotate(text, (i, top), ha="center", va="bottom", fontsize=6, linespacing=0.9)
    ax.set_xticks(x, [_label(r) for r in rows], fontsize=6, rotation=45, ha="right")
    _log_axis(ax, "speed, ours / peer (log scale; 1x = the peer)")
    ax.legend(fontsize=7, loc="upper right")


def _memory_panel(ax: Any, rows: list[dict]) -> None:
    kinds = [k for k in ("rss", "pss") if any(r.get(f"ours_{k}_mib") for r in rows)]
    width = 0.7 / len(kinds)
    for j, kind in enumerate(kinds):
        have = [(i, r) for i, r in enumerate(rows) if r.get(f"ours_{kind}_mib") and r.get(f"peer_{kind}_mib")]
        offsets = [i + (j - (len(kinds) - 1) / 2) * width for i, _ in have]
        values = [r[f"peer_{kind}_mib"] / r[f"ours_{kind}_mib"] for _, r in have]
        _bars(ax, offsets, values, width=width, color=("#edae49", "#00798c")[j],
              label=f"peak {kind.upper()}/rank, peer / ours")  # fmt: skip
        for offset, value in zip(offsets, values, strict=True):
            ax.annotate(f"{value:.2f}x", (offset, max(value, 1.0)), ha="center", va="bottom", fontsize=6)
    x = list(range(len(rows)))
    ax.set_xticks(x, [_label(r) for r in rows], fontsize=6, rotation=45, ha="right")
    _log_axis(ax, "memory, peer / ours (log scale; above 1x = ours smaller)")
    ax.legend(fontsize=7, loc="upper right")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="one repeat per pair (about half the time)")
    parser.add_argument("--only", help="comma-separated subset of " + ",".join(r.name for r in runs(quick=False)))
    args = parser.parse_args()
    logs = HERE / "logs"
    logs.mkdir(exist_ok=True)
    chosen = [r for r in runs(args.quick) if not args.only or r.name in args.only.split(",")]
    rows: list[dict] = []
    for run in chosen:
        if run.needs_cuda and not torch.cuda.is_available():
            print(f"{run.name}: skipped (needs a GPU)")
            continue
        rows += run_one(run, logs)
    command = "python -m benchmarks.report " + " ".join(sys.argv[1:])
    write_results(summary(rows, command.strip()))
    chart(rows, HERE / "results.png")
    print(summary(rows, command.strip()))
    return 0 if rows else 1


if __name__ == "__main__":
    sys.exit(main())
