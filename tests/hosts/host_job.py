"""One rank of the two-host tests, under torchrun on each host (see hosts.py). Writes ``<out>/<rank>.json``.

``fit``: ``hai_ddp`` trains the parity Classifier in float64 (``precision="64-true"``); each rank records the
hosts its engine saw, rank 0 the weights. ``loop``: all-reduces through a Communicator until a collective
fails, after writing ``ready<rank>``; the rank records the error, when it started its Communicator and when the
error was raised, then exits 1.
"""

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


def fit(out: Path) -> None:
    import lightning as L
    from torch.utils.data import DataLoader

    from lightning_haiscale.testing.parity import BATCH, STEPS, Classifier, data

    class Record(L.Callback):
        def on_train_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
            comm = trainer.strategy.model.reducer.comm
            self.seen = {"hosts": [list(h) for h in comm.topology.hosts], "backend": comm.backend}

    record = Record()
    trainer = L.Trainer(
        strategy="hai_ddp", accelerator="cpu", devices=2, num_nodes=2, precision="64-true", max_steps=STEPS,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        limit_val_batches=0, num_sanity_val_steps=0, callbacks=[record],
    )  # fmt: skip
    model = Classifier()
    trainer.fit(model, DataLoader(data(BATCH * STEPS * 4), batch_size=BATCH, shuffle=True))
    weights = {k: v.tolist() for k, v in model.state_dict().items()} if trainer.global_rank == 0 else None
    _write(out, {**record.seen, "weights": weights})


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
    {"fit": fit, "loop": loop}[sys.argv[1]](Path(sys.argv[2]))
