"""Every strategy and ``CPUOffloadCallback`` configured through LightningCLI, as users do it: by registered name,
by ``class_path`` + ``init_args`` on the command line and in a YAML file; ``--help`` lists each one's arguments.

Every strategy is built from every form (no fit). The fits run 2 optimizer steps of a tiny MLP: on 1 process
every strategy in all three forms; on 2 processes (expensive on this 2-core machine) every strategy once,
the forms taking turns.
"""

from __future__ import annotations

import contextlib
import io
import re
import sys
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.cli import LightningCLI
from torch.utils.data import DataLoader, TensorDataset

import lightning_haiscale
from examples.plain.common import toy_model
from tests.distributed import run_distributed

WIDTH = 8


class _Model(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = toy_model(WIDTH)  # 9 layers: enough for 2 stages of 2 model chunks

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class _Data(L.LightningDataModule):
    def train_dataloader(self) -> DataLoader:
        x = torch.randn(32, WIDTH, generator=torch.Generator().manual_seed(0))
        return DataLoader(TensorDataset(x, x[:, :1]), batch_size=4)


# name -> (class path, init_args given in the class_path forms, the attribute and value that prove they arrived)
STRATEGIES: dict[str, tuple[str, dict[str, Any], tuple[str, Any]]] = {  # in this order the 2-process forms rotate
    "hai_ddp": ("lightning_haiscale.HaiDDPStrategy", {"bucket_cap_mb": 50}, ("_hai_kwargs", {"bucket_cap_mb": 50})),
    "hai_pipedream": ("lightning_haiscale.PipeDreamStrategy", {"chunks": 2, "balance": "time"}, ("balance", "time")),
    "hai_fsdp": ("lightning_haiscale.HaiFSDPStrategy", {"state_dict_type": "sharded"}, ("state_dict_type", "sharded")),
    "hai_gpipe": (
        "lightning_haiscale.GPipeStrategy",
        {"chunks": 2, "data_parallel": "fsdp", "sharding_strategy": "SHARD_GRAD_OP"},  # PP x FSDP
        ("data_parallel", "fsdp"),
    ),
    "hai_interleaved_1f1b": ("lightning_haiscale.Interleaved1F1BStrategy", {"chunks": 2}, ("chunks", 2)),
}
FORMS = ("name", "command_line", "yaml")
_TRAINER_ARGS = [
    "--trainer.accelerator=cpu",
    "--trainer.max_steps=2",
    "--trainer.logger=false",
    "--trainer.enable_checkpointing=false",
    "--trainer.enable_progress_bar=false",
    "--trainer.enable_model_summary=false",
    "--trainer.limit_val_batches=0",
    "--trainer.num_sanity_val_steps=0",
]


def _strategy_args(name: str, form: str, folder: Path) -> list[str]:
    class_path, init_args, _ = STRATEGIES[name]
    if form == "name":  # a registered name takes no init_args: pipelines' default chunks=4 divides the batch of 4
        return [f"--trainer.strategy={name}"]
    if form == "command_line":
        return [f"--trainer.strategy={class_path}", *(f"--trainer.strategy.{k}={v}" for k, v in init_args.items())]
    config = folder / f"{name}.yaml"
    lines = ["trainer:", "  strategy:", f"    class_path: {class_path}", "    init_args:"]
    lines += [f"      {k}: {v}" for k, v in init_args.items()]
    lines += ["  callbacks:", "    - class_path: lightning_haiscale.CPUOffloadCallback"]
    lines += ["      init_args: {offload_ratio: 0.5, force_copy: true}"]
    config.write_text("\n".join(lines) + "\n")
    return [f"--config={config}"]


def _cli(name: str, form: str, world: int, folder: Path, run: bool = True) -> LightningCLI:
    """One LightningCLI (``fit`` when ``run``); checks the strategy and callback it built."""
    args = ["fit"] if run else []
    args += [*_TRAINER_ARGS, f"--trainer.devices={world}", f"--trainer.default_root_dir={folder}"]
    args += _strategy_args(name, form, folder)
    if form == "command_line":
        args += ["--trainer.callbacks+=lightning_haiscale.CPUOffloadCallback", "--trainer.callbacks.offload_ratio=0.5"]
        args += ["--trainer.callbacks.force_copy=true"]
    cli = LightningCLI(_Model, _Data, args=args, save_config_callback=None, run=run)
    strategy = cli.trainer.strategy
    class_path, _, (attribute, value) = STRATEGIES[name]
    assert type(strategy).__name__ == class_path.rsplit(".", 1)[1], (name, form, type(strategy))
    assert strategy.strategy_name == name
    if form != "name":
        got = getattr(strategy, attribute)
        assert (got.items() >= value.items()) if isinstance(value, dict) else got == value, (name, form, got)
    offload = [c for c in cli.trainer.callbacks if isinstance(c, lightning_haiscale.CPUOffloadCallback)]
    assert len(offload) == (0 if form == "name" else 1) and all(c.offload_ratio == 0.5 for c in offload)
    return cli


def _fit_all(rank: int, world: int, folder: str, runs: list[tuple[str, str]]) -> list[int]:
    sys.argv = ["train.py"]  # the worker's own argv is pytest's
    for name, form in runs:
        Path(folder, f"{name}-{form}").mkdir(exist_ok=True)
    return [_cli(name, form, world, Path(folder, f"{name}-{form}")).trainer.global_step for name, form in runs]


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_every_form_builds_the_strategy(name: str, form: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "argv", ["train.py"])
    _cli(name, form, 2, tmp_path, run=False)


def test_every_strategy_trains_on_one_process(tmp_path: Path) -> None:
    """Interleaved 1F1B needs 2 pipeline ranks (it says so): it trains on 2 processes only."""
    runs = [(name, form) for name in STRATEGIES for form in FORMS if name != "hai_interleaved_1f1b"]
    assert run_distributed(_fit_all, 1, str(tmp_path), runs, timeout=300)[0] == [2] * len(runs)


def test_every_strategy_trains_on_two_processes(tmp_path: Path) -> None:
    runs = [(name, FORMS[i % len(FORMS)]) for i, name in enumerate(STRATEGIES)]
    steps = run_distributed(_fit_all, 2, str(tmp_path), runs, timeout=300)
    assert steps == [[2] * len(runs)] * 2


_COMMON = {"accelerator", "parallel_devices", "cluster_environment", "checkpoint_io", "precision_plugin"}
_HAI_PARALLEL = {*_COMMON, "timeout", "process_group_backend"}
_PIPELINE = {*_HAI_PARALLEL, "chunks", "pp_size", "balance", "num_model_chunks", "checkpoint", "module_name"}
_PIPELINE.add("split_points")
_PIPELINE.update(
    {"data_parallel", "sharding_strategy", "auto_wrap_policy", "activation_checkpointing_policy", "device_mesh"}
)
HELP: dict[str, set[str]] = {
    "lightning_haiscale.HaiDDPStrategy": {
        *_COMMON,
        *("ddp_comm_state", "ddp_comm_hook", "ddp_comm_wrapper", "model_averaging_period"),  # None only
        *("process_group_backend", "timeout", "start_method"),
        *("bucket_cap_mb", "find_unused_parameters", "broadcast_buffers"),
    },
    "lightning_haiscale.HaiFSDPStrategy": {
        *_HAI_PARALLEL,
        *("backward_prefetch", "reshard_after_forward", "param_init_fn"),
        *("cpu_offload", "mixed_precision", "auto_wrap_policy", "activation_checkpointing"),
        *("activation_checkpointing_policy", "sharding_strategy", "state_dict_type", "device_mesh"),
        *("limit_all_gathers", "forward_prefetch", "use_orig_params", "sync_module_states", "ignored_modules"),
    },
    "lightning_haiscale.GPipeStrategy": {*_PIPELINE, "example_inputs"},
    "lightning_haiscale.PipeDreamStrategy": {*_PIPELINE, "example_inputs"},
    "lightning_haiscale.Interleaved1F1BStrategy": {*_PIPELINE, "example_inputs"},
}


def _help_arguments(group: str, class_path: str) -> set[str]:
    """The arguments ``--trainer.<group>.help <class_path>`` documents (one option line each)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        LightningCLI(_Model, _Data, args=[f"--trainer.{group}.help", class_path], run=False)
    option = re.compile(rf"^\s+--trainer\.{group}\.(\w+)(?!\.help)\b", re.MULTILINE)
    return {name for name in option.findall(out.getvalue()) if name != "help"}


@pytest.mark.parametrize("class_path", sorted(HELP))
def test_help_lists_exactly_the_strategy_arguments(class_path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "argv", ["train.py"])
    assert _help_arguments("strategy", class_path) == HELP[class_path]


def test_help_lists_exactly_the_callback_arguments(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "argv", ["train.py"])
    expected = {"offload_ratio", "tag", "min_bytes", "max_inflight_bytes", "prefetch_bytes", "force_copy", "pool"}
    assert _help_arguments("callbacks", "lightning_haiscale.CPUOffloadCallback") == expected
