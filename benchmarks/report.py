"""``make bench``: every technique beside its peer in one run; writes RESULTS.md's summary and results.png.

    python -m benchmarks.report [--quick] [--only allreduce,ddp,fsdp,pipeline,offload_hooks,offload]

Each benchmark runs as its own subprocess (its log under ``benchmarks/logs/``) and writes rows as JSON:
``technique, config, ours, peer, metric, ours_value, peer_value`` (higher is better) and, where measured,
``ours_rss_mib, peer_rss_mib``. The summary table replaces the block between the report markers at the
top of RESULTS.md; the detailed sections below it are kept. The chart needs matplotlib
(``pip install .[bench]``); without it the table is still written.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

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
    return [
        Run("allreduce", ["allreduce", "--world", "2", "--min", "4K", "--max", "64M"], 15),
        Run("ddp", ["strategies", "ddp", *repeats], 110 if quick else 200),
        Run("fsdp", ["strategies", "fsdp", *repeats], 150 if quick else 280),
        Run("pipeline", ["strategies", "pipeline"], 55),
        Run("offload_hooks", ["offload_overhead"], 12),
        Run("offload", ["offload_gpu"], 120, needs_cuda=True),
    ]


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
    converters = {"allreduce": allreduce_rows, "offload_hooks": offload_hook_rows}
    return converters[run.name](data) if run.name in converters else data["rows"]


def allreduce_rows(data: dict) -> list[dict]:
    """The all-reduce benchmark's latency at 4 KiB and bandwidth at the largest size, engine vs gloo."""
    small, large = data["rows"][0], data["rows"][-1]
    mib = large["bytes"] / 2**20

    def row(config: str, metric: str, ours: float, peer: float) -> dict:
        return {"technique": "hfreduce all_reduce", "config": config, "ours": "engine", "peer": "gloo",
                "metric": metric, "ours_value": ours, "peer_value": peer}  # fmt: skip

    def gbps(seconds: float) -> float:
        return large["bytes"] / seconds / 1e9

    return [
        row("4 KiB fp32", "calls/s", 1 / small["engine_s"], 1 / small["gloo_s"]),
        row(f"{mib:g} MiB fp32", "GB/s", gbps(large["engine_s"]), gbps(large["gloo_s"])),
        row(f"{mib:g} MiB fp32, alloc_buffer", "GB/s", gbps(large["buffer_s"]), gbps(large["gloo_s"])),
    ]


def offload_hook_rows(data: dict) -> list[dict]:
    """The offload hooks' cost per saved tensor at ratio 0 against save_on_cpu's, as saved tensors per µs."""
    by_name = {r["name"]: r["overhead_us_per_tensor"] for r in data["results"]}
    ours, peer = by_name["ratio 0 force_copy"], by_name["save_on_cpu"]
    return [
        {"technique": "CPU offload hooks", "config": f"tiny GPT, {data['saved_tensors']} saved tensors, ratio 0",
         "ours": "CPUOffload", "peer": "save_on_cpu", "metric": "tensors/µs of hook time",
         "ours_value": 1 / ours, "peer_value": 1 / peer}
    ]  # fmt: skip


def summary(rows: list[dict], command: str) -> str:
    lines = [
        BEGIN,
        "## Summary (written by `make bench`)",
        "",
        f"Machine: {platform.machine()}, {os.cpu_count()} cores; torch {torch.__version__}, "
        f"Lightning {lightning.__version__}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}.",
        f"Command: `{command}`. Higher is better; ratio = ours / peer (RSS: ours / peer, lower is better).",
        "",
        "| technique | config | ours | peer | metric | ours | peer | ratio | peak RSS/rank ours / peer |",
        "|---|---|---|---|---|---:|---:|---:|---|",
    ]
    for r in rows:
        rss = f"{r['ours_rss_mib']:.0f} / {r['peer_rss_mib']:.0f} MiB" if r.get("peer_rss_mib") else ""
        lines.append(
            f"| {r['technique']} | {r['config']} | {r['ours']} | {r['peer']} | {r['metric']} "
            f"| {r['ours_value']:.3g} | {r['peer_value']:.3g} | {r['ours_value'] / r['peer_value']:.2f}x | {rss} |"
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
    """Grouped bars like haiscale's published comparison: peer = 1.0, ours beside it, ratio on top."""
    try:
        import matplotlib
        import matplotlib.ticker

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing (pip install .[bench]): table written, chart skipped", file=sys.stderr)
        return False
    labels = [textwrap.fill(f"{r['ours']} vs {r['peer']}: {r['config']}", 28) for r in rows]
    ratios = [r["ours_value"] / r["peer_value"] for r in rows]
    x = range(len(rows))
    fig, ax = plt.subplots(figsize=(max(8, 0.9 * len(rows)), 6))
    ax.bar([i - 0.2 for i in x], [1.0] * len(rows), width=0.4, label="peer", color="#9aa5b1")
    bars = ax.bar([i + 0.2 for i in x], ratios, width=0.4, label="lightning-haiscale", color="#d1495b")
    for bar, ratio in zip(bars, ratios, strict=True):
        ax.annotate(f"{ratio:.2f}x", (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom")
    ax.set_xticks(list(x), labels, fontsize=7, rotation=40, ha="right")
    ax.set_ylabel("throughput relative to the peer (log scale)")
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}x"))
    ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="one repeat per pair (about half the time)")
    parser.add_argument("--only", help="comma-separated subset of allreduce,ddp,fsdp,pipeline,offload_hooks,offload")
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
