"""hai_ddp's options and its wrapper, as both Lightning faces (the Trainer's and Fabric's ``HaiDDPStrategy``) take
and build them."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from torch.nn import Module

from lightning_haiscale.adapter.arguments import check_bool, check_number
from lightning_haiscale.ddp import DistributedDataParallel
from lightning_haiscale.hfreduce import Communicator

__all__ = ["START_METHODS", "TORCH_DDP_ONLY", "hai_ddp_options", "wrap_hai_ddp"]

START_METHODS = ("popen", "spawn", "fork", "forkserver")
"""How a ``HaiDDPStrategy`` may start its processes (``DDPStrategy``'s ``start_method``)."""

TORCH_DDP_ONLY = ("ddp_comm_state", "ddp_comm_hook", "ddp_comm_wrapper", "model_averaging_period")
"""``DDPStrategy``'s parameters that configure torch DDP's communication hooks and model averaging, which hai_ddp
replaces: both faces keep their positions and accept only ``None``."""


def hai_ddp_options(
    refused: list[str], bucket_cap_mb: Any, find_unused_parameters: Any, broadcast_buffers: Any
) -> dict[str, Any]:
    """hai_ddp's own options, checked; ``refused`` (torch DDP's options that were given) raise ``TypeError``."""
    if refused:
        raise TypeError(
            f"HaiDDPStrategy does not take {refused}: those configure torch's DistributedDataParallel, which "
            "hai_ddp replaces; it takes bucket_cap_mb, find_unused_parameters and broadcast_buffers"
        )
    return {
        "bucket_cap_mb": check_number("bucket_cap_mb", bucket_cap_mb),
        "find_unused_parameters": check_bool("find_unused_parameters", find_unused_parameters),
        "broadcast_buffers": check_bool("broadcast_buffers", broadcast_buffers),
    }


def wrap_hai_ddp(
    module: Module, device_ids: list[int] | None, timeout: timedelta | None, options: dict[str, Any]
) -> DistributedDataParallel:
    """The wrapper, on an engine whose waits end at ``timeout`` (the strategy's, as its process group's)."""
    engine = Communicator(timeout=timeout) if timeout is not None else Communicator()
    return DistributedDataParallel(module, device_ids=device_ids, communicator=engine, **options)
