"""The hfreduce-style collective engine: shared-memory, SIMD, asynchronous, hierarchical across hosts."""

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
