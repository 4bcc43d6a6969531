"""A vision model and an encoder-decoder model (``transformers``, unmodified) in a pipeline of 2 processes (gloo),
1F1B, ours beside torch's traced pipeline in one run: ``python -m benchmarks.pipeline_families [--json OUT]``.

- ``ours``: ``partition(model, rank, 2, split_points=[...])`` cuts the model before the named block
  (``ModuleStage``: the model's own forward, the loss from ``labels=`` on the last stage) and ``PipeDream``
  runs it;
- ``torch``: ``torch.distributed.pipelining.pipeline(model, split_spec={block: SplitPoint.BEGINNING})`` traces
  the same model and ``Schedule1F1B`` runs the same split, with the same loss in its ``loss_fn``. Where torch
  cannot trace the model or run its step, the report gives its error instead of a figure.

Models: ``ViTForImageClassification`` cut at ``vit.layers.<half>``, and ``T5ForConditionalGeneration`` cut at
``decoder.block.<half>`` (our first stage runs the whole encoder and the decoder's first half, as torch's
split does). Each implementation runs twice, in the order ours, torch, torch, ours, each time in a fresh pair
of processes on a freshly built model; its figure is the mean of its two median step times (the spread of its
two runs is the run's noise).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.timing import median_step_seconds
from lightning_haiscale.pipeline import PipeDream, partition
from lightning_haiscale.testing import run_distributed

ORDER = ("ours", "torch", "torch", "ours")
Step = Callable[[dict[str, torch.Tensor]], Any]


def _vit(args: argparse.Namespace) -> tuple[nn.Module, str, dict[str, torch.Tensor]]:
    from transformers import ViTConfig, ViTForImageClassification

    cfg = ViTConfig(
        image_size=args.image, patch_size=8, hidden_size=args.width, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, intermediate_size=4 * args.width, num_labels=10,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    g = torch.Generator().manual_seed(1)
    batch = {"pixel_values": torch.randn(args.batch, 3, args.image, args.image, generator=g),
             "labels": torch.randint(0, 10, (args.batch,), generator=g)}  # fmt: skip
    return ViTForImageClassification(cfg), f"vit.layers.{args.layers // 2}", batch


def _t5(args: argparse.Namespace) -> tuple[nn.Module, str, dict[str, torch.Tensor]]:
    from transformers import T5Config, T5ForConditionalGeneration

    cfg = T5Config(
        vocab_size=args.vocab, d_model=args.width, d_kv=args.width // args.heads, d_ff=4 * args.width,
        num_layers=args.layers, num_decoder_layers=args.layers, num_heads=args.heads, dropout_rate=0.0,
        decoder_start_token_id=0, pad_token_id=0, use_cache=False, tie_word_embeddings=False,
    )  # fmt: skip
    g = torch.Generator().manual_seed(1)
    batch = {"input_ids": torch.randint(1, args.vocab, (args.batch, args.seq), generator=g),
             "labels": torch.randint(1, args.vocab, (args.batch, args.seq), generator=g)}  # fmt: skip
    return T5ForConditionalGeneration(cfg), f"decoder.block.{args.layers // 2}", batch


MODELS = {"vit": _vit, "t5": _t5}


def _build(args: argparse.Namespace, name: str) -> tuple[nn.Module, str, dict[str, torch.Tensor]]:
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    torch.manual_seed(0)
    return MODELS[name](args)


def _ours(args: argparse.Namespace, name: str, rank: int) -> tuple[list[nn.Parameter], Step]:
    model, point, _ = _build(args, name)
    pipe = PipeDream(partition(model, rank, 2, split_points=[point]), args.chunks)
    criterion = lambda out: out.loss / args.chunks  # noqa: E731 - haiscale's convention: mean over the batch
    return list(pipe.parameters()), lambda batch: pipe.forward_backward(kwargs=batch, criterion=criterion)


def _torch(args: argparse.Namespace, name: str, rank: int) -> tuple[list[nn.Parameter], Step]:
    from torch.distributed.pipelining import Schedule1F1B, SplitPoint, pipeline

    model, point, batch = _build(args, name)
    rows = args.batch // args.chunks
    inputs = _torch_inputs(model, name, batch)
    traced = pipeline(model, mb_args=(), mb_kwargs={k: v[:rows] for k, v in inputs.items()},
                      split_spec={point: SplitPoint.BEGINNING})  # fmt: skip
    stage = traced.build_stage(rank, torch.device("cpu"))

    def loss_fn(out: Any, y: torch.Tensor) -> torch.Tensor:  # the model's own labels= loss
        logits = out[0] if isinstance(out, (tuple, list)) else out
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))

    schedule = Schedule1F1B(stage, args.chunks, loss_fn=loss_fn)

    def step(batch: dict[str, torch.Tensor]) -> None:
        if rank == 0:
            schedule.step(**_torch_inputs(model, name, batch))
        else:
            schedule.step(target=batch["labels"], losses=[])

    return list(stage.submod.parameters()), step


def _torch_inputs(model: nn.Module, name: str, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The traced model's keywords: without ``labels`` (the loss is the schedule's), with T5's decoder inputs."""
    if name == "t5":
        return {"input_ids": batch["input_ids"], "decoder_input_ids": model._shift_right(batch["labels"])}
    return {"pixel_values": batch["pixel_values"]}


def _run(args: argparse.Namespace, name: str, rank: int, impl: str) -> float | str:
    """The median step time, or the error that stopped the implementation (tracing or its first step: both
    ranks fail there alike, or the peer's receive ends with the group's timeout), as the report gives it."""
    try:
        params, step = {"ours": _ours, "torch": _torch}[impl](args, name, rank)
        _, _, batch = _build(args, name)
        return median_step_seconds(step, params, batch, args.warmup, args.steps)
    except Exception as error:  # the pair of processes ends here: a failed transfer leaves its group unusable
        return f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"


def _worker(rank: int, world: int, args: argparse.Namespace, name: str, impl: str) -> float | str:
    torch.set_num_threads(args.threads)
    return _run(args, name, rank, impl)


def _one_run(args: argparse.Namespace, name: str, impl: str) -> float | str:
    """One implementation's run in a fresh pair of processes; a failure's error from the rank whose own it is
    (not its peer's closed connection)."""
    results = run_distributed(_worker, 2, args, name, impl, timeout=1800)
    errors = [r for r in results if isinstance(r, str)]
    if errors:
        return next((e for e in errors if "by peer" not in e), errors[0])
    return results[0]


def _summary(args: argparse.Namespace, runs: dict[str, list[Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for impl, values in runs.items():
        errors = [v for v in values if isinstance(v, str)]
        if errors:
            out[impl] = {"error": errors[0]}
        else:
            out[impl] = {"samples_per_s": args.batch / statistics.mean(values),
                         "spread": abs(values[0] - values[1]) / statistics.mean(values)}  # fmt: skip
    if all("samples_per_s" in v for v in out.values()):
        out["ours_vs_torch"] = out["ours"]["samples_per_s"] / out["torch"]["samples_per_s"]
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="vit,t5")
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--width", type=int, default=192)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--image", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--chunks", type=int, default=4)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", help="also write the report to this file")
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    out, args.json = args.json, None
    report: dict[str, Any] = {"config": vars(args)}
    for name in args.models.split(","):
        runs: dict[str, list[Any]] = {}
        for impl in ORDER:
            runs.setdefault(impl, []).append(_one_run(args, name, impl))
        report[name] = _summary(args, runs)
    print(json.dumps(report, indent=1))
    if out:
        with open(out, "w") as sink:
            json.dump(report, sink, indent=1)
    return report


if __name__ == "__main__":
    main()
