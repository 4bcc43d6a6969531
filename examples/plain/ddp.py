"""haiscale-style data parallel: ``torchrun --nproc-per-node 2 -m examples.plain.ddp``."""

import torch
import torch.distributed as dist
import torch.nn.functional as F

from examples.plain.common import init, toy_batch, toy_model
from lightning_haiscale.ddp import DistributedDataParallel

rank, world, device = init()
model = DistributedDataParallel(toy_model().to(device))  # parameters broadcast from rank 0
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
for step in range(50):
    x, y = (t.to(device) for t in toy_batch(rank, 2 * step))
    with model.no_sync():  # gradient accumulation: no communication
        F.mse_loss(model(x), y).backward()
    x, y = (t.to(device) for t in toy_batch(rank, 2 * step + 1))
    loss = F.mse_loss(model(x), y)
    loss.backward()  # averaged across ranks while backward runs
    optimizer.step()
    optimizer.zero_grad()
    if rank == 0 and step % 10 == 0:
        print(f"step {step}: loss {loss.item():.4f}")
model.reducer.stop()
dist.destroy_process_group()
