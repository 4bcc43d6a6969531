"""PP x FSDP (issue 35 item 1): haiscale's DP x PP idiom with the sharded wrapper in place of DDP,

    PipeDream(FullyShardedDataParallel(stage, process_group=dp_group, auto_wrap_policy={Block}), chunks,
              process_group=pp_group)

on 4 gloo ranks (pp 2 x dp 2, ``make_subgroups(pp_size=2)``) on 2 simulated hosts, a pipeline on each, so that
every stage is sharded (or, under HYBRID_SHARD, replicated) across the hosts. A small GPT trains in float64 with
SGD and momentum under GPipe (also with ``checkpoint="except_last"``), PipeDream and Interleaved1F1B (each model
chunk wrapped on its own), with FULL_SHARD, SHARD_GRAD_OP and HYBRID_SHARD, to one process's weights on the same
global batch at ``FLOAT64_TOLERANCES`` ([Note: parity tolerances] in lightning_haiscale/testing/parity.py). Every
unit is gathered once and reduce-scattered once per rank and step (fsdp/scheduler.py [Note: microbatch steps];
before it, 28 all-gathers per step for these stages of 4 units under FULL_SHARD, 16 under SHARD_GRAD_OP), counted
on the engine's public methods (``Communicator.all_gather``, ``reduce_scatter``, ``all_reduce``, wrapped inside the
spawned ranks only); a pipelined evaluation gathers each unit once too. A microbatch loop of one's own inside
``microbatch_step`` does the same, and the parity comparison fails when a gradient is mis-scaled, as the families
of tests/test_parity_mutations.py do. One spawn runs everything: starting 4 processes costs more than the runs.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator
from unittest import mock

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from examples.gpt.model import GPT, Block, Embeddings, LMHead, config, lm_loss
from lightning_haiscale.fsdp import FullyShardedDataParallel
from lightning_haiscale.hfreduce import Communicator
from lightning_haiscale.pipeline import GPipe, Interleaved1F1B, PipeDream, Pipeline, make_subgroups, partition
from lightning_haiscale.testing.parity import assert_parity, default_dtype
from tests.distributed import run_distributed

# 8 layers (embeddings, 6 blocks, head): 2 stages of 4 units, or 4 model chunks of 2; no tied head (a tie
# between stages is the pipeline's business, not the sharding's).
CFG = config("tiny", vocab_size=31, n_embd=16, n_head=2, n_layer=6, block_size=8, tie_weights=False)
CHUNKS, STEPS, LR, BATCH = 4, 3, 0.5, 8  # BATCH: the global batch, split over the 2 data-parallel ranks
PP, DP = 2, 2
SCHEDULES = ("gpipe", "gpipe_checkpoint", "pipedream", "interleaved")
SCALE = 1 + 1e-6  # tests/test_parity_mutations.py's: far above float64's rounding
COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce")


def _model() -> GPT:
    torch.manual_seed(0)
    return GPT(CFG)


def _tokens(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(500 + step)
    return torch.randint(0, CFG.vocab_size, (BATCH, CFG.block_size + 1), generator=g)


def _criterion(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """haiscale's convention: each microbatch's mean loss divided by ``chunks`` (SPEC 1.1)."""
    return lm_loss(logits, targets) / CHUNKS


@default_dtype(torch.float64)
def _reference() -> dict[str, list]:
    """One process, the whole global batch's mean loss, SGD with momentum."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    for step in range(STEPS):
        tokens = _tokens(step)
        lm_loss(model(tokens[:, :-1]), tokens[:, 1:]).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.tolist() for k, v in model.state_dict().items()}


def _pipeline(schedule: str, dp_group: dist.ProcessGroup, pp_group: dist.ProcessGroup, **options: object) -> Pipeline:
    """haiscale's DP x PP idiom with FullyShardedDataParallel in place of DistributedDataParallel."""
    rank, size = dist.get_rank(pp_group), dist.get_world_size(pp_group)

    def wrap(stage: torch.nn.Module) -> FullyShardedDataParallel:
        return FullyShardedDataParallel(stage, process_group=dp_group, auto_wrap_policy={Block}, **options)

    if schedule == "interleaved":
        chunks = partition(_model(), rank, size, balance=[2, 2, 2, 2], num_model_chunks=2)
        return Interleaved1F1B([wrap(c) for c in chunks], CHUNKS, process_group=pp_group)
    stage = partition(_model(), rank, size, balance=[4, 4])
    if schedule == "pipedream":
        return PipeDream(wrap(stage), CHUNKS, process_group=pp_group)
    checkpoint = "except_last" if schedule == "gpipe_checkpoint" else "never"
    return GPipe(wrap(stage), CHUNKS, process_group=pp_group, checkpoint=checkpoint)


