"""``HaiFSDPStrategy`` ("hai_fsdp"): Lightning's adapter for :class:`lightning_haiscale.fsdp.FullyShardedDataParallel`.

[Note: checkpoints]
``state_dict_type="full"``: one file written by rank 0, Lightning's usual layout, whose ``state_dict`` loads
with plain ``torch.load`` into the bare LightningModule; optimizer states are keyed by parameter name.
Every rank memory-maps it to load, so the ranks share one copy in the page cache and each reads only
its pieces. ``"sharded"``: a ``torch.distributed.checkpoint`` folder, as Lightning's FSDP and ModelParallel
strategies write: every parameter and optimizer state in its own shape (see ``fsdp.dcp`` [Note: flat pieces
as DCP chunks]) under ``state_dict`` and ``optimizer_states``, and ``meta.pt`` (everything else, written by
rank 0 through ``checkpoint_io``). It resumes on any number of ranks, and torch's ``dcp_to_torch_save``
turns it into one file (with ``meta.pt``'s entries, a full checkpoint; tied parameters appear once).
Folders of ``rank_<r>.pt`` files (lightning-haiscale 0.1) still load. Tensors already on the CPU are
never copied a second time to "offload" them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Generator, Mapping
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn
from typing_extensions import override

from lightning_haiscale.checkpoint_files import folder_checkpoint
from lightning_haiscale.fsdp import (
    BackwardPrefetch,
    FullyShardedDataParallel,
    MixedPrecision,
)
from lightning_haiscale.fsdp.dcp import is_dcp_folder, load_dcp, save_dcp
from lightning_haiscale.fsdp.wrap import AutoWrapPolicy, check_policy
from lightning_haiscale.hfreduce import Communicator
from lightning_haiscale.strategies.arguments import check_bool, check_choice
from lightning_haiscale.strategies.parallel import HaiParallelStrategy, register_once

__all__ = ["HaiFSDPStrategy", "hai_fsdp_options", "wrap_hai_fsdp"]

log = logging.getLogger(__name__)

_META_FILE = "meta.pt"
_WRAPPER_ATTR = "_hai_fsdp_wrapper"  # a LightningModule sharded by an earlier Trainer keeps its wrapper


class HaiFSDPStrategy(HaiParallelStrategy):
    """Fully sharded data parallel on the hfreduce engine, on CPU and CUDA.

    The model built in ``LightningModule.configure_model`` is created on the meta device and materialized
    one unit at a time while it is sharded, so it never exists whole on one rank; build the optimizer in
    ``configure_optimizers`` from ``self.parameters()`` as usual (it sees this rank's pieces).

    Args:
        auto_wrap_policy: which submodules become units (torch's wrap policies or a set of module classes).
        backward_prefetch: when backward prefetches the next unit's parameters.
        reshard_after_forward: free each unit's parameters after its forward.
        state_dict_type: ``"full"`` (one file, rank 0) or ``"sharded"`` (a folder, one file per rank).
        param_init_fn: ``fn(module)`` initializing meta-device parameters (default ``reset_parameters()``).
        **kwargs: passed to :class:`HaiParallelStrategy`: ``timeout`` (deadline of the process group and of the
            engine's waits), ``process_group_backend``, and what the Trainer sets.
    """

    strategy_name = "hai_fsdp"

    def __init__(
        self,
        auto_wrap_policy: AutoWrapPolicy | None = None,
        backward_prefetch: BackwardPrefetch | None = BackwardPrefetch.BACKWARD_PRE,
        reshard_after_forward: bool = True,
        state_dict_type: Literal["full", "sharded"] = "full",
        param_init_fn: Callable[[nn.Module], None] | None = None,
        **kwargs: Any,
    ) -> None:
        check_choice("state_dict_type", state_dict_type, ("full", "sharded"))
        options = hai_fsdp_options(auto_wrap_policy, backward_prefetch, reshard_after_forward, param_init_fn)
        super().__init__(**kwargs)
        self.state_dict_type = state_dict_type
        self._fsdp_kwargs = options

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # checkpoints load into the sharded model and its optimizer

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        return False  # load_checkpoint restores the optimizer pieces itself

    # ---------------------------------------------------------------------------- model

    @override
    @contextmanager
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        """``configure_model`` builds on the meta device; sharding materializes one unit at a time."""
        device = nullcontext() if empty_init is False else torch.device("meta")
        with device, self.precision_plugin.tensor_init_context():
            yield

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        if self.accelerator is None or self.model is None:
            raise RuntimeError("HaiFSDPStrategy.setup() runs inside Trainer.fit/validate/test/predict")
        self.accelerator.setup(trainer)
        self.model = self._setup_model(self.precision_plugin.convert_module(self.model))
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self._reset_optimizers()
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()

    def _setup_model(self, model: nn.Module) -> FullyShardedDataParallel:
        existing = model.__dict__.get(_WRAPPER_ATTR)
        if isinstance(existing, FullyShardedDataParallel):
            return existing
        precision = self.precision_plugin.precision
        wrapped = wrap_hai_fsdp(model, self.root_device, self._timeout, precision, self._fsdp_kwargs)
        model.__dict__[_WRAPPER_ATTR] = wrapped  # not a submodule: plain attribute
        return wrapped

    @override
    def clip_grad_norm_(self, max_norm: float) -> None:
        self._wrapper().clip_grad_norm_(max_norm)

    @override
    def model_to_device(self) -> None:
        """The wrapper creates the shards on the root device."""

    # ---------------------------------------------------------------------- checkpoints

    def _wrapper(self) -> FullyShardedDataParallel:
        if not isinstance(self.model, FullyShardedDataParallel):
            raise RuntimeError("the model is not sharded yet; checkpoints are available after Trainer setup")
        return self.model

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        if self.state_dict_type == "full":
            return self._wrapper().full_state_dict()
        return self._wrapper().sharded_state_dict()

    @override
    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        optimizer = getattr(optimizer, "_optimizer", optimizer)  # a LightningOptimizer
        if self.state_dict_type == "full":
            return self._wrapper().full_optim_state_dict(optimizer)
        return self._wrapper().sharded_optim_state_dict(optimizer)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        if self.state_dict_type == "full":
            super().save_checkpoint(checkpoint, filepath, storage_options)
            return
        path = Path(self.broadcast(str(filepath)))
        model_shard, optim_shards = checkpoint.pop("state_dict"), checkpoint.pop("optimizer_states", [])
        with folder_checkpoint(path, publisher=self.is_global_zero, barrier=self.barrier) as staging:
            save_dcp(staging, model_shard, optim_shards, self._wrapper().comm.group)  # creates the folder
            if self.is_global_zero:
                self.checkpoint_io.save_checkpoint(checkpoint, staging / _META_FILE, storage_options=storage_options)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Loads the weights; when fitting, the optimizer states too (``validate`` after ``fit`` on the same
        Trainer still holds the finished fit's optimizers, which belong to another model)."""
        path = Path(self.broadcast(str(checkpoint_path)))
        safe = True if weights_only is None else weights_only
        strict = self.lightning_module.strict_loading if self.lightning_module is not None else True
        model = self._wrapper()
        optimizers = self.optimizers if self.lightning_module.trainer.state.fn == TrainerFn.FITTING else []
        if is_dcp_folder(path):
            meta = dict(self.checkpoint_io.load_checkpoint(path / _META_FILE, weights_only=weights_only))
            model_shard, optim_shards = load_dcp(path, model, len(optimizers), strict=strict)
            model.load_sharded_state_dict([model_shard], strict=strict)
            for optimizer, shard in zip(optimizers, optim_shards, strict=True):
                model.load_sharded_optim_state_dict(optimizer, [shard])
            return meta
        if path.is_dir():  # the rank_<r>.pt folders of lightning-haiscale 0.1
            meta = torch.load(path / _META_FILE, map_location="cpu", weights_only=safe)
            files = [path / f"rank_{r}.pt" for r in range(meta.pop("hai_fsdp_world_size"))]
            model.load_sharded_state_dict((_mmap(f, safe)["state_dict"] for f in files), strict=strict)
            for i, optimizer in enumerate(optimizers):
                shards = (_mmap(f, safe)["optimizer_states"][i] for f in files)
                model.load_sharded_optim_state_dict(optimizer, shards)
            return meta
        checkpoint = _mmap(path, safe)
        model.load_full_state_dict(checkpoint.pop("state_dict"), strict=strict)
        for optimizer, state in zip(optimizers, checkpoint.pop("optimizer_states", []), strict=False):
            model.load_full_optim_state_dict(optimizer, state)
        return checkpoint

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        """Done in :meth:`load_checkpoint`, straight into the pieces."""

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Done in :meth:`load_checkpoint`, straight into the pieces."""

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register("hai_fsdp", cls, description="fully sharded data parallel on the hfreduce engine")

    @override
    def teardown(self) -> None:
        """Closes the wrapper's engine (a later fit, validation or checkpoint call starts a new one), then
        Lightning's teardown. The wrapper stays: the module keeps its shards for the next Trainer."""
        if isinstance(self.model, FullyShardedDataParallel):
            self.model.close()
        if self.cluster_environment is not None:
            self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        if self.accelerator is not None:
            self.accelerator.teardown()


def hai_fsdp_options(
    auto_wrap_policy: Any, backward_prefetch: Any, reshard_after_forward: Any, param_init_fn: Any
) -> dict[str, Any]:
    """The wrapper's options, checked (shared by the Trainer and Fabric strategies)."""
    check_policy(auto_wrap_policy)
    if backward_prefetch is not None and not isinstance(backward_prefetch, BackwardPrefetch):
        raise TypeError(
            f"backward_prefetch={backward_prefetch!r} must be None, BackwardPrefetch.BACKWARD_PRE or BACKWARD_POST"
        )
    check_bool("reshard_after_forward", reshard_after_forward)
    if param_init_fn is not None and not callable(param_init_fn):
        raise TypeError(f"param_init_fn={param_init_fn!r} must be a function fn(module) or None")
    return {
        "auto_wrap_policy": auto_wrap_policy,
        "backward_prefetch": backward_prefetch,
        "reshard_after_forward": reshard_after_forward,
        "param_init_fn": param_init_fn,
    }


def wrap_hai_fsdp(
    module: nn.Module, device: torch.device, timeout: timedelta, precision: str, options: dict[str, Any]
) -> FullyShardedDataParallel:
    """Shards ``module`` on an engine with the strategy's ``timeout``. bf16-mixed gathers and reduces in bf16
    (half the traffic); autocast still runs the ops."""
    mixed = None
    if precision == "bf16-mixed":
        mixed = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16, cast_forward_inputs=False)
    engine = Communicator(timeout=timeout)
    return FullyShardedDataParallel(module, mixed_precision=mixed, device_id=device, communicator=engine, **options)


def _mmap(path: Path, weights_only: bool) -> dict[str, Any]:
    """Memory-mapped: every rank maps the same pages instead of holding its own copy of the file."""
    return torch.load(path, map_location="cpu", mmap=True, weights_only=weights_only)


register_once(HaiFSDPStrategy, StrategyRegistry)
