"""Every snippet of haiscale's documented API (the one its users know), run as written, against one process.

One spawned world per size runs them all (process start-up dominates on 2 cores). SGD throughout (Adam
would hide a gradient scale); losses and final weights in float64 at rtol 1e-9 (``tests/compat/gpt2.py``: rounding
cannot decide it), on 2 and 4 processes. Also decided
here, with the evidence in each check's docstring: which ranks get losses and outputs, a criterion with
``sum`` reduction, BatchNorm statistics across stages and replicas, and ``DistributedDataParallel``'s
state dict keys against torch's.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.utils import consume_prefix_in_state_dict_if_present

from examples.gpt.model import GPT, Block
from lightning_haiscale.cpu_offload import CPUOffload
from lightning_haiscale.ddp import DistributedDataParallel
from lightning_haiscale.fsdp import BackwardPrefetch, FullyShardedDataParallel
from lightning_haiscale.pipeline import GPipe, PipeDream, make_subgroups, partition
from lightning_haiscale.testing.parity import FLOAT64_ATOL, FLOAT64_RTOL, assert_parity, default_dtype
from tests.compat.gpt2 import CFG, DTYPE, RTOL, GPTLoss, assert_matches, global_batch, gpt, shard
from tests.distributed import run_distributed

LR, STEPS, CHUNKS = 0.1, 3, 4


def mlp(batch_norm: bool = False) -> nn.Sequential:
    torch.manual_seed(7)
    widths = [6, 16, 16, 16]
    layers: list[nn.Module] = []
    for a, b in itertools.pairwise(widths):
        layers += [nn.Linear(a, b), *([nn.BatchNorm1d(b)] if batch_norm else []), nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(16, 3))


def data(step: int, rows: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(500 + step)
    return torch.randn(rows, 6, generator=g), torch.randn(rows, 3, generator=g)


def plain(state: dict[str, torch.Tensor]) -> dict[str, list]:
    return {k: v.tolist() for k, v in state.items()}


def sq_sum(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The seed example's criterion: a sum, so the pipeline's summed microbatch gradients are the batch's."""
    return ((out - y) ** 2).sum()


# ----- DDP -------------------------------------------------------------------------------------------------


def ddp_snippet(rank: int, world: int) -> dict:
    """``DistributedDataParallel(model, device_ids=..., process_group=None)``, ``no_sync``, ``reducer.stop()``.

    ``device_ids=[local_rank]`` is the CUDA form; on CPU torch's DDP takes ``None``, and so does ours.
    """
    model = DistributedDataParallel(mlp(), device_ids=None, process_group=None)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(STEPS):
        (x1, _), (x2, _) = data(2 * step), data(2 * step + 1)
        with model.no_sync():  # gradient accumulation: no communication
            model(shard(x1, rank, world)).sum().backward()
        model(shard(x2, rank, world)).sum().backward()  # this backward all-reduces
        opt.step()
        opt.zero_grad()
    state = model.state_dict()
    torch_ddp = nn.parallel.DistributedDataParallel(mlp())
    result = {
        "state": plain(model.module.state_dict()),
        "torch_keys": list(state) == list(torch_ddp.state_dict()),  # "module." prefix, as torch
        "loads_torch": not model.load_state_dict(torch_ddp.state_dict()).missing_keys,  # round trips both ways
    }
    torch_ddp.load_state_dict(state)
    consume_prefix_in_state_dict_if_present(state, "module.")
    mlp().load_state_dict(state)  # the stripped dict loads into the bare model
    model.reducer.stop()  # stop the communication engine at the end
    return result


def two_forwards_one_backward(rank: int, world: int) -> bool:
    """torch's DDP allows several forwards before one backward with BatchNorm (buffers are broadcast before
    each): gradients and buffers must equal torch's (a pipeline stage does this every step)."""
    ours, theirs = DistributedDataParallel(mlp(batch_norm=True)), nn.parallel.DistributedDataParallel(mlp(True))
    x = shard(data(0)[0], rank, world)
    for model in (ours, theirs):
        (model(x) + model(2 * x)).sum().backward()
    pairs = zip(ours.module.state_dict().values(), theirs.module.state_dict().values(), strict=True)
    grads = zip(ours.module.parameters(), theirs.module.parameters(), strict=True)
    tol = {"rtol": FLOAT64_RTOL, "atol": FLOAT64_ATOL}  # float64 (run under _world's DTYPE)
    same = all(torch.allclose(a, b, **tol) for a, b in pairs)
    same &= all(torch.allclose(a.grad, b.grad, **tol) for a, b in grads)
    ours.reducer.stop()
    return same


