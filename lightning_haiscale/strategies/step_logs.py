"""Logging from a pipelined step: ``self.log`` calls recorded per microbatch, logged once on every stage.

The last stage replays the step once per microbatch; what it logs is averaged over the microbatches
(weighted by their rows when a batch splits unevenly), broadcast over the pipeline and logged by every
stage, so rank 0's progress bar and loggers see the last stage's values.
"""

from __future__ import annotations

import contextlib
from collections.abc import Generator, Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn

__all__ = ["LogRecorder", "ignore_log", "patched"]


class LogRecorder:
    """Collects a step's ``self.log`` calls per microbatch, to log them once, averaged, on every stage."""

    def __init__(self, weights: Sequence[float] | None = None) -> None:
        self.weights = weights  # per microbatch (uneven splits); None: all equal
        self.calls: dict[str, tuple[list[tuple[float, Any]], dict[str, Any]]] = {}
        self.module: nn.Module | None = None

    @contextlib.contextmanager
    def recording(self, module: pl.LightningModule, microbatch: int) -> Generator[None, None, None]:
        self.module = module

        def record(name: str, value: Any, *args: Any, **kwargs: Any) -> None:
            if args:
                raise TypeError("pipeline strategies need self.log's options as keywords (self.log(name, value, k=v))")
            values, _ = self.calls.setdefault(name, ([], kwargs))
            values.append((1.0 if self.weights is None else self.weights[microbatch], value))

        with patched(module, "log", record):
            yield

    def summary(self) -> list[tuple[str, str, Any, dict[str, Any]]]:
        """``(name, "metric", attribute path, kwargs)`` or ``(name, "value", mean as float, kwargs)``."""
        out = []
        for name, (values, kwargs) in self.calls.items():
            first = values[0][1]
            if isinstance(first, nn.Module):
                path = next((p for p, m in self.module.named_modules() if m is first), None)
                if path is None:
                    raise ValueError(f"self.log({name!r}, metric): the metric must be an attribute of the module")
                out.append((name, "metric", path, kwargs))
            else:
                total = sum(w * float(torch.as_tensor(v).detach().float().mean()) for w, v in values)
                out.append((name, "value", total / sum(w for w, _ in values), kwargs))
        return out


@contextlib.contextmanager
def patched(obj: Any, name: str, value: Any) -> Generator[None, None, None]:
    """``obj.name`` is ``value`` inside (an instance attribute shadowing the method), as before outside."""
    obj.__dict__[name] = value
    try:
        yield
    finally:
        obj.__dict__.pop(name, None)


def ignore_log(*args: Any, **kwargs: Any) -> None:
    """Stands in for ``self.log`` while the first stage runs a step only to capture the network's inputs."""
