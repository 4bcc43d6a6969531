"""Lightning adapters: each strategy hands the work to the plain-PyTorch layer.

Importing this package registers every strategy name with Lightning's ``StrategyRegistry``.

- ``ddp``: ``HaiDDPStrategy`` ("hai_ddp"), Lightning's ``DDPStrategy`` with our wrapper.
- ``fsdp``: ``HaiFSDPStrategy`` ("hai_fsdp").
- ``parallel``: ``HaiParallelStrategy``, what hai_fsdp and the pipelines share; the one module that reaches
  Lightning's private helpers.
- ``pipeline``: the pipeline strategies ("hai_gpipe", "hai_pipedream", "hai_interleaved_1f1b").
- ``pipeline_arguments``: their arguments, checked when built.
- ``pipeline_sharding``: sharded stages (``data_parallel="fsdp"``): PP x FSDP.
- ``pipeline_network``: finding the network and cutting it into this rank's stages.
- ``pipeline_step``: the pipelined step: capture and replay of unmodified step code, logs from the last stage.
- ``pipeline_checkpoint``: the full file and the stage files.
- ``pipeline_optim_state``: the stages' optimizer states as one optimizer over the whole module.
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
