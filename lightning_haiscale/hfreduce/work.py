"""The handle of an asynchronous collective."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from datetime import timedelta
from typing import Any

import torch

from lightning_haiscale.hfreduce.errors import HFReduceTimeoutError


def seconds(timeout: float | timedelta | None) -> float | None:
    return timeout.total_seconds() if isinstance(timeout, timedelta) else timeout


class Work:
    """Handle of an asynchronous collective, like ``torch.distributed``'s ``Work``.

    It follows either a collective queued on the engine's worker thread (``native``, whose failure
    ``raise_if_failed`` turns into an exception) or a job on the communicator's thread (``future``, whose
    result is a callable to run once it is done, or None).
    """

    def __init__(
        self,
        native: Any = None,
        raise_if_failed: Callable[[Any], None] | None = None,
        future: Future | None = None,
        keepalive: tuple[torch.Tensor, ...] = (),
    ) -> None:
        self._native = native
        self._raise_if_failed = raise_if_failed
        self._future = future
        self._keepalive = keepalive  # tensors the engine reads or writes until completion

    def is_completed(self) -> bool:
        if self._native is not None:
            return self._native.is_completed()
        return self._future is None or self._future.done()

    def wait(self, timeout: float | timedelta | None = None) -> bool:
        """Blocks until the collective is done; raises its error if it failed.

        Args:
            timeout: seconds (or a timedelta) to wait here; the engine's own deadline applies anyway.
        """
        limit = seconds(timeout)
        if self._native is not None:
            if not self._native.wait(-1.0 if limit is None else limit):
                raise HFReduceTimeoutError(f"hfreduce: collective not completed within {limit} s", [])
            if self._raise_if_failed is not None:
                self._raise_if_failed(self._native)
        elif self._future is not None:
            try:
                after = self._future.result(timeout=limit)
            except FutureTimeout:
                raise HFReduceTimeoutError(f"hfreduce: collective not completed within {limit} s", []) from None
            if after is not None:
                after()
        self._keepalive = ()
        return True
