"""Pipeline parallelism in plain PyTorch: partition a network (an ``nn.Sequential`` between its layers, any
other module between its blocks), run GPipe, PipeDream or Interleaved1F1B.

```python
dp_group, pp_group = make_subgroups(pp_size=4)
stage = partition(seq, pp_group.rank(), pp_group.size())
model = PipeDream(stage, chunks=8, process_group=pp_group)
losses, _ = model.forward_backward(x, criterion=lambda out, y: F.cross_entropy(out, y) / 8, labels=(y,))
```

- ``pipelines``: ``GPipe``, ``PipeDream``, ``Interleaved1F1B`` and the one microbatch splitter.
- ``schedule``: schedules as data: ``"1F0"`` actions per rank, built, checked and simulated by pure functions.
- ``executor``: the one executor of any rank's actions.
- ``p2p``: transfer of a stage boundary (a tuple of tensors of any shapes and dtypes).
- ``hosts``: the stages on other hosts, watched, so a silent host ends a transfer's wait within seconds.
- ``partition``: stages from a network, and the process groups of DP x PP.
- ``balance``: the contiguous cut of layers that minimizes the heaviest stage.
- ``split``: cutting any module at block boundaries, by name or along its blocks.
- ``trace``: one traced call: which block lists run, and where the other modules run among them.
- ``module_stage``: ``ModuleStage``, the user's module run by its own forward, holding one stage's part.
- ``stand_in``: stand-ins for the modules another stage holds.
- ``boundary``: what crosses a split module's stage boundary.
- ``ties``: parameters shared by two stages, found by identity and kept equal.
"""

from lightning_haiscale.pipeline.executor import PipelineCommunicationError
from lightning_haiscale.pipeline.module_stage import ModuleStage
from lightning_haiscale.pipeline.partition import SequentialModel, make_subgroups, partition
from lightning_haiscale.pipeline.pipelines import GPipe, Interleaved1F1B, PipeDream, Pipeline, split_microbatches
from lightning_haiscale.pipeline.schedule import Action, ActionType, build_schedule, format_grid
from lightning_haiscale.pipeline.split import SplitPlan, find_blocks, plan_split
from lightning_haiscale.pipeline.ties import Tie, TiedParameters

__all__ = [
    "Action",
    "ActionType",
    "GPipe",
    "Interleaved1F1B",
    "ModuleStage",
    "PipeDream",
    "Pipeline",
    "PipelineCommunicationError",
    "SequentialModel",
    "SplitPlan",
    "Tie",
    "TiedParameters",
    "build_schedule",
    "find_blocks",
    "format_grid",
    "make_subgroups",
    "partition",
    "plan_split",
    "split_microbatches",
]
