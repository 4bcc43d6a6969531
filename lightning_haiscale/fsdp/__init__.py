"""Sharded data parallel (ZeRO-3) over the hfreduce engine, with haiscale's API.

```python
model = FullyShardedDataParallel(model, auto_wrap_policy={Block}, backward_prefetch=BackwardPrefetch.BACKWARD_POST)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)  # after wrapping: sees this rank's pieces
```
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
