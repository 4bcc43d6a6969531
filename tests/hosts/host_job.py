"""One rank of the two-host tests, under torchrun on each host (see conftest.py). Writes ``<out>/<rank>.json``.

``fit <strategy>``: ``hai_ddp`` or ``hai_fsdp_hybrid`` (``HYBRID_SHARD``) trains the parity Classifier in
float64 (``precision="64-true"``); each rank records its engines' ranks and backends, rank 0 the weights.
``loop [engine|barrier]``: all-reduces through a Communicator (or calls ``dist.barrier()`` beside one) until
it fails, after writing ``ready<rank>``; the rank records the error, when it started its Communicator and
when the error was raised, then exits 1."""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist


def _write(out: Path, record: dict) -> None:
    (out / f"{os.environ['RANK']}.json").write_text(json.dumps(record))


def fit(out: Path, strategy: str) -> None:
    import lightning as L
    from torch.utils.data import DataLoader

    from lightning_haiscale import HaiFSDPStrategy
    from lightning_haiscale.testing.parity import BATCH, STEPS, Classifier, data

    class Record(L.Callback):
        def on_train_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
            model = trainer.strategy.model
            engines = [model.reducer.comm] if strategy == "hai_ddp" else [model.comm, model.replicate_comm]
            self.seen = [[dist.get_process_group_ranks(c.group), c.backend] for c in engines]

    record = Record()
    chosen = HaiFSDPStrategy(sharding_strategy="HYBRID_SHARD") if strategy == "hai_fsdp_hybrid" else strategy
    trainer = L.Trainer(
        strategy=chosen, accelerator="cpu", devices=2, num_nodes=2, precision="64-true", max_steps=STEPS,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        limit_val_batches=0, num_sanity_val_steps=0, callbacks=[record],
    )  # fmt: skip
    trainer.fit(Classifier(), DataLoader(data(BATCH * STEPS * 4), batch_size=BATCH, shuffle=True))
    state = trainer.strategy.lightning_module_state_dict()  # a collective; rank 0 holds the whole model
    weights = {k: v.tolist() for k, v in state.items()} if trainer.global_rank == 0 else None
    _write(out, {"engines": record.seen, "weights": weights})


def loop(out: Path, phase: str = "engine") -> None:
    from lightning_haiscale.hfreduce import Communicator

    timeout = timedelta(seconds=float(os.environ["JOB_TIMEOUT_S"]))
    dist.init_process_group("gloo", timeout=timeout)
    started, hosts = time.time(), None
    try:
        if phase == "pipeline":  # stage-to-stage transfers only: no engine (a pipeline spanning the hosts)
            step, hosts = _pipeline_step()
        else:
            comm = Communicator(timeout=timeout)
            hosts = comm.num_hosts
            tensor = torch.ones(1 << 12)
            step = lambda: comm.all_reduce(tensor, op="avg") if phase == "engine" else dist.barrier()  # noqa: E731
        for _ in range(20):
            step() if phase == "pipeline" else comm.all_reduce(tensor, op="avg")
        (out / f"ready{dist.get_rank()}").touch()
        while True:  # a collective of the engine, a wait outside it (a checkpoint's barrier), or a pipeline's
            step()
    except Exception as error:
        message = f"{type(error).__name__}: {error}"
        _write(out, {"error": message, "at": time.time(), "started": started, "hosts": hosts})
        sys.exit(1)


def _pipeline_step() -> tuple[Callable[[], object], int]:
    """One PipeDream step over the world (stages 0-1 on one host, 2-3 on the other), and the hosts it spans."""
    import torch.nn.functional as F
    from torch import nn

    from lightning_haiscale.pipeline import PipeDream, partition

    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(16, 16) for _ in range(4)))
    pipe = PipeDream(partition(model, dist.get_rank(), dist.get_world_size()), chunks=4)
    x, y = torch.randn(8, 16), torch.randn(8, 16)
    criterion = lambda out, target: F.mse_loss(out, target) / 4  # noqa: E731
    return (lambda: pipe.forward_backward(x, criterion=criterion, labels=(y,))), 1 + bool(pipe.hosts.peers)


if __name__ == "__main__":
    {"fit": fit, "loop": loop}[sys.argv[1]](Path(sys.argv[-1]), *sys.argv[2:-1])
