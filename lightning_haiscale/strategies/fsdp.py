"""``HaiFSDPStrategy`` ("hai_fsdp"): Lightning's adapter for :class:`lightning_haiscale.fsdp.FullyShardedDataParallel`.

[Note: checkpoints]
``state_dict_type="full"``: one file written by rank 0, Lightning's usual layout, whose ``state_dict`` loads
with plain ``torch.load`` into the bare LightningModule; optimizer states are in torch's index-keyed layout
(``optimizer.state_dict()``'s, as Lightning's FSDP re-keys them), so ``ddp``, one device or a pipeline resumes
it. Every rank memory-maps it to load, so the ranks share one copy in the page cache and each reads only
its pieces. ``"sharded"``: a ``torch.distributed.checkpoint`` folder in the layout of Lightning's
``FSDPStrategy``: every parameter and optimizer state in its own shape (see ``fsdp.dcp`` [Note: flat pieces
as DCP chunks]) under ``model`` and ``optimizer_<i>``, and ``meta.pt`` (everything else, written by rank 0
through ``checkpoint_io``). It resumes on any number of ranks and under Lightning's ``FSDPStrategy`` (and a
folder of theirs under ours), and ``python -m lightning.pytorch.utilities.consolidate_checkpoint`` turns it
into one full checkpoint file (tied parameters appear once). Files and folders of earlier versions still load
(name-keyed optimizer states; ``state_dict``/``optimizer_states`` folders; 0.1's ``rank_<r>.pt`` files).
Loading checks what Lightning's FSDP checks: one optimizer state per optimizer. Tensors already on the CPU
are never copied a second time to "offload" them.
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
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn
from torch.distributed.constants import default_pg_timeout
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffload, ShardingStrategy
from torch.distributed.fsdp import MixedPrecision as TorchMixedPrecision
from typing_extensions import override

from lightning_haiscale.adapter.arguments import check_choice, strategy_repr
from lightning_haiscale.adapter.checkpoint_files import foreign_entries, remove_own_entries
from lightning_haiscale.adapter.checkpoint_io import optimizer_states_of
from lightning_haiscale.adapter.fsdp_options import hai_fsdp_options, wrap_hai_fsdp
from lightning_haiscale.adapter.registry import register_once
from lightning_haiscale.adapter.sharded_folder import META_FILE, check_checkpoint_path, load_meta, save_sharded
from lightning_haiscale.fsdp import BackwardPrefetch, FullyShardedDataParallel, MixedPrecision
from lightning_haiscale.fsdp.checkpointing import CheckpointPolicy
from lightning_haiscale.fsdp.dcp import is_dcp_folder, load_dcp, optimizer_keys
from lightning_haiscale.fsdp.optim_state import index_keyed
from lightning_haiscale.fsdp.wrap import AutoWrapPolicy
from lightning_haiscale.strategies.parallel import HaiParallelStrategy

__all__ = ["HaiFSDPStrategy"]

log = logging.getLogger(__name__)

_WRAPPER_ATTR = "_hai_fsdp_wrapper"  # a LightningModule sharded by an earlier Trainer keeps its wrapper


class HaiFSDPStrategy(HaiParallelStrategy):
    """Fully sharded data parallel on the hfreduce engine, on CPU and CUDA.

    The model built in ``LightningModule.configure_model`` is created on the meta device and materialized
    one unit at a time while it is sharded, so it never exists whole on one rank; build the optimizer in
    ``configure_optimizers`` from ``self.parameters()`` as usual (it sees this rank's pieces).

    Takes every keyword of Lightning's ``FSDPStrategy``, in its order, after its own three; each is honoured or
    refused when the strategy is built (see ``adapter.fsdp_options`` [Note: what each FSDPStrategy keyword
    becomes]). This is the Trainer's class: Fabric takes ``lightning_haiscale.fabric.HaiFSDPStrategy``.

    Args:
        backward_prefetch: when backward prefetches the next unit's parameters (ours or torch's enum).
        reshard_after_forward: free each unit's parameters after its forward.
        param_init_fn: ``fn(module)`` initializing meta-device parameters (default: the model's own
            initialization, see ``fsdp.deferred_init``).
        timeout: deadline of the process group and of the engine's waits.
        process_group_backend: torch.distributed backend (default: gloo on CPU, nccl on CUDA).
        cpu_offload: ``True`` or torch's ``CPUOffload``: shards and gradients in host memory (CUDA; no effect on CPU).
        mixed_precision: torch's ``MixedPrecision`` (or ours); wins over the Trainer's ``precision``.
        auto_wrap_policy: which submodules become units (torch's wrap policies or a set of module classes).
        activation_checkpointing: deprecated spelling of ``activation_checkpointing_policy`` (classes).
        activation_checkpointing_policy: the modules whose activations backward recomputes (classes or a policy).
        sharding_strategy: ``"FULL_SHARD"``, ``"SHARD_GRAD_OP"``, ``"NO_SHARD"``, ``"HYBRID_SHARD"`` or
            ``"_HYBRID_SHARD_ZERO2"`` (or torch's enum).
        state_dict_type: ``"full"`` (one file, rank 0) or ``"sharded"`` (a ``torch.distributed.checkpoint`` folder).
        device_mesh: for the hybrid strategies, ``(replicate, shard)`` or a 2-D ``DeviceMesh``; default: shard
            within each host, replicate across hosts.
        limit_all_gathers, forward_prefetch, use_orig_params, sync_module_states, ignored_modules: torch FSDP's,
            passed to the wrapper (``None``: its default). Lightning takes them in ``**kwargs``; named here,
            LightningCLI shows and parses them.
        **kwargs: any other name raises, saying why.
    """

    strategy_name = "hai_fsdp"

    def __init__(
        self,
        backward_prefetch: BackwardPrefetch | None = BackwardPrefetch.BACKWARD_PRE,
        reshard_after_forward: bool = True,
        param_init_fn: Callable[[nn.Module], None] | None = None,
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        cpu_offload: bool | CPUOffload | None = None,
        mixed_precision: TorchMixedPrecision | MixedPrecision | None = None,
        auto_wrap_policy: AutoWrapPolicy | None = None,
        activation_checkpointing: type[nn.Module] | list[type[nn.Module]] | None = None,
        activation_checkpointing_policy: CheckpointPolicy | None = None,
        sharding_strategy: str | ShardingStrategy = "FULL_SHARD",
        state_dict_type: Literal["full", "sharded"] = "full",
        device_mesh: tuple[int, int] | DeviceMesh | None = None,
        *,
        limit_all_gathers: bool | None = None,
        forward_prefetch: bool | None = None,
        use_orig_params: bool | None = None,
        sync_module_states: bool | None = None,
        ignored_modules: list[nn.Module] | None = None,
        **kwargs: Any,
    ) -> None:
        check_choice("state_dict_type", state_dict_type, ("full", "sharded"))
        options = hai_fsdp_options(
            backward_prefetch=backward_prefetch,
            reshard_after_forward=reshard_after_forward,
            param_init_fn=param_init_fn,
            cpu_offload=cpu_offload,
            mixed_precision=mixed_precision,
            auto_wrap_policy=auto_wrap_policy,
            activation_checkpointing=activation_checkpointing,
            activation_checkpointing_policy=activation_checkpointing_policy,
            sharding_strategy=sharding_strategy,
            device_mesh=device_mesh,
            kwargs={
                **kwargs,
                "limit_all_gathers": limit_all_gathers,
                "forward_prefetch": forward_prefetch,
                "use_orig_params": use_orig_params,
                "sync_module_states": sync_module_states,
                "ignored_modules": ignored_modules,
            },
        )
        super().__init__(
            timeout=timeout or default_pg_timeout,
            process_group_backend=process_group_backend,
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        self.state_dict_type = state_dict_type
        self.sharding_strategy, self.cpu_offload = options.torch_attributes()  # torch's, as Lightning's
        self._fsdp_options = options

    @property
    def mixed_precision_config(self) -> TorchMixedPrecision | None:
        """The mixed precision the wrapper runs, as torch's ``MixedPrecision`` (as Lightning's FSDP exposes it);
        ``None``: the parameters' own dtype."""
        return self._fsdp_options.torch_mixed_precision(self.precision_plugin.precision)

    def __repr__(self) -> str:
        return strategy_repr(self, "lightning_haiscale.fabric.HaiFSDPStrategy")

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
        wrapped = wrap_hai_fsdp(model, self.root_device, self._timeout, precision, self._fsdp_options)
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
            return index_keyed(self._wrapper().full_optim_state_dict(optimizer))
        return self._wrapper().sharded_optim_state_dict(optimizer)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        if self.state_dict_type == "full":
            super().save_checkpoint(checkpoint, filepath, storage_options)
            return
        path = Path(self.broadcast(str(filepath)))
        model_shard, optim_shards = checkpoint.pop("state_dict"), checkpoint.pop("optimizer_states", [])
        group = self._wrapper().process_group
        save_sharded(self, path, model_shard, optim_shards, checkpoint, group, storage_options)

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        """A sharded folder (``ModelCheckpoint``'s ``save_top_k``): its checkpoint files only; the folder goes when
        nothing else is left in it (a save in place keeps the user's entries, see ``checkpoint_files``)."""
        path = Path(filepath)
        if not (self.is_global_zero and path.is_dir() and not path.is_symlink()):
            super().remove_checkpoint(filepath)
            return
        remove_own_entries(path)
        if not foreign_entries(path):
            path.rmdir()

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Loads the weights; when fitting, the optimizer states too (``validate`` after ``fit`` on the same
        Trainer still holds the finished fit's optimizers, which belong to another model)."""
        path = Path(self.broadcast(str(checkpoint_path)))
        check_checkpoint_path(path)
        safe = True if weights_only is None else weights_only
        strict = self.lightning_module.strict_loading if self.lightning_module is not None else True
        model = self._wrapper()
        optimizers = self.optimizers if self.lightning_module.trainer.state.fn == TrainerFn.FITTING else []
        if is_dcp_folder(path):
            meta = load_meta(self, path, weights_only)
            if optimizers:
                saved = optimizer_keys(path) or None  # none: weights only, as the connector reports it
                optimizer_states_of({**meta, "optimizer_states": saved}, path, len(optimizers))
            model_shard, optim_shards = load_dcp(path, model, len(optimizers), strict=strict)
            model.load_sharded_state_dict([model_shard], strict=strict)
            for optimizer, shard in zip(optimizers, optim_shards, strict=True):
                model.load_sharded_optim_state_dict(optimizer, [shard])
            return meta
        if path.is_dir():  # the rank_<r>.pt folders of lightning-haiscale 0.1
            meta = torch.load(path / META_FILE, map_location="cpu", weights_only=safe)
            files = [path / f"rank_{r}.pt" for r in range(meta.pop("hai_fsdp_world_size"))]
            model.load_sharded_state_dict((_mmap(f, safe)["state_dict"] for f in files), strict=strict)
            for i, optimizer in enumerate(optimizers):
                shards = (_mmap(f, safe)["optimizer_states"][i] for f in files)
                model.load_sharded_optim_state_dict(optimizer, shards)
            return meta
        checkpoint = _mmap(path, safe)
        model.load_full_state_dict(checkpoint.pop("state_dict"), strict=strict)
        states = optimizer_states_of(checkpoint, path, len(optimizers)) if optimizers else []
        for optimizer, state in zip(optimizers, states, strict=True):
            model.load_full_optim_state_dict(optimizer, state)
        checkpoint.pop("optimizer_states", None)
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


def _mmap(path: Path, weights_only: bool) -> dict[str, Any]:
    """Memory-mapped: every rank maps the same pages instead of holding its own copy of the file."""
    return torch.load(path, map_location="cpu", mmap=True, weights_only=weights_only)


register_once(HaiFSDPStrategy, StrategyRegistry)
