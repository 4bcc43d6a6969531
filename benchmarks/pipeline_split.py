"""An unmodified GPT-2 (``transformers``) in a pipeline of 2 processes (gloo), 1F1B, three ways in one run:
``python -m benchmarks.pipeline_split [--json OUT]`` (``make bench`` runs it).

- ``ours``: ``partition(model, rank, 2)`` cuts the model at its blocks (``ModuleStage``: the model's own forward,
  the loss from ``labels=`` on the last stage) and ``PipeDream`` runs it;
- ``torch``: ``torch.distributed.pipelining.pipeline(model, split_spec=...)`` traces the same model and
  ``Schedule1F1B`` runs the same split, the same loss in its ``loss_fn`` (traced with ``labels=`` too, its
  stages did not take the labels: ``forward() got an unexpected keyword argument 'labels'``);
- ``ours_seq``: the same layers written as an ``nn.Sequential`` (embedding, blocks, head adapters) with the loss
  in the criterion, cut at the same block by ``partition`` and run by ``PipeDream``.

The head is untied (``tie_word_embeddings=False``) so that the three run the same work (the traced pipeline
does not keep a tied weight in sync). The implementations run in the order ours, torch, ours_seq, ours_seq,
torch, ours in one pair of processes, each time on a freshly built model; each one's figure is the mean of
its two median step times, so that a load that changes through the run weighs on all alike. The spread of
one implementation's two runs is the run's noise.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from benchmarks.timing import median_step_seconds
from lightning_haiscale.pipeline import PipeDream, partition
from lightning_haiscale.testing import run_distributed

ORDER = ("ours", "torch", "ours_seq", "ours_seq", "torch", "ours")


def _model(args: argparse.Namespace) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = GPT2Config(
        n_layer=args.layers, n_embd=args.width, n_head=args.heads, vocab_size=args.vocab, n_positions=args.seq,
        use_cache=False, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=False,
    )  # fmt: skip
    return GPT2LMHeadModel(cfg)


class _Embed(nn.Module):
    def __init__(self, gpt: nn.Module) -> None:
        super().__init__()
        self.wte, self.wpe, self.drop = gpt.transformer.wte, gpt.transformer.wpe, gpt.transformer.drop

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.drop(self.wte(ids) + self.wpe(torch.arange(ids.size(1), device=ids.device)))


class _Block(nn.Module):
    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(x)


class _Head(nn.Module):
    def __init__(self, gpt: nn.Module) -> None:
        super().__init__()
        self.ln_f, self.lm_head = gpt.transformer.ln_f, gpt.lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(x))


def _ours(args: argparse.Namespace, rank: int) -> tuple[list[nn.Parameter], Callable[[torch.Tensor], Any]]:
    pipe = PipeDream(partition(_model(args), rank, 2, split_points=[f"transformer.h.{args.layers // 2}"]), args.chunks)
    criterion = lambda out: out.loss / args.chunks  # noqa: E731 - haiscale's convention: mean over the batch
    return list(pipe.parameters()), lambda x: pipe.forward_backward(kwargs={"input_ids": x, "labels": x},
                                                                      criterion=criterion)  # fmt: skip


def _ours_seq(args: argparse.Namespace, rank: int) -> tuple[list[nn.Parameter], Callable[[torch.Tensor], Any]]:
    gpt = _model(args)
    seq = nn.Sequential(_Embed(gpt), *(_Block(b) for b in gpt.transformer.h), _Head(gpt))
    half = args.layers // 2
    pipe = PipeDream(partition(seq, rank, 2, balance=[1 + half, args.layers - half + 1]), args.chunks)

    def criterion(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits[:, :-1].reshape(-1, args.vocab), y[:, 1:].reshape(-1)) / args.chunks

    return list(pipe.parameters()), lambda x: pipe.forward_backward(x, criterion=criterion, labels=(x,))


def _torch(args: argparse.Namespace, rank: int) -> tuple[list[nn.Parameter], Callable[[torch.Tensor], Any]]:
    from torch.distributed.pipelining import Schedule1F1B, SplitPoint, pipeline

    mb = torch.zeros(args.batch // args.chunks, args.seq, dtype=torch.long)
    split = {f"transformer.h.{args.layers // 2}": SplitPoint.BEGINNING}
    traced = pipeline(_model(args), mb_args=(mb,), split_spec=split)
    stage = traced.build_stage(rank, torch.device("cpu"))

    def loss_fn(out: Any, y: torch.Tensor) -> torch.Tensor:  # the same loss as the model's labels= path
        logits = out[0] if isinstance(out, (tuple, list)) else out
        return F.cross_entropy(logits[:, :-1].reshape(-1, args.vocab), y[:, 1:].reshape(-1))

    schedule = Schedule1F1B(stage, args.chunks, loss_fn=loss_fn)

    def step(x: torch.Tensor) -> None:
        if rank == 0:
            schedule.step(x)
        else:
            schedule.step(target=x, losses=[])

    return list(stage.submod.parameters()), step


def _run(args: argparse.Namespace, rank: int, impl: str) -> float:
    build = {"ours": _ours, "torch": _torch, "ours_seq": _ours_seq}[impl]
    params, step = build(args, rank)
    x = torch.randint(0, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(1))
    return median_step_seconds(step, params, x, args.warmup, args.steps)


def _worker(rank: int, world: int, args: argparse.Namespace) -> dict[str, list[float]]:
    torch.set_num_threads(args.threads)
    dist.barrier()
    runs: dict[str, list[float]] = {}
    for impl in ORDER:
        runs.setdefault(impl, []).append(_run(args, rank, impl))
    return runs


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--chunks", type=int, default=4)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", help="also write the report to this file (what `make bench` reads)")
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    out, args.json = args.json, None
    runs = run_distributed(_worker, 2, args, timeout=3600)[0]
    step = {impl: statistics.mean(t) for impl, t in runs.items()}
    report = {
        "config": vars(args),
        "samples_per_s": {impl: args.batch / t for impl, t in step.items()},
        "spread": {impl: abs(t[0] - t[1]) / statistics.mean(t) for impl, t in runs.items()},
        "ours_vs_torch": step["torch"] / step["ours"],
        "ours_vs_ours_seq": step["ours_seq"] / step["ours"],
    }
    print(json.dumps(report, indent=1))
    if out:
        with open(out, "w") as sink:
            json.dump(report, sink, indent=1)
    print(f"unmodified GPT-2, 1F1B, 2 stages: ours {report['samples_per_s']['ours']:.2f} samples/s, torch's traced "
          f"{report['samples_per_s']['torch']:.2f} ({report['ours_vs_torch']:.3f}x), our Sequential path "
          f"{report['samples_per_s']['ours_seq']:.2f} ({report['ours_vs_ours_seq']:.3f}x)")  # fmt: skip
    return report


if __name__ == "__main__":
    main()
