"""One rank of the two-host tests, under torchrun on each host (see conftest.py). Writes ``<out>/<rank>.json``.

``fit <strategy>``: ``hai_ddp`` or ``hai_fsdp_hybrid`` (``HYBRID_SHARD``) trains the parity Classifier in
float64 (``precision="64-true"``); each rank records its engines' ranks and backends, rank 0 the weights.
``loop``: all-reduces through a Communicator until a collective fails, after writing ``ready<rank>``; the
rank records the error, when it started its Communicator and when the error was raised, then exits 1."""

from __future__ import annotations

import json
import os
import sys
import time
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


def loop(out: Path) -> None:
    from lightning_haiscale.hfreduce import Communicator

    timeout = timedelta(seconds=float(os.environ["JOB_TIMEOUT_S"]))
    dist.init_process_group("gloo", timeout=timeout)
    started, hosts = time.time(), None
    try:
        comm = Communicator(timeout=timeout)
        hosts = comm.num_hosts
        tensor = torch.ones(1 << 12)
        for _ in range(20):
            comm.all_reduce(tensor, op="avg")
        (out / f"ready{dist.get_rank()}").touch()
        while True:
            comm.all_reduce(tensor, op="avg")
    except Exception as error:
        message = f"{type(error).__name__}: {error}"
        _write(out, {"error": message, "at": time.time(), "started": started, "hosts": hosts})
        sys.exit(1)


if __name__ == "__main__":
    {"fit": fit, "loop": loop}[sys.argv[1]](Path(sys.argv[-1]), *sys.argv[2:-1])
