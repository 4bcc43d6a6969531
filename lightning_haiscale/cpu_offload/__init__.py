"""CPU activation offload (haiscale's ``CPUOffload``): a chosen share of the activations saved for
backward lives in host memory between forward and backward, copied asynchronously both ways.

```python
with CPUOffload(offload_ratio=0.3, tag="MyModel"):
    out = model(x)
loss_fn(out, y).backward()
offload_stats("MyModel").achieved_ratio
```

- ``region``: ``CPUOffload``, the public face: options, the tag's record, the hooks of one entry.
- ``spans``: which saved bytes count, the one rule shared by every ratio.
- ``run``: one entry's copies and each span's ``SpanState``.
- ``selection``: which spans to offload (pure logic over sizes).
- ``pool``: reused host buffers, pinned up to a cap.
- ``transfer``: copies between device and host, on side streams.
- ``stats``: per-region statistics (``offload_stats``).
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