@contextlib.contextmanager
def _counting() -> Iterator[Counter]:
    """Counts the engine's collectives issued inside the block, by name (its public methods, wrapped)."""
    counts: Counter = Counter()
    with contextlib.ExitStack() as stack:
        for name in COLLECTIVES:
            original = getattr(Communicator, name)

            def counted(self: Communicator, *args: object, _name: str = name, _fn=original, **kwargs: object) -> object:
                counts[_name] += 1
                return _fn(self, *args, **kwargs)

            stack.enter_context(mock.patch.object(Communicator, name, counted))
        yield counts


def _local(step: int, dp_rank: int) -> torch.Tensor:
    """This data-parallel rank's half of step ``step``'s global batch."""
    rows = BATCH // DP
    return _tokens(step)[dp_rank * rows : (dp_rank + 1) * rows]


def _train(pipe: Pipeline, dp_rank: int, mutation: str | None = None) -> dict:
    """STEPS steps on this data-parallel rank's half of each global batch: the whole parameters of this rank's
    stages after them, the engine's collectives of each step, and those of a pipelined evaluation."""
    opt = torch.optim.SGD(pipe.parameters(), lr=LR, momentum=0.9)
    counts = []
    for step in range(STEPS):
        tokens = _local(step, dp_rank)
        with _counting() as count:
            pipe.forward_backward(tokens[:, :-1], criterion=_criterion, labels=(tokens[:, 1:],))
        counts.append(dict(count))
        _mutate(pipe, dp_rank, mutation)
        opt.step()
        opt.zero_grad()
    with torch.no_grad(), _counting() as evaluation:
        pipe(_local(0, dp_rank)[:, :-1])
    state: dict[str, list] = {}
    for stage in pipe.stages:
        with stage.summon_full_params():
            state.update({k: v.tolist() for k, v in stage.module.state_dict().items()})
        stage.close()
    units = sum(len(stage.layout.units) for stage in pipe.stages)
    replicated = pipe.stages[0].replicate_comm is not None
    return {"state": state, "counts": counts, "evaluation": dict(evaluation), "units": units, "replicated": replicated}


def _own_loop(dp_group: dist.ProcessGroup, dp_rank: int) -> dict:
    """No pipeline: the whole model sharded over the data-parallel group, and a microbatch loop of one's own inside
    ``microbatch_step`` (each layer a unit of its own, so that none is interrupted by another's backward)."""
    model = FullyShardedDataParallel(_model(), process_group=dp_group, auto_wrap_policy={Block, Embeddings, LMHead})
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    counts = []
    for step in range(STEPS):
        with _counting() as count, model.microbatch_step(CHUNKS):
            for tokens in _local(step, dp_rank).chunk(CHUNKS):
                _criterion(model(tokens[:, :-1]), tokens[:, 1:]).backward()
        counts.append(dict(count))
        opt.step()
        opt.zero_grad()
    with model.summon_full_params():
        state = {k: v.tolist() for k, v in model.module.state_dict().items()}
    model.close()
    return {"state": state, "counts": counts, "units": len(model.layout.units), "replicated": False}


def _miscounted(dp_group: dist.ProcessGroup) -> str:
    """A step declared of 3 microbatches that runs 2 backwards: no backward reduced the gradients."""
    model = FullyShardedDataParallel(torch.nn.Linear(4, 4), process_group=dp_group)
    try:
        with model.microbatch_step(3):
            for _ in range(2):
                model(torch.ones(2, 4)).sum().backward()
    except RuntimeError as error:
        return str(error)
    finally:
        model.close()
    return "no error"


def _mutate(pipe: Pipeline, dp_rank: int, mutation: str | None) -> None:
    """The bugs a parity test must catch: one rank's reduced gradient shard scaled by (1 + 1e-6), or every
    gradient averaged over the whole world (4 ranks) instead of the stage's data-parallel group (2)."""
    with torch.no_grad():
        if mutation == "scaled" and dp_rank == 1:
            next(p for p in pipe.parameters() if p.grad is not None and p.grad.numel() > 1).grad.mul_(SCALE)
        if mutation == "wrong world size":
            for p in pipe.parameters():
                if p.grad is not None:
                    p.grad.mul_(DP / dist.get_world_size())


