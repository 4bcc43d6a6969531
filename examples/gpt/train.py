"""Train the GPT example with any registered strategy; every Trainer flag works (LightningCLI).

    python -m examples.gpt.train --trainer.strategy=hai_ddp --trainer.accelerator=cpu --trainer.devices=2
    python -m examples.gpt.train --config examples/gpt/demo.yaml          # what `make demo` runs
    python -m examples.gpt.train --help                                   # every option

Options are LightningCLI's: ``--trainer.*`` (any Trainer argument: ``strategy``, ``devices``, ``num_nodes``,
``max_steps``, ``precision``, ``accumulate_grad_batches``, ...; a strategy's own arguments through
``--trainer.strategy=hai_fsdp`` or a ``class_path``/``init_args`` block in YAML), ``--model.*``
(``GPTLightningModule``: ``--model.cfg=small`` picks a named config, ``--model.cfg.n_layer=2`` sets one
field of the default ``tiny``), ``--data.*`` (``GPTDataModule``: ``--data.data=PATH``, ``--data.batch_size``),
``--throughput.*`` (Lightning's ``ThroughputMonitor``), ``--seed_everything``, and ``--config FILE.yaml``
for any of them (``--print_config`` writes one). The data's block size follows the model's.

Lightning starts the extra processes itself (``--trainer.devices=N`` on one machine); under torchrun or
SLURM it uses the processes it was given. Run from the repository root (``examples`` is imported as a
package). Ends with a summary on rank 0: training samples/s over the last ``--throughput.window_size``
steps (all data-parallel replicas together), and the final validation loss and perplexity.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ThroughputMonitor
from lightning.pytorch.cli import ArgsType, LightningArgumentParser, LightningCLI

import lightning_haiscale  # noqa: F401  (registers the hai_* strategy names)
from examples.gpt.data import GPTDataModule, batch_samples
from examples.gpt.lightning_module import GPTLightningModule
from examples.gpt.model import CONFIGS, GPTConfig

TRAINER_DEFAULTS: dict[str, Any] = {
    "strategy": "hai_ddp",
    "max_steps": 60,
    "limit_val_batches": 16,  # per process
    "num_sanity_val_steps": 0,
    "enable_checkpointing": False,  # --trainer.enable_checkpointing=true --trainer.default_root_dir=DIR
}


def _cfg_fields(cfg: Any) -> dict[str, Any]:
    """``--model.cfg`` as parsed (a config name, a dict, or jsonargparse's namespace of GPTConfig) as fields."""
    if isinstance(cfg, str):
        return asdict(CONFIGS[cfg])
    cfg = getattr(cfg, "init_args", cfg)
    return dict(cfg) if isinstance(cfg, dict) else dict(vars(cfg))


def block_size_of(cfg: Any) -> int:
    """The context length of ``--model.cfg``, which the data's block size follows."""
    return _cfg_fields(cfg).get("block_size", GPTConfig.block_size)


class GPTCLI(LightningCLI):
    """LightningCLI with Lightning's ThroughputMonitor always on and the data's block size tied to the model's."""

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_lightning_class_args(ThroughputMonitor, "throughput")
        parser.set_defaults({"throughput.batch_size_fn": batch_samples, "throughput.window_size": 50})
        parser.link_arguments("model.cfg", "data.block_size", compute_fn=block_size_of)


def summarize(trainer: Trainer, module: GPTLightningModule, per_rank: float | None) -> dict[str, float | None]:
    """Samples/s of every data-parallel replica together, and the final validation loss and perplexity."""
    kwargs = getattr(trainer.strategy, "distributed_sampler_kwargs", None) or {}
    replicas = kwargs.get("num_replicas", 1)  # pipeline stages share a batch: count replicas, not ranks
    summary = {
        "samples_per_s": None if per_rank is None else per_rank * replicas,
        "val_loss": float(trainer.callback_metrics["val_loss"]),
        "val_ppl": float(trainer.callback_metrics["val_ppl"]),
    }
    if trainer.is_global_zero:
        params = sum(p.numel() for p in module.parameters())
        rate = summary["samples_per_s"]
        print(
            f"\nsummary: {params / 1e6:.2f}M parameters on rank 0, strategy={type(trainer.strategy).__name__} "
            f"world={trainer.world_size} steps={trainer.global_step}\n"
            f"  samples/s (all replicas, last --throughput.window_size steps): "
            f"{'n/a (fewer logged steps than the window)' if rate is None else f'{rate:.1f}'}\n"
            f"  final validation loss: {summary['val_loss']:.4f}   perplexity: {summary['val_ppl']:.2f}"
        )
    return summary


def main(args: ArgsType = None) -> dict[str, float | None]:
    """Parses ``args`` (default: the command line), trains, validates once more if needed, summarizes."""
    cli = GPTCLI(
        GPTLightningModule,
        GPTDataModule,
        args=args,
        run=False,
        seed_everything_default=1234,
        trainer_defaults=TRAINER_DEFAULTS,
        save_config_kwargs={"overwrite": True},
    )
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    # Rank 0's rate over the monitor's window, logged every log_every_n_steps; validate() clears it.
    per_rank = cli.trainer.logged_metrics.get("train/device/samples_per_sec")
    if "val_loss" not in cli.trainer.callback_metrics:
        cli.trainer.validate(cli.model, datamodule=cli.datamodule, verbose=False)
    return summarize(cli.trainer, cli.model, None if per_rank is None else float(per_rank))


if __name__ == "__main__":
    main()
