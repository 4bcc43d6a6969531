"""The hfreduce-style collective engine: shared-memory, SIMD, asynchronous, hierarchical across hosts.

- ``communicator``: ``Communicator``, which checks each call and hands it to the backend chosen at construction.
- ``backend``: what every backend provides, and how the communicator chooses one.
- ``shm_backend``: the one-host backend, in the native engine's shared memory.
- ``hierarchical``: the several-hosts backend: shared memory within each host, gloo between hosts.
- ``torch_backend``: the fallback backend, plain ``torch.distributed`` when ``/dev/shm`` cannot hold the engine.
- ``topology``: which ranks share a host (probe files in ``/dev/shm``, ``HFREDUCE_NODE_ID``).
- ``cuda_staging``: CUDA tensors staged through host memory.
- ``segments``: ``/dev/shm`` sizing, and one segment for all local ranks.
- ``work``: ``Work``, the handle of an asynchronous collective.
- ``dtypes``: the dtypes the engine reduces, read from its ``DType`` enum.
- ``errors``: the engine's errors.
- ``abort``: ``abort_job``: one failing rank ends every rank's collectives.
- ``liveness``: heartbeats through the store, so a silent host is named.
- ``job_store``: the job's store (the default group's), where aborts and a stage's error are posted.
- ``at_exit``: what the library started, ended before the interpreter finalizes.
- ``kept_collectives``: torch.distributed's blocking collectives, each work kept to exit.
- ``_native``: loads the native ``lightning_haiscale._C`` on first use.
"""

from lightning_haiscale.hfreduce._native import engine_cpu_seconds, simd_level
from lightning_haiscale.hfreduce.abort import abort_job
from lightning_haiscale.hfreduce.communicator import Communicator, ReduceOp
from lightning_haiscale.hfreduce.dtypes import supports_dtype
from lightning_haiscale.hfreduce.errors import (
    HFReduceAbortedError,
    HFReduceError,
    HFReduceMismatchError,
    HFReducePeerError,
    HFReduceTimeoutError,
    SharedMemoryTooSmallError,
)
from lightning_haiscale.hfreduce.topology import NODE_ID_ENV
from lightning_haiscale.hfreduce.work import Work

__all__ = [
    "NODE_ID_ENV",
    "Communicator",
    "HFReduceAbortedError",
    "HFReduceError",
    "HFReduceMismatchError",
    "HFReducePeerError",
    "HFReduceTimeoutError",
    "ReduceOp",
    "SharedMemoryTooSmallError",
    "Work",
    "abort_job",
    "engine_cpu_seconds",
    "simd_level",
    "supports_dtype",
]
