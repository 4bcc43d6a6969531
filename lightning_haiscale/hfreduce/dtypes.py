"""The dtypes the engine reduces, as torch names them: read from the engine's own ``DType`` enum."""

from __future__ import annotations

import functools
from typing import Any

import torch

from lightning_haiscale.hfreduce._native import load_engine


@functools.cache
def _by_torch_dtype() -> dict[torch.dtype, Any]:
    # The engine names each member as torch names its dtype (DType.BFLOAT16 is torch.bfloat16).
    return {getattr(torch, name.lower()): member for name, member in load_engine().DType.__members__.items()}


def supports_dtype(dtype: torch.dtype) -> bool:
    """Whether the engine's collectives take tensors of ``dtype`` (others go through ``torch.distributed``)."""
    return dtype in _by_torch_dtype()


def engine_dtype(dtype: torch.dtype) -> Any:
    """The engine's ``DType`` member for ``dtype``; a ``TypeError`` listing the supported ones if none."""
    try:
        return _by_torch_dtype()[dtype]
    except KeyError:
        supported = ", ".join(str(d).removeprefix("torch.") for d in _by_torch_dtype())
        raise TypeError(f"hfreduce does not support dtype {dtype}; supported: {supported}") from None
