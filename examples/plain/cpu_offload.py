"""Activation offload: ``python -m examples.plain.cpu_offload`` (one process; the copies pay off on a GPU)."""

import torch
import torch.nn.functional as F

from examples.plain.common import toy_batch, toy_model
from lightning_haiscale.cpu_offload import CPUOffload, offload_stats

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
model = toy_model(width=512).to(device)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
for step in range(5):
    x, y = (t.to(device) for t in toy_batch(0, step, width=512))
    # 30% of the bytes saved for backward go to host memory; on CPU force_copy exercises the same path.
    with CPUOffload(offload_ratio=0.3, tag="toy", min_bytes=0, force_copy=device.type == "cpu"):
        out = model(x)
    F.mse_loss(out, y).backward()  # copies back are prefetched ahead of use
    optimizer.step()
    optimizer.zero_grad()
print(offload_stats("toy"))
