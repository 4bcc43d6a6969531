"""Sharded data parallel (ZeRO-3) over the hfreduce engine, with haiscale's API.

```python
model = FullyShardedDataParallel(model, auto_wrap_policy={Block}, backward_prefetch=BackwardPrefetch.BACKWARD_POST)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)  # after wrapping: sees this rank's pieces
```

- ``fully_sharded``: ``FullyShardedDataParallel``; its checkpoint methods are the one entry point per operation.
- ``scheduler``: the hook scheduler: when each unit is gathered, resharded and reduced within a step.
- ``param_group``: one sharded unit, FSDP2's verbs, its ``ShardState`` and ``TrainingState``.
- ``layout``: the wrapper's public face: units and, per unit, names, shapes and shard slices.
- ``sharding``: the sharding strategies (``ShardingStrategy``), each a small policy.
- ``mesh``: the shard and replicate groups of a strategy (``hybrid_groups``, a 2-D mesh).
- ``collectives``: the collectives sharding needs, as free functions over the engine.
- ``arrival``: every rank entered a collective call (``CollectiveMisuseError``).
- ``release``: gathered pages given back to the OS in backward.
- ``wrap``: which submodules become units (policies), and which unit owns each parameter.
- ``deferred_init``: meta-device materialization, one unit at a time.
- ``checkpointing``: activation checkpointing applied before sharding.
- ``options``: torch FSDP's other keywords, checked at the border.
- ``api``: the policy dataclasses (``BackwardPrefetch``, ``MixedPrecision``, ``StateDictType``).
- ``names``: state-dict keys, which are not always attribute paths.
- ``state_dict``: model state dicts, full and sharded (read through the layout).
- ``optim_state``: optimizer state dicts, keyed by parameter name.
- ``dcp``: sharded checkpoints in ``torch.distributed.checkpoint`` format (``save_dcp``, ``load_dcp``).
"""

from lightning_haiscale.fsdp.api import BackwardPrefetch, MixedPrecision, StateDictType
from lightning_haiscale.fsdp.arrival import CollectiveMisuseError
from lightning_haiscale.fsdp.fully_sharded import FullyShardedDataParallel
from lightning_haiscale.fsdp.mesh import hybrid_groups
from lightning_haiscale.fsdp.optim_state import (
    full_optim_state_dict,
    load_full_optim_state_dict,
    load_sharded_optim_state_dict,
    sharded_optim_state_dict,
)
from lightning_haiscale.fsdp.param_group import ShardState, TrainingState
from lightning_haiscale.fsdp.sharding import ShardingStrategy
from lightning_haiscale.fsdp.state_dict import (
    full_state_dict,
    load_full_state_dict,
    load_sharded_state_dict,
    sharded_state_dict,
)

__all__ = [
    "BackwardPrefetch",
    "CollectiveMisuseError",
    "FullyShardedDataParallel",
    "MixedPrecision",
    "ShardState",
    "ShardingStrategy",
    "StateDictType",
    "TrainingState",
    "full_optim_state_dict",
    "full_state_dict",
    "hybrid_groups",
    "load_full_optim_state_dict",
    "load_full_state_dict",
    "load_sharded_optim_state_dict",
    "load_sharded_state_dict",
    "sharded_optim_state_dict",
    "sharded_state_dict",
]
