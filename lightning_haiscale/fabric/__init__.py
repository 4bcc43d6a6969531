"""Lightning Fabric adapters: ``Fabric(strategy="hai_ddp")`` and ``Fabric(strategy="hai_fsdp")``.

Importing ``lightning_haiscale`` registers both names in Fabric's ``STRATEGY_REGISTRY``. They wrap the same
plain-layer techniques as the Trainer strategies. Pipelines have no Fabric strategy (Lightning has none
either): use ``lightning_haiscale.pipeline`` directly inside a Fabric script (see the README).
"""

from lightning_haiscale.fabric.ddp import HaiDDPStrategy
from lightning_haiscale.fabric.fsdp import HaiFSDPStrategy

__all__ = ["HaiDDPStrategy", "HaiFSDPStrategy"]
