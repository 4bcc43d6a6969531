"""The job's store: the default process group's store (the rendezvous store), which every rank of the job reaches.

The engine's abort record (``abort``) and a pipeline stage's own error (pipeline ``executor``) are posted there.
torch has no public getter for it: :func:`job_store` is the package's one call of the private one.
"""

from __future__ import annotations

import torch.distributed as dist

__all__ = ["job_store"]


def job_store() -> dist.Store:
    """The default process group's store (``RuntimeError`` when its host is gone, on use)."""
    return dist.distributed_c10d._get_default_store()
