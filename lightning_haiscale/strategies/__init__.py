"""Lightning adapters: each strategy hands the work to the plain-PyTorch layer.

Importing this package registers every strategy name with Lightning's ``StrategyRegistry``.
"""

from lightning_haiscale.strategies.ddp import HaiDDPStrategy
from lightning_haiscale.strategies.fsdp import HaiFSDPStrategy

__all__: list[str] = ["HaiDDPStrategy", "HaiFSDPStrategy"]
