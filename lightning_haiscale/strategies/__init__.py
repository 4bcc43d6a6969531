"""Lightning adapters: each strategy hands the work to the plain-PyTorch layer.

Importing this package registers every strategy name with Lightning's ``StrategyRegistry``.
"""

from lightning_haiscale.strategies.ddp import HaiDDPStrategy
from lightning_haiscale.strategies.fsdp import HaiFSDPStrategy
from lightning_haiscale.strategies.pipeline import GPipeStrategy, Interleaved1F1BStrategy, PipeDreamStrategy

__all__: list[str] = [
    "GPipeStrategy",
    "HaiDDPStrategy",
    "HaiFSDPStrategy",
    "Interleaved1F1BStrategy",
    "PipeDreamStrategy",
]
