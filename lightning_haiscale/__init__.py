"""lightning-haiscale: haiscale's parallel-training techniques for PyTorch and PyTorch Lightning.

Importing the package registers the Lightning strategies ("hai_ddp", "hai_fsdp", "hai_gpipe",
"hai_pipedream", "hai_interleaved_1f1b"), so ``Trainer(strategy="hai_fsdp")`` resolves, and Lightning Fabric's
("hai_ddp", "hai_fsdp", see ``lightning_haiscale.fabric``), so ``Fabric(strategy="hai_ddp")`` does.

The floors, each importing only those below it (docs/design.md; each package's docstring names its modules):

- ``strategies``: the Trainer's face, Lightning strategies over the plain layer.
- ``callbacks``: the Trainer's callbacks (activation offload).
- ``fabric``: Fabric's face; it and ``strategies`` never import each other.
- ``adapter``: the adapter core, what both faces share.
- ``ddp``: plain layer, data parallel on the engine.
- ``fsdp``: plain layer, sharded data parallel (ZeRO-3).
- ``pipeline``: plain layer, pipeline parallelism.
- ``cpu_offload``: plain layer, activation offload to host memory.
- ``clip_grad``: plain layer, gradient clipping by the norm of a model split across ranks.
- ``grad_sync``: plain layer, the one mechanism behind every wrapper's ``no_sync()``.
- ``use_counts``: plain layer, torch's private use counts of a tensor or storage, in one place.
- ``rank_layout``: plain layer, ``RankLayout``: where each rank sits among pipeline, shard and replicate.
- ``hfreduce``: the collective engine's Python face, over the native ``_C`` built from ``csrc/``.
- ``testing``: beside the floors, what tests and benchmarks share.
"""

from lightning_haiscale import callbacks, fabric, strategies  # noqa: F401  (fabric: registers its names)
from lightning_haiscale.callbacks import *  # noqa: F403
from lightning_haiscale.strategies import *  # noqa: F403

__version__ = "0.1.0"
__all__ = [*strategies.__all__, *callbacks.__all__]
