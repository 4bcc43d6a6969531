"""What every algorithm behind a :class:`~lightning_haiscale.hfreduce.Communicator` provides.

[Note: backends]
The communicator chooses one backend at construction, from the topology and /dev/shm:
- ``shm`` (:mod:`.shm`): every rank on one host; collectives run in the native engine's shared memory.
- ``hierarchical`` (:mod:`.hierarchical`): several hosts; shared memory within each host, torch's gloo
  between the ranks with the same local index on different hosts.
- ``torch.distributed`` (:mod:`.fallback`): /dev/shm too small and ``allow_fallback=True``.
Arguments reach a backend already checked. Its collectives run to completion on the calling thread and
raise their error: the communicator calls them on its job thread, or, for a backend that can queue work
on the engine's own thread (``queues_on_engine``), directly from the caller.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import ClassVar

import torch


class Backend(ABC):
    """One way of running the collectives; see [Note: backends]."""

    name: ClassVar[str]
    """What :attr:`Communicator.backend` reports."""
    queues_on_engine: ClassVar[bool] = False
    """Whether CPU collectives take ``blocking=False`` and return the engine's handle (see :mod:`.shm`)."""
    reads_device_tensors: ClassVar[bool] = False
    """Whether CUDA tensors go to the backend as they are (else they are staged in host memory)."""

    @abstractmethod
    def all_reduce(self, tensor: torch.Tensor, divisor: float) -> object: ...

    @abstractmethod
    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, divisor: float) -> object: ...

    @abstractmethod
    def all_gather(self, output: torch.Tensor, input: torch.Tensor) -> object: ...

    @abstractmethod
    def broadcast(self, tensor: torch.Tensor, src: int) -> object:
        """``src`` is a rank of the communicator's group."""

    @abstractmethod
    def barrier(self) -> object: ...

    def alloc_buffer(self, numel: int, dtype: torch.dtype, barrier: Callable[[], None]) -> torch.Tensor:
        """A zero-filled CPU tensor; in shared memory where the backend has some. ``barrier`` is the
        communicator's, ordered with its other collectives."""
        return torch.zeros(numel, dtype=dtype)

    @abstractmethod
    def close(self) -> None:
        """Stops the backend's threads once its queued work is done. Idempotent."""