@default_dtype(DTYPE)
def ddp_reference(world: int) -> dict:
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(STEPS):
        (x1, _), (x2, _) = data(2 * step), data(2 * step + 1)
        ((model(x1).sum() + model(x2).sum()) / world).backward()  # DDP averages the ranks' gradients
        opt.step()
        opt.zero_grad()
    return plain(model.state_dict())


# ----- FSDP ------------------------------------------------------------------------------------------------


def fsdp_snippet(rank: int, world: int, tmp: str) -> dict:
    """Wrap, then build the optimizer from the wrapper; save with the seed's rank-0 snippet."""
    model = FullyShardedDataParallel(gpt(), auto_wrap_policy={Block}, backward_prefetch=BackwardPrefetch.BACKWARD_POST)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)  # after wrapping: this rank's pieces
    losses = []
    for step in range(STEPS):
        tokens = shard(global_batch(step), rank, world)
        loss = GPTLoss()(model(tokens), tokens)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        value = loss.detach().reshape(1)
        dist.all_reduce(value)
        losses.append(value.item() / world)
    with model.summon_full_params():  # inside, state_dict() is local: one rank may call it
        if rank == 0:
            torch.save(model.state_dict(), Path(tmp) / "model.pt")
    return {"losses": losses}


@default_dtype(DTYPE)
def fsdp_reference() -> dict:
    model = gpt()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        tokens = global_batch(step)
        loss = GPTLoss()(model(tokens), tokens)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "state": plain(model.state_dict())}


# ----- pipelines -------------------------------------------------------------------------------------------


def gpipe_snippet(rank: int, world: int) -> dict:
    """``partition(seq, rank, world_size, balance=None)``, ``GPipe(stage, chunks, checkpoint="except_last")``,
    ``forward_backward(x, criterion=, labels=(y,), return_outputs=True)``, ``model(x)`` under ``no_grad``.

    Only the last stage gets ``(losses[chunks], outputs)``, the others ``(None, None)``, as haiscale documents it.
    """
    stage = partition(mlp(), rank, world, balance=None)
    model = GPipe(stage, CHUNKS, checkpoint="except_last")
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    result: dict = {"losses": [], "stage": plain(stage.state_dict())}
    for step in range(STEPS):
        x, y = data(step)
        losses, outputs = model.forward_backward(x, criterion=sq_sum, labels=(y,), return_outputs=True)
        opt.step()
        opt.zero_grad()
        if (losses is None, outputs is None) != (not model.is_last_stage,) * 2:
            raise AssertionError(f"rank {rank}: losses/outputs on the last stage only")
        if losses is not None:
            result["losses"].append(losses.sum().item())
            result["outputs"] = outputs.tolist()
    with torch.no_grad():
        out = model(data(99)[0])  # pipelined evaluation, every rank calls it
    result["eval"] = out.tolist() if out is not None else None
    result["stage"] = plain(stage.state_dict())
    return result


