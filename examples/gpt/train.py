"""Train the GPT example with any registered strategy.

    python examples/gpt/train.py --strategy hai_ddp --devices 2 --config tiny --max-steps 60

Lightning launches the extra processes itself (``--devices N`` on one machine); under torchrun or
SLURM it uses the processes it was given. Ends with a summary: training samples/s after warm-up and
the final validation loss and perplexity.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, for `examples.gpt`

import lightning as L
from lightning.pytorch.strategies import StrategyRegistry

import lightning_haiscale  # noqa: F401  (registers the hai_* strategy names)
from examples.gpt.data import DEFAULT_MAX_BYTES, GPTDataModule
from examples.gpt.lightning_module import GPTLightningModule
from examples.gpt.model import CONFIGS, config

PIPELINE_STRATEGIES = ("hai_gpipe", "hai_pipedream", "hai_interleaved_1f1b")  # need untied LM head weights


class Throughput(L.Callback):
    """Training samples per second over all data-parallel replicas, from step ``warmup`` on."""

    def __init__(self, warmup: int) -> None:
        self.warmup = warmup
        self.start: float | None = None
        self.end: float | None = None
        self.samples = 0

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        if self.start is None and trainer.global_step >= self.warmup:
            self.start = time.perf_counter()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, *a: Any):
        if self.start is not None:
            self.samples += batch[0].size(0)
            self.end = time.perf_counter()

    def samples_per_second(self, trainer: L.Trainer) -> float | None:
        if self.start is None or self.end is None or self.end <= self.start:
            return None
        kwargs = getattr(trainer.strategy, "distributed_sampler_kwargs", None) or {}
        replicas = kwargs.get("num_replicas", 1)  # pipeline stages share a batch: count replicas, not ranks
        return self.samples * replicas / (self.end - self.start)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    names = ["auto", *StrategyRegistry.available_strategies()]
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--strategy", default="hai_ddp", help=f"a registered strategy: {', '.join(names)}")
    p.add_argument("--accelerator", default="auto", help="cpu, gpu or auto")
    p.add_argument("--devices", type=int, default=1, help="processes (devices) per node")
    p.add_argument("--num-nodes", type=int, default=1)
    p.add_argument("--config", choices=sorted(CONFIGS), default="tiny")
    p.add_argument("--max-steps", type=int, default=60, help="optimizer steps")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per batch and per process")
    p.add_argument("--block-size", type=int, default=None, help="tokens per sequence (default: the config's)")
    p.add_argument("--accumulate-grad-batches", type=int, default=1)
    p.add_argument("--data", default=None, help="text file or folder (default: the Python stdlib's source)")
    p.add_argument("--max-bytes", type=int, default=DEFAULT_MAX_BYTES, help="corpus cap in bytes")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--precision", default=None, help="Lightning precision, e.g. bf16-mixed (default 32-true)")
    p.add_argument("--val-every", type=int, default=None, help="validate every N steps (default: at the end)")
    p.add_argument("--val-batches", type=int, default=16, help="validation batches per process")
    p.add_argument("--warmup-steps", type=int, default=5, help="steps left out of the samples/s figure")
    p.add_argument("--checkpoint-dir", default=None, help="save checkpoints here (default: none)")
    p.add_argument("--seed", type=int, default=1234)
    args = p.parse_args(argv)
    if args.strategy not in names:
        p.error(f"--strategy {args.strategy!r} is not registered; choose one of {', '.join(names)}")
    return args


def main(argv: list[str] | None = None) -> dict[str, float | None]:
    args = parse_args(argv)
    L.seed_everything(args.seed, workers=True)
    overrides: dict[str, Any] = {"tie_weights": args.strategy not in PIPELINE_STRATEGIES}
    if args.block_size is not None:
        overrides["block_size"] = args.block_size
    cfg = config(args.config, **overrides)
    data = GPTDataModule(args.data, cfg.block_size, args.batch_size, max_bytes=args.max_bytes, seed=args.seed)
    module = GPTLightningModule(cfg, lr=args.lr)
    throughput = Throughput(min(args.warmup_steps, max(args.max_steps - 1, 0)))
    val_every = args.val_every or args.max_steps
    trainer = L.Trainer(
        strategy=args.strategy,
        accelerator=args.accelerator,
        devices=args.devices,
        num_nodes=args.num_nodes,
        max_steps=args.max_steps,
        accumulate_grad_batches=args.accumulate_grad_batches,
        precision=args.precision,
        val_check_interval=val_every * args.accumulate_grad_batches,
        check_val_every_n_epoch=None,
        limit_val_batches=args.val_batches,
        num_sanity_val_steps=0,
        callbacks=[throughput],
        logger=False,
        enable_checkpointing=args.checkpoint_dir is not None,
        default_root_dir=args.checkpoint_dir,
    )
    trainer.fit(module, datamodule=data)
    if "val_loss" not in trainer.callback_metrics:
        trainer.validate(module, datamodule=data, verbose=False)
    summary = {
        "samples_per_s": throughput.samples_per_second(trainer),
        "val_loss": float(trainer.callback_metrics["val_loss"]),
        "val_ppl": float(trainer.callback_metrics["val_ppl"]),
    }
    if trainer.is_global_zero:
        params = sum(p.numel() for p in module.parameters())
        rate = summary["samples_per_s"]
        print(
            f"\nsummary: config={args.config} ({params / 1e6:.2f}M parameters on rank 0) strategy={args.strategy} "
            f"world={trainer.world_size} steps={trainer.global_step}\n"
            f"  samples/s (after {throughput.warmup} warm-up steps): {'n/a' if rate is None else f'{rate:.1f}'}\n"
            f"  final validation loss: {summary['val_loss']:.4f}   perplexity: {summary['val_ppl']:.2f}"
        )
    return summary


if __name__ == "__main__":
    main()
