"""A user's two-node HYBRID_SHARD job, as ``torchrun --nnodes 2 --node-rank N ...`` starts it on each node:
trains the example model in float64 with SGD and writes rank 0's losses and full state dict to ``argv[1]``."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

from lightning_haiscale.fsdp import FullyShardedDataParallel
from tests.fsdp.test_sharding import train, wrap


def main(out: Path) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model: FullyShardedDataParallel = wrap("example", sharding_strategy="HYBRID_SHARD")
    losses = train("example", model, rank, world)
    groups = (model.comm.backend, model.comm.world_size, model.replicate_comm.backend, model.replicate_comm.num_hosts)
    full = model.full_state_dict()
    if rank == 0:
        torch.save({"losses": losses, "state": full, "groups": groups}, out)
    model.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
