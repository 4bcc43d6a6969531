"""haiscale-style sharded data parallel: ``torchrun --nproc-per-node 2 -m examples.plain.fsdp``."""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from examples.plain.common import init, toy_batch, toy_model
from lightning_haiscale.fsdp import BackwardPrefetch, FullyShardedDataParallel

rank, world, device = init()
model = FullyShardedDataParallel(
    toy_model().to(device), auto_wrap_policy={nn.Linear}, backward_prefetch=BackwardPrefetch.BACKWARD_POST
)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)  # after wrapping: sees this rank's shards
for step in range(50):
    x, y = (t.to(device) for t in toy_batch(rank, step))
    loss = F.mse_loss(model(x), y)
    loss.backward()  # gradients reduce-scattered into the shards
    optimizer.step()
    optimizer.zero_grad()
    if rank == 0 and step % 10 == 0:
        print(f"step {step}: loss {loss.item():.4f}")
with model.summon_full_params():  # full parameters only inside this block, where state_dict() is local
    if rank == 0:  # haiscale's save snippet: one rank calls it (torch.save(model.state_dict(), path))
        state = model.state_dict()
        print(f"full state dict: {sum(v.numel() for v in state.values())} values")
dist.destroy_process_group()
