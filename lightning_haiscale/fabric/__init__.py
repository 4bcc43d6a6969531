"""Lightning Fabric adapters: ``Fabric(strategy="hai_ddp")`` and ``Fabric(strategy="hai_fsdp")``.

Importing ``lightning_haiscale`` registers both names in Fabric's ``STRATEGY_REGISTRY``. They wrap the same
plain-layer techniques as the Trainer strategies. Pipelines have no Fabric strategy (Lightning has none
either): use ``lightning_haiscale.pipeline`` directly inside a Fabric script (see docs/fabric.md).

- ``ddp``: Fabric's ``HaiDDPStrategy``.
- ``fsdp``: Fabric's ``HaiFSDPStrategy``.
- ``fsdp_checkpoint``: its ``fabric.save``, ``fabric.load`` and ``fabric.load_raw``.
- ``shared``: the backward-sync control, the wrappers a strategy closes, the process group's setup; the one
  module that reaches Fabric's private interfaces.
"""

from lightning_haiscale.fabric.ddp import HaiDDPStrategy
from lightning_haiscale.fabric.fsdp import HaiFSDPStrategy

__all__ = ["HaiDDPStrategy", "HaiFSDPStrategy"]
