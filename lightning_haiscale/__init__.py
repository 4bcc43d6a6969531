"""lightning-haiscale: haiscale's parallel-training techniques for PyTorch and PyTorch Lightning.

Importing the package registers the Lightning strategies ("hai_ddp", "hai_fsdp", "hai_gpipe",
"hai_pipedream", "hai_interleaved_1f1b"), so ``Trainer(strategy="hai_fsdp")`` resolves, and Lightning Fabric's
("hai_ddp", "hai_fsdp", see ``lightning_haiscale.fabric``), so ``Fabric(strategy="hai_ddp")`` does.
"""

from lightning_haiscale import callbacks, fabric, strategies  # noqa: F401  (fabric: registers its names)
from lightning_haiscale.callbacks import *  # noqa: F403
from lightning_haiscale.strategies import *  # noqa: F403

__version__ = "0.1.0"
__all__ = [*strategies.__all__, *callbacks.__all__]
