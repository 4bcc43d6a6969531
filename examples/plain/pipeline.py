"""haiscale-style pipeline parallel: ``torchrun --nproc-per-node 2 -m examples.plain.pipeline``."""

import torch
import torch.distributed as dist
import torch.nn.functional as F

from examples.plain.common import init, toy_batch, toy_model
from lightning_haiscale.pipeline import PipeDream, partition

rank, world, device = init()
stage = partition(toy_model(), rank, world).to(device)  # this rank's layers, balanced by parameters
chunks = 4
model = PipeDream(stage, chunks)  # 1F1B: stages - rank - 1 warm-up forwards, then alternation
optimizer = torch.optim.AdamW(stage.parameters(), lr=1e-3)
for step in range(50):
    x, y = (t.to(device) for t in toy_batch(0, step))  # every stage sees the same batch
    # each microbatch's loss is backpropagated as it is (haiscale): divide by chunks for the batch mean's gradient
    losses, _ = model.forward_backward(x, criterion=lambda out, y: F.mse_loss(out, y) / chunks, labels=(y,))
    optimizer.step()
    optimizer.zero_grad()
    if losses is not None and step % 10 == 0:  # only the last stage has the losses
        print(f"step {step}: loss {losses.sum().item():.4f}")
with torch.no_grad():
    out = model(toy_batch(0, 0)[0].to(device))  # pipelined evaluation; the output is on the last stage
dist.destroy_process_group()
