"""The pipeline strategies' arguments: each one's type and range, and the pairs that cannot go together."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lightning_haiscale.adapter.arguments import check_choice, check_int
from lightning_haiscale.pipeline.schedule import check_chunks

__all__ = ["check_pipeline_arguments"]


def check_pipeline_arguments(
    name: str,
    interleaved: bool,
    gpipe: bool,
    *,
    chunks: Any,
    pp_size: Any,
    balance: Any,
    num_model_chunks: Any,
    checkpoint: Any,
    module_name: Any,
    example_inputs: Any,
    split_points: Any,
) -> None:
    """Raises before anything starts, naming the argument and the fix (``name``: the strategy's class)."""
    if pp_size is not None:
        check_int("pp_size", pp_size, 1, "stages per pipeline, or pp_size=None for one pipeline over the world")
    check_chunks(chunks, pp_size, interleaved)
    check_int("num_model_chunks", num_model_chunks, 1)
    if num_model_chunks != 1 and not interleaved:
        raise ValueError(
            f"num_model_chunks={num_model_chunks}: {name} runs one model chunk per rank; use "
            "Interleaved1F1BStrategy for several"
        )
    check_choice("checkpoint", checkpoint, ("never", "always", "except_last"))
    if checkpoint != "never" and not gpipe:
        raise ValueError(f"checkpoint={checkpoint!r} is GPipe's activation checkpointing; use GPipeStrategy")
    _check_balance(balance, None if pp_size is None else pp_size * num_model_chunks)
    if module_name is not None and not isinstance(module_name, str):
        raise TypeError(f"module_name={module_name!r} must be the name of the module's network attribute")
    if example_inputs is not None and not isinstance(example_inputs, tuple):
        raise TypeError(f"example_inputs={example_inputs!r} must be a tuple of the network's inputs, e.g. (x,)")
    if split_points is not None and (
        isinstance(split_points, str) or not all(isinstance(p, str) for p in split_points)
    ):
        raise TypeError(f"split_points={split_points!r} must be a list of block names, e.g. ['model.h.6']")


def _check_balance(balance: Any, parts: int | None) -> None:
    if balance is None or balance == "time":
        return
    if isinstance(balance, str) or not isinstance(balance, Sequence):
        raise ValueError(f"balance={balance!r} must be None, 'time' or a list of layer counts per stage")
    if not all(isinstance(c, int) and not isinstance(c, bool) and c > 0 for c in balance):
        raise ValueError(f"balance={list(balance)} must hold positive integer layer counts")
    if parts is not None and len(balance) != parts:
        raise ValueError(f"balance={list(balance)} must have pp_size x num_model_chunks = {parts} layer counts")
