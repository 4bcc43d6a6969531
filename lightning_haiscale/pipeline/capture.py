"""Running unmodified step code around a pipeline: capture the network's inputs, replay its output.

[Note: capture and replay] A training step such as ``x, y = batch; out = self(x); loss = F(out, y)``
calls the network once. The pipeline puts ``StageProxy`` where the network was. On the first stage the
step runs once in *capture* mode: the network call raises ``InputsCaptured`` carrying its arguments, so
whatever the step does before the call (reading the batch, reshaping) decides the pipeline's input. On
the last stage the step runs once per microbatch in *replay* mode: the network call returns that
microbatch's pipeline output (with its autograd graph), so whatever the step does after the call (the
criterion, metrics, ``self.log``) is the loss function. The network must be called exactly once per
step, and the step must treat batch rows independently (microbatches are row slices of the batch).
"""

from __future__ import annotations

import contextlib
from collections.abc import Generator, Mapping, Sequence
from typing import Any

import torch

from lightning_haiscale.pipeline.partition import SequentialModel

__all__ = ["InputsCaptured", "StageProxy", "batch_rows", "split_batch"]

_IDLE, _CAPTURE, _REPLAY = range(3)


class InputsCaptured(Exception):
    """Raised by ``StageProxy`` in capture mode to stop the step at the network call."""

    def __init__(self, inputs: tuple[Any, ...]) -> None:
        super().__init__("pipeline input captured")
        self.inputs = inputs


class StageProxy(SequentialModel):
    """Holds this rank's layers (original names, so state dicts stay slices of the full network) and
    stands in for the network inside step code: it captures inputs or replays outputs, never computes."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self._mode = _IDLE
        self._output: Any = None
        self._calls = 0

    @contextlib.contextmanager
    def capturing(self) -> Generator[None, None, None]:
        with self._in_mode(_CAPTURE, None):
            yield

    @contextlib.contextmanager
    def replaying(self, output: Any) -> Generator[None, None, None]:
        with self._in_mode(_REPLAY, output):
            yield
            if self._calls != 1:
                raise RuntimeError(
                    f"the step called the pipelined network {self._calls} times; pipeline strategies support "
                    "steps that call it exactly once (out = self(x) or self.<network>(x))"
                )

    @contextlib.contextmanager
    def _in_mode(self, mode: int, output: Any) -> Generator[None, None, None]:
        self._mode, self._output, self._calls = mode, output, 0
        try:
            yield
        finally:
            self._mode, self._output = _IDLE, None

    def forward(self, *inputs: Any) -> Any:
        self._calls += 1
        if self._mode == _CAPTURE:
            raise InputsCaptured(inputs)
        if self._mode == _REPLAY:
            return self._output
        raise RuntimeError(
            "this network is split across pipeline stages; call it only inside the training, validation, test "
            "or predict step that the pipeline strategy runs"
        )


def batch_rows(batch: Any) -> int | None:
    """Dim 0 of the first tensor of at least one dimension in a (nested tuple/list/dict) batch; None: none."""
    if torch.is_tensor(batch):
        return batch.size(0) if batch.dim() else None
    items = batch.values() if isinstance(batch, Mapping) else batch
    if isinstance(batch, (Mapping, Sequence)) and not isinstance(batch, str):
        return next((n for n in map(batch_rows, items) if n is not None), None)
    return None


def split_batch(batch: Any, chunks: int, even: bool = True) -> list[Any]:
    """Splits every tensor in a (nested tuple/list/dict) batch along dim 0 into ``chunks`` microbatches."""
    if torch.is_tensor(batch):
        if batch.dim() == 0:
            return [batch] * chunks
        if even and batch.size(0) % chunks:
            raise ValueError(f"chunks={chunks} does not divide batch size {batch.size(0)}")
        return list(torch.tensor_split(batch, chunks))
    if isinstance(batch, Mapping):
        parts = {k: split_batch(v, chunks, even) for k, v in batch.items()}
        return [type(batch)({k: p[m] for k, p in parts.items()}) for m in range(chunks)]  # type: ignore[call-arg]
    if isinstance(batch, Sequence) and not isinstance(batch, str):
        columns = [split_batch(v, chunks, even) for v in batch]
        rows = [[c[m] for c in columns] for m in range(chunks)]
        return [type(batch)(*r) if hasattr(batch, "_fields") else type(batch)(r) for r in rows]
    return [batch] * chunks