def _hybrid_mesh(dp_group: dist.ProcessGroup) -> DeviceMesh:
    """A stage's (replicate, shard) = (2, 1) mesh: its data-parallel pair, one rank on each host. Every rank makes
    every group in one order (torch's ``new_group`` is collective over the world), as the pipeline strategies make
    theirs. Without a mesh the wrapper would make a stage's hybrid groups itself, from its own data-parallel group
    only (fsdp/mesh.py), which the other stage's ranks do not enumerate alike: they hang."""
    alone = [dist.new_group([r]) for r in range(dist.get_world_size())][dist.get_rank()]
    ranks = dist.get_process_group_ranks(dp_group)
    return DeviceMesh.from_group(
        [dp_group, alone], "cpu", mesh=torch.tensor([[r] for r in ranks]), mesh_dim_names=("replicate", "shard")
    )


@default_dtype(torch.float64)
def _composition(rank: int, world: int, runs: list[tuple[str, str, dict, str | None]]) -> dict:
    dp_group, pp_group = make_subgroups(pp_size=PP)
    dp_rank = rank // PP
    mesh = _hybrid_mesh(dp_group)
    out = {}
    for label, schedule, options, mutation in runs:
        placement = {"device_mesh": mesh} if options.get("sharding_strategy") == "HYBRID_SHARD" else {}
        out[label] = _train(_pipeline(schedule, dp_group, pp_group, **options, **placement), dp_rank, mutation)
    out["own loop"] = _own_loop(dp_group, dp_rank)
    out["miscounted"] = _miscounted(dp_group)
    return out


def _merged(results: list[dict], label: str) -> dict[str, list]:
    """Both stages' weights (ranks 0 and 1: the first data-parallel replica; the second must hold the same)."""
    for r in range(PP):
        assert results[r][label]["state"] == results[r + PP][label]["state"], f"{label}: dp replicas differ"
    return {**results[0][label]["state"], **results[1][label]["state"]}


def _passes(state: dict[str, list], expected: dict[str, list], label: str) -> bool:
    try:
        assert_parity(state, expected, label=label)
    except AssertionError:
        return False
    return True


HOSTS = ["a", "a", "b", "b"]  # a pipeline per host; each stage's data-parallel pair spans the two hosts
RUNS = [
    *((f"{s}/{strategy}", s, {"sharding_strategy": strategy}, None) for s in SCHEDULES for strategy in (
        "FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD")),
    ("pipedream/resharded", "pipedream", {"reshard_after_forward": True}, None),
    ("pipedream/scaled", "pipedream", {}, "scaled"),
    ("pipedream/wrong world size", "pipedream", {}, "wrong world size"),
]  # fmt: skip


def _once_per_unit(run: dict) -> dict[str, int]:
    """Each unit gathered once and reduce-scattered once; under HYBRID_SHARD its shard all-reduced once across the
    replicas (the hosts)."""
    units = run["units"]
    return {"all_gather": units, "reduce_scatter": units, **({"all_reduce": units} if run["replicated"] else {})}


def test_sharded_stages_train_to_one_process_gather_once_and_reduce_once_per_step() -> None:
    results = run_distributed(_composition, PP * DP, RUNS, node_ids=HOSTS, timeout=300)
    expected = _reference()
    for label, _, _, mutation in RUNS:
        passes = _passes(_merged(results, label), expected, label)
        assert passes == (mutation is None), f"{label}: parity {'passed' if passes else 'failed'}"
    assert_parity(results[0]["own loop"]["state"], expected, label="own loop")
    for r in results:
        for label, _, options, mutation in RUNS:
            run = r[label]
            if not options.get("reshard_after_forward") and not mutation:  # per rank and step
                assert all(c == _once_per_unit(run) for c in run["counts"]), (label, run["counts"])
                assert run["evaluation"] == {"all_gather": run["units"]}, (label, run["evaluation"])
        resharded = r["pipedream/resharded"]  # after each forward: gathered again for the backward
        assert all(c["all_gather"] > resharded["units"] for c in resharded["counts"]), resharded["counts"]
        loop = r["own loop"]
        assert all(c == _once_per_unit(loop) for c in loop["counts"]), loop["counts"]
        assert "ran 2 backward passes" in r["miscounted"], r["miscounted"]
