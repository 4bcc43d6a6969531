"""Data parallel on the hfreduce engine: haiscale's ``DistributedDataParallel``, a drop-in for torch's.

- ``distributed``: ``DistributedDataParallel``, the wrapper.
- ``reducer``: gradient buckets averaged while backward runs, large gradients reduced in place.
- ``buckets``: which gradients share a bucket (pure bookkeeping).
"""

from lightning_haiscale.ddp.buckets import Bucket, plan_buckets
from lightning_haiscale.ddp.distributed import DistributedDataParallel
from lightning_haiscale.ddp.reducer import Reducer

__all__ = ["Bucket", "DistributedDataParallel", "Reducer", "plan_buckets"]
