"""A pipeline inside a Fabric script: ``python -m examples.fabric.pipeline`` (2 CPU processes, 2 stages).

Lightning has no Fabric strategy for pipelines: Fabric starts the processes and the process group, and
the plain ``lightning_haiscale.pipeline`` API does the rest (the model is not passed to ``fabric.setup``).
"""

import torch
import torch.nn.functional as F
from lightning.fabric import Fabric

from examples.plain.common import toy_batch, toy_model
from lightning_haiscale.pipeline import PipeDream, partition

if __name__ == "__main__":
    fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp")
    fabric.launch()  # processes and the process group
    stage = partition(toy_model(), fabric.global_rank, fabric.world_size).to(fabric.device)  # this rank's layers
    chunks = 4
    model = PipeDream(stage, chunks)
    optimizer = torch.optim.SGD(stage.parameters(), lr=0.01)
    for step in range(20):
        x, y = (fabric.to_device(t) for t in toy_batch(0, step))  # every stage sees the same batch
        losses, _ = model.forward_backward(x, criterion=lambda out, y: F.mse_loss(out, y) / chunks, labels=(y,))
        optimizer.step()
        optimizer.zero_grad()
    last = torch.tensor(float(losses.sum()) if losses is not None else 0.0)  # only the last stage has losses
    fabric.print(f"final loss {float(fabric.all_reduce(last, reduce_op='sum')):.4f}")  # printed by rank 0
    # gloo's worker thread may still hold the all-reduce's tensors; one that frees them while Python finalizes
    # aborts the process ("terminate called without an active exception"): end the group, which joins it, first
    torch.distributed.destroy_process_group()
