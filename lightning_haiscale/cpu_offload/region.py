"""``CPUOffload``: a region whose activations saved for backward partly live in host memory.

The region is the public face: its options, its tag's record and the saved-tensor hooks it installs for one
entry. Which saved bytes count is ``spans.py``'s rule ([Note: what a saved tensor becomes]); what happens to
the spans it offloads is ``run.py``'s ([Note: a span's life], [Note: memory bounds]). At ratio 0 the region
installs the counting run: the same rule, nothing copied ([Note: counting at ratio 0]).
"""

from __future__ import annotations

from types import TracebackType

import torch

from lightning_haiscale.cpu_offload.pool import PinnedBufferPool, default_pool
from lightning_haiscale.cpu_offload.run import CountingRun, OffloadRun, RunOptions
from lightning_haiscale.cpu_offload.selection import check_ratio
from lightning_haiscale.cpu_offload.stats import OffloadStats, RegionRecord, region_record

__all__ = ["CPUOffload"]

DEFAULT_MIN_BYTES = 1 << 20  # below 1 MiB a copy is latency, not bandwidth: keep those resident
DEFAULT_INFLIGHT_BYTES = 512 << 20
DEFAULT_PREFETCH_BYTES = 512 << 20


class CPUOffload:
    """Offloads ``offload_ratio`` of the bytes saved for backward inside the region to host memory.

    >>> with CPUOffload(offload_ratio=0.3, tag="MyModel"):
    ...     out = model(x)
    >>> loss_fn(out, y).backward()

    The first entry of a ``tag`` measures the region (offloading with an online rule meanwhile); later
    entries follow a plan made from the previous entry's measurement: as close to the ratio as tensor
    sizes allow, favoring the tensors saved first. Without a tag, the measurement lives in this
    object, so reuse one object across steps. Statistics: ``offload_stats(tag)`` or ``.stats()``.

    Args:
        offload_ratio: fraction in [0, 1] of the saved bytes to move to host memory.
        tag: names the region; its measurement and statistics persist across entries and objects.
        min_bytes: tensors smaller than this stay resident (they still count as saved bytes).
        max_inflight_bytes: device bytes allowed to wait for their copy out before compute waits.
        prefetch_bytes: how far copies back may run ahead of backward's use.
        force_copy: also offload CPU tensors (copied to host buffers and back); by default CPU tensors
            are left alone. Meant for testing the mechanism without a GPU.
        pool: host buffers to use (default: the process-wide ``default_pool()``).
    """

    def __init__(
        self,
        offload_ratio: float,
        tag: str | None = None,
        *,
        min_bytes: int = DEFAULT_MIN_BYTES,
        max_inflight_bytes: int = DEFAULT_INFLIGHT_BYTES,
        prefetch_bytes: int = DEFAULT_PREFETCH_BYTES,
        force_copy: bool = False,
        pool: PinnedBufferPool | None = None,
    ) -> None:
        sizes = (min_bytes, max_inflight_bytes, prefetch_bytes)
        if not (type(min_bytes) is type(max_inflight_bytes) is type(prefetch_bytes) is int and min(sizes) >= 0):
            names = ("min_bytes", "max_inflight_bytes", "prefetch_bytes")
            for name, value in zip(names, sizes, strict=True):  # a region is built every step: checked fast first
                if not isinstance(value, int) or value < 0:
                    raise ValueError(f"{name}={value!r} must be an int >= 0 (bytes)")
        self.offload_ratio = check_ratio(offload_ratio)
        self.tag = tag
        pool = pool if pool is not None else default_pool()
        self._options = RunOptions(self.offload_ratio, min_bytes, max_inflight_bytes, prefetch_bytes, force_copy, pool)
        self._record = region_record(tag) if tag is not None else RegionRecord(None)
        self._run: OffloadRun | CountingRun | None = None
        self._hooks: torch.autograd.graph.saved_tensors_hooks | None = None

    def __enter__(self) -> CPUOffload:
        if self._record.active:
            raise RuntimeError(
                f"CPUOffload region tag={self.tag!r} is already active; nested regions need distinct tags"
            )
        ratio_0 = self.offload_ratio == 0
        self._run = CountingRun(self._options) if ratio_0 else OffloadRun(self._options, self._record)
        self._hooks = torch.autograd.graph.saved_tensors_hooks(*self._run.hooks())
        self._hooks.__enter__()
        self._record.active = True
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._hooks is None or self._run is None:
            raise RuntimeError("CPUOffload.__exit__ without a matching __enter__")
        hooks, run = self._hooks, self._run
        self._hooks = self._run = None
        hooks.__exit__(exc_type, exc, tb)
        self._record.active = False
        run.finish(self._record)

    @property
    def active(self) -> bool:
        """Whether the region's hooks are installed."""
        return self._hooks is not None

    def stats(self) -> OffloadStats:
        """This region's statistics (the same as ``offload_stats(tag)`` for a tagged region)."""
        return self._record.snapshot()

    def __repr__(self) -> str:
        return f"CPUOffload(offload_ratio={self.offload_ratio}, tag={self.tag!r})"
