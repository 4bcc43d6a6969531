"""PP x FSDP in the Trainer (``data_parallel="fsdp"``): every schedule and sharding mode trains to one process's
parameters, and its checkpoints resume under another layout, under ``hai_fsdp`` and in the unsplit module.

The model and the reference are the pipeline strategies' (``testing.parity``): float64, SGD with momentum, so a
mis-scaled gradient shows (``FLOAT64_TOLERANCES``: rtol 1e-9, see [Note: parity tolerances]). 4 ranks: 2 pipelines
of 2 stages, each stage sharded over the 2 pipelines (or replicated across 2 simulated hosts, HYBRID_SHARD).
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import lightning_haiscale  # noqa: F401 - registers the strategies
from lightning_haiscale.fsdp import FullyShardedDataParallel
from lightning_haiscale.strategies import GPipeStrategy, HaiFSDPStrategy, Interleaved1F1BStrategy, PipeDreamStrategy
from lightning_haiscale.testing.parity import BATCH, FLOAT64_TOLERANCES, STEPS, Classifier, reference
from tests.distributed import run_distributed
from tests.fsdp.test_pipeline_composition import _counting
from tests.strategies.test_pipeline_strategies import CLIP, DTYPE, _check_full_state, fit

SHARDED = {"data_parallel": "fsdp", "pp_size": 2, "auto_wrap_policy": {nn.Linear}}


def _every_schedule_and_mode(rank: int, world: int, tmp: str) -> None:
    expected, _ = reference(STEPS, BATCH, dp=2, dtype=DTYPE)
    for label, strategy in {
        "gpipe": GPipeStrategy(chunks=2, **SHARDED),
        "pipedream": PipeDreamStrategy(chunks=2, **SHARDED),
        "interleaved": Interleaved1F1BStrategy(chunks=2, **SHARDED),
        "shard_grad_op": PipeDreamStrategy(chunks=2, sharding_strategy="SHARD_GRAD_OP", **SHARDED),
        "one unit per stage": PipeDreamStrategy(chunks=2, data_parallel="fsdp", pp_size=2),
    }.items():
        with _counting() as counts:
            trainer = fit(strategy, tmp, limit_val_batches=0)
        stages = trainer.strategy.pipeline.stages
        units = sum(len(s.layout.units) for s in stages)
        assert counts["all_gather"] == STEPS * units, (label, dict(counts), units)  # once per unit and step
        assert all(isinstance(s, FullyShardedDataParallel) for s in stages), label
        pieces = [p.numel() for s in stages for p in s.parameters()]
        whole = sum(p.numel() for p in trainer.strategy.lightning_module.parameters())
        assert sum(pieces) == whole < sum(v.numel() for v in expected.values()) / 2 + 64, label  # this rank's share
        _check_full_state(trainer, expected, label)
    expected_clip, _ = reference(STEPS, BATCH, dp=2, clip=CLIP, dtype=DTYPE)
    trainer = fit(PipeDreamStrategy(chunks=2, **SHARDED), tmp, gradient_clip_val=CLIP)
    _check_full_state(trainer, expected_clip, "clip: the norm over every stage's shards")
    rows = BATCH * STEPS * 2 * 2  # 2 replicas, 2 batches per step
    expected_acc, _ = reference(STEPS, BATCH, dp=2, accumulate=2, rows=rows, dtype=DTYPE)
    trainer = fit(GPipeStrategy(chunks=2, **SHARDED), tmp, accumulate=2, rows=rows)
    _check_full_state(trainer, expected_acc, "accumulate")


def test_pp_x_fsdp_trains_like_one_process(tmp_path: Any) -> None:
    run_distributed(_every_schedule_and_mode, 4, str(tmp_path), timeout=600)


def _hybrid(rank: int, world: int, tmp: str) -> None:
    expected, _ = reference(STEPS, BATCH, dp=2, dtype=DTYPE)
    for label, strategy in {
        "hybrid: a pipeline per host, the stages replicated across hosts": PipeDreamStrategy(
            chunks=2, sharding_strategy="HYBRID_SHARD", **SHARDED
        ),
        "gpipe, the shards across hosts": GPipeStrategy(chunks=2, **SHARDED),
        "interleaved, the shards across hosts": Interleaved1F1BStrategy(chunks=2, **SHARDED),
    }.items():
        trainer = fit(strategy, tmp, num_nodes=2)
        _check_full_state(trainer, expected, label)
        assert trainer.strategy.rank_layout.replicate_size == (2 if label.startswith("hybrid") else 1)


def test_pp_x_hybrid_shard_on_two_hosts(tmp_path: Any) -> None:
    run_distributed(_hybrid, 4, str(tmp_path), node_ids=["a", "a", "b", "b"], timeout=300)


def _checkpoints(rank: int, world: int, tmp: str) -> None:
    expected, _ = reference(STEPS, BATCH, dp=2, dtype=DTYPE)
    trainer = fit(PipeDreamStrategy(chunks=2, **SHARDED), tmp)
    path = os.path.join(tmp, "ppfsdp.ckpt")
    trainer.save_checkpoint(path)
    dist.barrier()
    saved = torch.load(path, weights_only=False)
    plain = Classifier().to(DTYPE)
    plain.load_state_dict(saved["state_dict"])  # strict: the unsplit module's keys, whole
    momentum = {i: s["momentum_buffer"] for i, s in saved["optimizer_states"][0]["state"].items()}
    params = list(plain.parameters())
    assert sorted(momentum) == list(range(len(params)))
    assert all(momentum[i].shape == p.shape for i, p in enumerate(params))  # whole, in the module's order
    for label, strategy in {
        "same layout": PipeDreamStrategy(chunks=2, **SHARDED),
        "pp 4": GPipeStrategy(chunks=2, data_parallel="fsdp", pp_size=4),
        "pp 2 x ddp": PipeDreamStrategy(chunks=2, pp_size=2),
        "hai_fsdp": HaiFSDPStrategy(auto_wrap_policy={nn.Linear}),
    }.items():
        resumed = fit(strategy, tmp, ckpt_path=path, limit_val_batches=0)  # at max_steps: restores, trains nothing
        full = resumed.strategy.lightning_module_state_dict()  # collective; hai_fsdp's is on rank 0 only
        if full:
            assert sorted(full) == sorted(expected), label
            for k, v in expected.items():
                torch.testing.assert_close(full[k], v, **FLOAT64_TOLERANCES, msg=f"{label} {k}")
        again = os.path.join(tmp, f"{label}.ckpt")
        resumed.save_checkpoint(again)  # the optimizer state it restored, saved whole again
        dist.barrier()
        state = torch.load(again, weights_only=False)["optimizer_states"][0]["state"]
        assert sorted(state) == sorted(momentum), label
        for i, value in momentum.items():
            assert torch.equal(state[i]["momentum_buffer"], value), f"{label}: momentum of parameter {i}"


def test_pp_x_fsdp_checkpoints_resume_under_other_layouts(tmp_path: Any) -> None:
    run_distributed(_checkpoints, 4, str(tmp_path), timeout=600)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"sharding_strategy": "FULL_SHARD"}, ValueError, r"configures sharded stages.*data_parallel='fsdp'"),
        ({"data_parallel": "zero"}, ValueError, r"data_parallel='zero' must be one of 'ddp', 'fsdp'"),
        ({"data_parallel": "fsdp", "sharding_strategy": "ZERO"}, ValueError, "sharding_strategy"),
        ({"data_parallel": "fsdp", "device_mesh": (2, 2)}, ValueError, "HYBRID_SHARD"),
    ],
)
def test_bad_sharding_arguments_are_named(kwargs: dict, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        PipeDreamStrategy(chunks=2, **kwargs)


def _real_models(rank: int, world: int, tmp: str) -> None:
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    from tests.strategies import real_models

    blocks = {"llama": LlamaDecoderLayer, "gpt2": GPT2Block, "litgpt": real_models.Block}
    for name, block in blocks.items():  # GPT-2's and the litgpt-style head are tied to the first stage's wte
        make, loss = real_models.MODELS[name]
        expected, _ = real_models.one_process(make, loss, dp=2, clip=CLIP)
        strategy = PipeDreamStrategy(chunks=2, pp_size=2, data_parallel="fsdp", auto_wrap_policy={block})
        trainer = real_models.fit(make, loss, strategy, dp=2, dp_rank=rank // 2, gradient_clip_val=CLIP)
        label = f"{name} pp 2 x fsdp 2, clipped"
        real_models.check(trainer.strategy.lightning_module_state_dict(), expected, name, label)
    with pytest.raises(ValueError, match=r"'2.weight' \(stage 0\) = '4.weight' \(stage 1\) shares its module"):
        fit(PipeDreamStrategy(chunks=2, balance=[3, 4], **SHARDED), tmp, module=_TiedWithBias())


class _TiedWithBias(Classifier):
    """Two layers of different stages share a weight, each beside its own bias."""

    def __init__(self) -> None:
        super().__init__()
        widths = [(6, 16), (16, 16), (16, 16), (16, 4)]
        self.net = nn.Sequential(*(m for a, b in widths for m in (nn.Linear(a, b), nn.Tanh())))[:-1]
        self.net[4].weight = self.net[2].weight


def test_unmodified_real_models_under_pp_x_fsdp_ties_included(tmp_path: Any) -> None:
    run_distributed(_real_models, 4, str(tmp_path), timeout=600)
