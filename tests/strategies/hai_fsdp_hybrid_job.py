"""One rank of a Trainer ``HYBRID_SHARD`` job as a user's two-node torchrun launch runs it (see
``test_hai_fsdp_torchrun.py``): ``python -m torch.distributed.run --nnodes 2 ... -m
tests.strategies.hai_fsdp_hybrid_job OUT``. Rank 0 writes the losses, the full state dict and the engines' group
sizes to ``OUT``."""

from __future__ import annotations

import os
import sys

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_haiscale.strategies import HaiFSDPStrategy
from tests.fsdp.helpers import deterministic_init
from tests.strategies.test_hai_fsdp_sharding import ROWS, STEPS, LitBlock, _Module, _tokens


def main(out: str) -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    tokens = _tokens(world)
    mine = TensorDataset(tokens[:, rank * ROWS : (rank + 1) * ROWS].flatten(0, 1))
    strategy = HaiFSDPStrategy(
        auto_wrap_policy={LitBlock},
        activation_checkpointing_policy={LitBlock},
        param_init_fn=deterministic_init,
        sharding_strategy="HYBRID_SHARD",
    )
    trainer = L.Trainer(
        strategy=strategy, accelerator="cpu", devices=2, num_nodes=2, max_steps=STEPS, precision="64-true",
        use_distributed_sampler=False, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False,
    )  # fmt: skip
    module = _Module("litgpt_style", by_hand=False)
    trainer.fit(module, DataLoader(mine, batch_size=ROWS))
    wrapper = trainer.strategy.model
    full = wrapper.full_state_dict()
    if rank == 0:
        groups = (wrapper.comm.world_size, wrapper.replicate_comm.world_size)
        torch.save({"losses": module.losses, "state": full, "groups": groups}, out)


if __name__ == "__main__":
    main(sys.argv[1])