@default_dtype(DTYPE)
def pipeline_reference() -> dict:
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        x, y = data(step)
        out = model(x)
        loss = sq_sum(out, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    with torch.no_grad():
        evaluation = model(data(99)[0]).tolist()
    return {"losses": losses, "outputs": out.tolist(), "eval": evaluation, "state": plain(model.state_dict())}


DP_PP_ROWS = 32  # per replica: microbatches of 8 rows keep BatchNorm's statistics well conditioned


class _MeanOver(nn.Module):
    """haiscale's convention (``GPTLoss(chunks)``): the mean loss of a microbatch divided by ``chunks``."""

    def __init__(self, chunks: int) -> None:
        super().__init__()
        self.chunks = chunks

    def forward(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(out, y) / self.chunks


def dp_pp_snippet(rank: int, world: int) -> dict:
    """``make_subgroups``, ``PipeDream(DistributedDataParallel(stage, process_group=dp_group), chunks, pp_group)``
    with BatchNorm in both stages.

    BatchNorm: a pipeline runs its layers once per microbatch, so each microbatch is normalized by its own
    statistics and the running statistics are updated once per microbatch (``chunks`` times a step); a
    data-parallel stage copies dp rank 0's buffers to its replicas before every forward, as torch's DDP does
    (``broadcast_buffers=True``). The parameters then equal a one-process run over the same microbatches,
    and dp rank 0's statistics those of a run over its own microbatches.
    """
    dp_group, pp_group = make_subgroups(pp_size=2)
    dp_rank, dp_size = dp_group.rank(), dp_group.size()
    stage = partition(mlp(batch_norm=True), pp_group.rank(), pp_group.size())
    model = PipeDream(DistributedDataParallel(stage, process_group=dp_group), CHUNKS, process_group=pp_group)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    criterion = _MeanOver(CHUNKS)
    for step in range(STEPS):
        x, y = data(step, rows=DP_PP_ROWS * dp_size)
        model.forward_backward(shard(x, dp_rank, dp_size), criterion=criterion, labels=(shard(y, dp_rank, dp_size),))
        opt.step()
        opt.zero_grad()
    model.module.reducer.stop()
    return {"stage": plain(stage.state_dict()), "dp_rank": dp_rank}


@default_dtype(DTYPE)
def dp_pp_reference(dp_size: int) -> dict:
    """Parameters: the mean over replicas of each replica's summed microbatch gradients. Buffers: replica 0's."""
    model, replica0 = mlp(batch_norm=True), mlp(batch_norm=True)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(STEPS):
        x, y = data(step, rows=DP_PP_ROWS * dp_size)
        replica0.load_state_dict({k: v for k, v in model.state_dict().items() if not _is_stat(k)}, strict=False)
        with torch.no_grad():
            for xm in shard(x, 0, dp_size).chunk(CHUNKS):
                replica0(xm)
        pieces = zip(x.chunk(CHUNKS * dp_size), y.chunk(CHUNKS * dp_size), strict=True)
        (sum(_MeanOver(CHUNKS)(model(xm), ym) for xm, ym in pieces) / dp_size).backward()
        opt.step()
        opt.zero_grad()
    state = model.state_dict()
    state.update((k, v) for k, v in replica0.state_dict().items() if _is_stat(k))
    return plain(state)


def _is_stat(key: str) -> bool:
    return "running" in key or "num_batches" in key


# ----- CPU offload -----------------------------------------------------------------------------------------


def offload_snippet(rank: int, world: int) -> dict:
    """``with CPUOffload(offload_ratio=0.1, tag="MyModel"): out = model(x)`` under DDP, backward outside.

    On CPU the saved tensors are left where they are (offloading CPU tensors gains nothing); the snippet
    must still run unchanged and train exactly as without it."""
    model = DistributedDataParallel(mlp())
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(STEPS):
        x, y = data(step)
        with CPUOffload(offload_ratio=0.1, tag="MyModel"):
            out = model(shard(x, rank, world))
        F.mse_loss(shard(y, rank, world), out).backward()
        opt.step()
        opt.zero_grad()
    model.reducer.stop()
    return plain(model.module.state_dict())


@default_dtype(DTYPE)
def offload_reference() -> dict:
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(STEPS):
        x, y = data(step)
        F.mse_loss(y, model(x)).backward()
        opt.step()
        opt.zero_grad()
    return plain(model.state_dict())


# ----- one world per size ----------------------------------------------------------------------------------


@default_dtype(DTYPE)
def _world(rank: int, world: int, tmp: str) -> dict:
    return {
        "ddp": ddp_snippet(rank, world),
        "two_forwards": two_forwards_one_backward(rank, world),
        "fsdp": fsdp_snippet(rank, world, tmp),
        "gpipe": gpipe_snippet(rank, world),
        "dp_pp": dp_pp_snippet(rank, world),
        "offload": offload_snippet(rank, world),
    }


@pytest.mark.parametrize("world", [2, 4])
def test_spec_snippets_train_as_one_process(world: int, tmp_path: Path) -> None:
    results = run_distributed(_world, world, str(tmp_path), timeout=300)
    ddp = ddp_reference(world)
    fsdp, pipe, offload = fsdp_reference(), pipeline_reference(), offload_reference()
    dp_pp = dp_pp_reference(world // 2)
    for rank, r in enumerate(results):
        assert_matches(r["ddp"]["state"], ddp, f"ddp rank {rank}")
        assert r["ddp"]["torch_keys"] and r["ddp"]["loads_torch"] and r["two_forwards"]
        assert r["fsdp"]["losses"] == pytest.approx(fsdp["losses"], rel=RTOL)
        assert_matches(r["gpipe"]["stage"], pipe["state"], f"gpipe rank {rank}")
        stage = r["dp_pp"]["stage"]
        if r["dp_pp"]["dp_rank"] != 0:  # replicas' running statistics follow rank 0's, then their own microbatch
            stage = {k: v for k, v in stage.items() if not _is_stat(k)}
        assert_matches(stage, dp_pp, f"dp x pp rank {rank}")
        assert_matches(r["offload"], offload, f"offload rank {rank}")
    last = results[-1]["gpipe"]
    assert last["losses"] == pytest.approx(pipe["losses"], rel=RTOL)
    assert_parity(last, {k: pipe[k] for k in ("outputs", "eval")}, label="gpipe last stage")
    assert all(r["gpipe"]["eval"] is None for r in results[:-1])
    bare = GPT(CFG).to(DTYPE)
    bare.load_state_dict(torch.load(tmp_path / "model.pt", weights_only=True))  # the seed's FSDP checkpoint
    assert_matches(plain(bare.state_dict()), fsdp["state"], "fsdp checkpoint")
