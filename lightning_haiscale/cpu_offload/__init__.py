"""CPU activation offload (haiscale's ``CPUOffload``): a chosen share of the activations saved for
backward lives in host memory between forward and backward, copied asynchronously both ways.

```python
with CPUOffload(offload_ratio=0.3, tag="MyModel"):
    out = model(x)
loss_fn(out, y).backward()
offload_stats("MyModel").achieved_ratio
```
"""

from lightning_haiscale.cpu_offload.pool import HostBuffer, PinnedBufferPool, default_pool
from lightning_haiscale.cpu_offload.region import CPUOffload
from lightning_haiscale.cpu_offload.selection import check_ratio, plan_offload
from lightning_haiscale.cpu_offload.stats import OffloadStats, offload_stats, reset_offload_stats

__all__ = [
    "CPUOffload",
    "HostBuffer",
    "OffloadStats",
    "PinnedBufferPool",
    "check_ratio",
    "default_pool",
    "offload_stats",
    "plan_offload",
    "reset_offload_stats",
]
